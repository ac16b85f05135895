"""Real data: JSONL and `datasets` sources (files the tests write; nothing from the Hub), field names and dotted
paths, splits, prompts as text or chat messages (TRL's and verl's forms) and --system-prompt, bad rows named by file
and line, and prompts that do not fit the model never trained on."""

import json
from pathlib import Path

import pytest

import common
from common import UsageError
from conftest import read_metrics, run
from harness import load_data
from test_runs import main_fails  # grpo.main stops with the message and writes nothing

GSM8K_LIKE = [
    {"question": f"what is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    for a in range(10, 40)
    for b in range(3)
]  # in the characters the default model's tokenizer knows


def write_jsonl(path: Path, rows: list, raw: bytes = b"") -> str:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + raw)
    return str(path)


# --- JSONL, read without `datasets` ----------------------------------------------------------------


def test_jsonl_with_named_fields_and_gsm8k_answers(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", GSM8K_LIKE)
    train, held_out = load_data(path, None, 10, prompt_field="question", answer_field="answer")
    assert len(train) == 80 and len(held_out) == 10
    assert train[0] == {
        "question": "what is 10 plus 0?",
        "prompt": "what is 10 plus 0?",
        "answer": "10 + 0 = 10\n#### 10",
    }  # every field: an --env environment may read any


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "1+1", "answer": None}, r"d\.jsonl:3: field answer is null"),
        ({"prompt": None, "answer": "2"}, r"d\.jsonl:3: field prompt is null"),
        ({"prompt": "1+1", "answer": ["2"]}, r"d\.jsonl:3: field answer is a list"),
        ({"question": "1+1", "answer": "2"}, r"d\.jsonl:3: missing field prompt.*--prompt-field"),
    ],
)
def test_jsonl_bad_rows_stop_naming_file_and_line(tmp_path, bad, message):
    """A bad row stops naming its file and line: a null answer must not become the string 'None' and be
    trained on."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1", "answer": "2"}] * 2 + [bad])
    with pytest.raises(UsageError, match=message):
        load_data(path, None, 1)


def test_jsonl_with_a_utf8_bom_is_read_as_utf8(tmp_path):
    """Windows editors start a UTF-8 file with a byte-order mark; it is not part of the first row."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\n" for r in GSM8K_LIKE[:4]))
    train, held_out = load_data(str(path), None, 1, prompt_field="question")
    assert set(train[0]) == {"question", "prompt", "answer"} and train[0]["prompt"] == "what is 10 plus 0?"
    assert len(held_out) == 1


def test_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    not_utf8 = b'{"prompt": "\xff", "answer": "1"}\n'
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1", "answer": "2"}], raw=not_utf8)
    with pytest.raises(UsageError, match=r"d\.jsonl:2: not UTF-8"):
        load_data(path, None, 1)


def test_a_null_answer_stops_the_run_before_anything_is_written(tmp_path):
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(20)] + [{"prompt": "9+9", "answer": None}]
    main_fails(
        tmp_path,
        r"train\.jsonl:21: field answer is null",
        dataset=write_jsonl(tmp_path / "train.jsonl", rows),
        eval_size=4,
    )


@pytest.mark.parametrize("field", ["answer", "prompt"])
def test_every_answer_or_prompt_empty_stops_naming_the_field(tmp_path, field):
    """A --answer-field or --prompt-field pointing at a column that is empty in every row would train on a
    reward of 0 (or on the chat template alone) and exit 0: stopped naming the flag."""
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1), field: ""} for a in range(20)]
    main_fails(
        tmp_path,
        f"every {field} is empty.*--{field}-field",
        dataset=write_jsonl(tmp_path / "t.jsonl", rows),
        eval_size=4,
    )


# --- datasets: JSON, Parquet, a folder of files, a save_to_disk folder ---------------------------------


def test_datasets_sources_and_splits(tmp_path):
    import datasets

    parquet = tmp_path / "gsm.parquet"
    datasets.Dataset.from_list(GSM8K_LIKE).to_parquet(str(parquet))
    (tmp_path / "gsm.json").write_text(json.dumps(GSM8K_LIKE))  # one JSON array, not JSONL
    folder = tmp_path / "files"  # a dataset repository's layout: one file per split
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", GSM8K_LIKE[:60])
    write_jsonl(folder / "test.jsonl", GSM8K_LIKE[60:])
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GSM8K_LIKE[:60]), "test": datasets.Dataset.from_list(GSM8K_LIKE[60:])}
    ).save_to_disk(str(saved))
    fields = dict(prompt_field="question", answer_field="answer")
    for source in (parquet, tmp_path / "gsm.json"):
        train, held_out = load_data(str(source), None, 10, **fields)
        assert len(train) == 80 and held_out[-1]["prompt"] == "what is 39 plus 2?"
    for source in (folder, saved):
        train, held_out = load_data(str(source), None, 10, eval_split="test", **fields)
        assert (len(train), len(held_out)) == (60, 30), source
        assert held_out[0]["prompt"] == "what is 30 plus 0?"
        _, held_out = load_data(str(parquet), str(source), 10, **fields)  # --eval-dataset: its 'test' split
        assert len(held_out) == 30
    with pytest.raises(UsageError, match=r"--dataset .*saved.*: no split 'validation'; it has \['train', 'test'\]"):
        load_data(str(saved), None, 10, split="validation", **fields)
    with pytest.raises(UsageError, match=r"gsm\.parquet \[train\] row 0: missing field prompt"):
        load_data(str(parquet), None, 10)


def test_a_null_answer_in_a_parquet_file_names_the_row(tmp_path):
    import datasets

    path = tmp_path / "d.parquet"
    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with pytest.raises(UsageError, match=r"d\.parquet \[train\] row 1: field answer is null"):
        load_data(str(path), None, 1)


def test_without_datasets_the_message_names_the_pip_command(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: importing it raises ImportError
    (tmp_path / "d.parquet").write_bytes(b"")
    with pytest.raises(UsageError, match=r"d\.parquet.* \(not JSONL\) needs datasets: pip install datasets"):
        load_data(str(tmp_path / "d.parquet"), None, 1)
    assert load_data(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}] * 3), None, 1)  # JSONL: fine


def test_a_saved_dataset_trains_end_to_end(tmp_path):
    import datasets

    saved = tmp_path / "gsm"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(GSM8K_LIKE[:60]), "test": datasets.Dataset.from_list(GSM8K_LIKE[60:68])}
    ).save_to_disk(str(saved))
    result = run(
        [
            "grpo.py",
            "--dataset",
            str(saved),
            "--eval-split",
            "test",
            "--prompt-field",
            "question",
            "--num-steps",
            "2",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--eval-every",
            "2",
            "--output-dir",
            str(tmp_path / "runs"),
            "--run-name",
            "gsm",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "gsm")] == [0, 1, 2]


# --- prompts that do not fit ------------------------------------------------------------------------


def gpt2_with_positions(folder: Path, positions: int) -> str:
    """A tiny random GPT-2 (learned absolute positions: an index past the table fails) with the default
    model's tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from harness import DEFAULT_MODEL, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=positions,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_prompt_that_does_not_fit_the_model_is_dropped_with_a_count(tmp_path):
    """A prompt too long for the model's positions is dropped at start-up with a count: sampled, it would
    crash the step (IndexError in GPT-2's position embeddings) or, in a RoPE model, be trained on silently."""
    model = gpt2_with_positions(tmp_path / "gpt2", positions=64)
    rows = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a in range(10, 13) for b in range(10, 14)]
    rows[0]["prompt"] = "1" * 40 + "+1"  # 42 characters: with the chat template and 8 new tokens, over 64
    data = write_jsonl(tmp_path / "train.jsonl", rows)  # 12 rows: 8 to train on, all sampled at step 0
    result = run(
        [
            "grpo.py",
            "--model",
            model,
            "--dataset",
            data,
            "--eval-size",
            "4",
            "--num-steps",
            "1",
            "--prompts-per-step",
            "8",
            "--group-size",
            "2",
            "--eval-every",
            "0",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "fit",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "training data: dropped 1 of 8 prompts that are empty or longer than 56 tokens" in result.stdout


def test_max_prompt_length_drops_and_a_set_left_empty_stops(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1" * n + "+1", "answer": "2"} for n in range(1, 41)])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "1" * 30 + "+1", "answer": "2"}] * 3)
    main_fails(
        tmp_path,
        r"held-out data: all 3 prompts are empty or longer than --max-prompt-length 40 tokens",
        dataset=data,
        eval_dataset=held_out,
        max_prompt_length=40,
    )
    main_fails(
        tmp_path,
        r"--max-new-tokens 200 leaves no room for a prompt in the model's 128 positions",
        dataset=data,
        eval_dataset=held_out,
        max_new_tokens=200,
    )


# --- chat-message prompts (TRL's conversational form, verl's parquet), dotted fields, --system-prompt ------------


def test_chat_prompts_dotted_fields_and_a_system_prompt_reach_the_ids_in_training_and_evaluation(tmp_path, monkeypatch):
    """A JSONL mixing the forms a user brings (TRL's conversational prompt with and without a system message, and
    text) with the answer nested: every prompt grpo.py samples from, in training and in evaluation, is exactly the
    chat template's ids of its messages (`apply_chat_template(..., add_generation_prompt=True)`), with
    --system-prompt put before those that have no system message, and the prompt's own kept where it has one."""
    import grpo
    from harness import DEFAULT_MODEL, cli, load_tokenizer

    own, added = {"role": "system", "content": "add the numbers"}, {"role": "system", "content": "be brief"}
    forms = [lambda p: [own, {"role": "user", "content": p}], lambda p: [{"role": "user", "content": p}], str]
    rows = [
        {"prompt": forms[i % 3](f"{a}+{b}"), "info": {"gold": str(a + b)}}
        for i, (a, b) in enumerate((a, b) for a in range(10, 16) for b in range(20, 22))
    ]
    tokenizer, expected = load_tokenizer(DEFAULT_MODEL), {}
    for row in rows:  # what the test expects, worked out here: the system message added to the rows without one
        messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        messages = messages if messages[0]["role"] == "system" else [added, *messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        expected[tuple(ids)] = messages[0]["content"]
    seen, real = {"train": [], "eval": []}, grpo.generate

    def recording(where):
        def generate(model, tokenizer, prompts, *args, **kwargs):
            rollout = real(model, tokenizer, prompts, *args, **kwargs)
            mask = rollout.attention_mask[:, : rollout.prompt_length].bool()
            seen[where] += [
                tuple(ids[m].tolist()) for ids, m in zip(rollout.input_ids[:, : rollout.prompt_length], mask)
            ]
            return rollout

        return generate

    monkeypatch.setattr(grpo, "generate", recording("train"))
    monkeypatch.setattr(common, "generate", recording("eval"))
    grpo.main(
        cli(
            grpo.Args,
            args=[
                "--dataset",
                write_jsonl(tmp_path / "conv.jsonl", rows),
                "--eval-size",
                "6",
                "--answer-field",
                "info.gold",
                "--system-prompt",
                "be brief",
                "--num-steps",
                "2",
                "--prompts-per-step",
                "4",
                "--group-size",
                "2",
                "--eval-every",
                "2",
                "--output-dir",
                str(tmp_path / "runs"),
                "--run-name",
                "conv",
            ],
        )
    )
    for where, ids in seen.items():
        assert ids and set(ids) <= set(expected), where  # every prompt: exactly one of the expected renderings
        assert {expected[x] for x in ids} == {"add the numbers", "be brief"}, where  # both kinds, in both
    assert len(set(seen["eval"])) == 6  # each held-out prompt
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "conv")] == [0, 1, 2]
    train = load_data(str(tmp_path / "conv.jsonl"), None, 6, answer_field="info.gold")[0]
    assert [row["answer"] for row in train[:3]] == ["30", "31", "31"]  # (a system message: the tiny model gets none)


def test_dapo_trains_on_a_parquet_file_in_dapo_math_17k_schema(tmp_path):
    """verl's layout, as DAPO-Math-17k stores it: `prompt` a list of messages, the answer in the `reward_model`
    struct (with `style`), `data_source`, `ability` and an `extra_info` struct beside them."""
    import datasets

    import dapo
    from harness import cli

    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": f"{a}+{b}"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(a + b), "style": "rule-lean"},
            "extra_info": {"index": f"{a}-{b}", "split": "train"},
        }
        for a in range(10, 20)
        for b in range(30, 32)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "dapo-math-17k.parquet"))
    train, held_out = load_data(
        str(tmp_path / "dapo-math-17k.parquet"), None, 4, answer_field="reward_model.ground_truth"
    )
    assert train[0]["prompt"] == [{"role": "user", "content": "10+30"}] and train[0]["answer"] == "40"
    assert train[0]["extra_info"] == {"index": "10-30", "split": "train"}  # every field: an --env may read any
    dapo.main(
        cli(
            dapo.Args,
            args=[
                "--dataset",
                str(tmp_path / "dapo-math-17k.parquet"),
                "--eval-size",
                "4",
                "--answer-field",
                "reward_model.ground_truth",
                "--num-steps",
                "2",
                "--prompts-per-step",
                "4",
                "--group-size",
                "4",
                "--eval-every",
                "0",
                "--output-dir",
                str(tmp_path / "runs"),
                "--run-name",
                "dapo",
            ],
        )
    )
    logged = read_metrics(tmp_path / "runs" / "dapo")
    assert [m["step"] for m in logged] == [0, 1] and logged[0]["reward/correct"] > 0  # graded on ground_truth


CHAT = {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1"}], "answer": "2"}


@pytest.mark.parametrize(
    "bad, fields, message",
    [
        (
            {"prompt": [{"content": "1+1"}]},
            {},
            r"c\.jsonl:3: field prompt: message 1 must be \{'role': text, "
            r"'content': text\}, got \{'content': '1\+1'\}\. Fix the row, or name another field with --prompt-field\.",
        ),
        (
            {"prompt": [{"role": "user", "content": 2}]},
            {},
            r"c\.jsonl:3: field prompt: message 1 must be .*got "
            r"\{'role': 'user', 'content': 2\}",
        ),
        (
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": "1+1"}]}]},
            {},
            r"c\.jsonl:3: field prompt: "
            "message 1 must be",
        ),
        (
            {"info": {"answer": "2"}},
            {"answer_field": "info.gold"},
            r"c\.jsonl:3: missing field info\.gold \(info has "
            r"answer\)\. Name the field with --answer-field\.",
        ),
        ({"info": "2"}, {"answer_field": "info.gold"}, r"c\.jsonl:3: missing field info\.gold \(info has no fields\)"),
    ],
)
def test_bad_chat_prompts_and_dotted_paths_stop_naming_file_and_line(tmp_path, bad, fields, message):
    good = {**CHAT, "info": {"gold": "2"}}
    path = write_jsonl(tmp_path / "c.jsonl", [good, good, {**good, **bad}])
    with pytest.raises(UsageError, match=message):
        load_data(path, None, 1, **fields)


def test_a_field_whose_name_holds_a_dot_is_read_whole(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1", "reward_model.ground_truth": "2"}] * 2)
    assert load_data(path, None, 1, answer_field="reward_model.ground_truth")[0][0]["answer"] == "2"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(chat_template=False),
            r"c\.jsonl:1: field prompt: chat messages, which need a chat template; "
            r"--no-chat-template turns it off\. Leave --no-chat-template out, or give them as text\.",
        ),
        (
            dict(chat_template=False, system_prompt="be brief", dataset=None),
            r"--system-prompt 'be brief': a system message needs the chat template; --no-chat-template turns it off\.",
        ),
    ],
)
def test_messages_or_a_system_prompt_without_the_chat_template_stop(tmp_path, flags, message):
    main_fails(tmp_path, message, **{"dataset": write_jsonl(tmp_path / "c.jsonl", [CHAT] * 8), "eval_size": 2, **flags})


def test_messages_with_a_model_whose_tokenizer_has_no_chat_template_stop(tmp_path):
    import shutil

    from harness import DEFAULT_MODEL

    shutil.copytree(DEFAULT_MODEL, tmp_path / "plain", ignore=shutil.ignore_patterns("chat_template.jinja"))
    main_fails(
        tmp_path,
        r"c\.jsonl:1: field prompt: chat messages, which need a chat template; --model .*plain has "
        r"none\. Pass a --model that has one, or give them as text\.",
        model=str(tmp_path / "plain"),
        dataset=write_jsonl(tmp_path / "c.jsonl", [CHAT] * 8),
        eval_size=2,
    )


def test_an_empty_system_prompt_is_an_empty_system_message():
    """`--system-prompt ""` is a system message with no text (it replaces a template's default one, as Qwen2.5's),
    not the flag left out; on the built-in task too, whose prompts are text."""
    import grpo
    from common import format_prompt
    from harness import check_flags, cli, load_task

    check_flags(args := cli(grpo.Args, args=["--system-prompt", "", "--eval-size", "4"]))
    task = load_task(args)
    tokenizer, train, held_out = task.tokenizer, task.train, task.held_out
    assert train[0]["prompt"] == [{"role": "system", "content": ""}, {"role": "user", "content": "86+28"}]
    assert format_prompt(tokenizer, held_out[0]["prompt"], True).startswith("<|im_start|>system\n<|im_end|>\n")


# --- inputs as users give them, round two (#62) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(eval_split="test"),
            r"--eval-split test: .*d\.jsonl' is a JSONL file, which has no splits: the held-out rows "
            r"would be the training rows\. Pass --eval-dataset with a file of held-out rows, or leave "
            r"--eval-split out to "
            r"hold out the last --eval-size rows\.",
        ),
        (
            dict(split="validation"),
            r"--split validation: .*d\.jsonl' is a JSONL file, which has no splits\. Leave --split "
            r"out, or pass a dataset that has them\.",
        ),
        (
            dict(eval_dataset="SAME"),
            r"--eval-dataset .*d\.jsonl': the held-out rows would be the training rows\. Pass "
            r"--eval-dataset with other rows",
        ),
    ],
)
def test_a_split_flag_on_data_without_splits_stops_and_the_held_out_rows_are_never_the_training_rows(
    tmp_path, flags, message
):
    """A JSONL file has no splits: --eval-split or --split were ignored, and the held-out set was the training file
    itself (accuracy on the training rows, logged as held-out). Read as `datasets` reads them, a JSON or Parquet file
    has one split, 'train', so --eval-split train (the split trained on) gave the same rows: refused too."""
    import datasets

    path = write_jsonl(tmp_path / "d.jsonl", GSM8K_LIKE[:20])
    flags = {key: path if value == "SAME" else value for key, value in flags.items()}
    with pytest.raises(UsageError, match=message):
        load_data(path, flags.pop("eval_dataset", None), 5, prompt_field="question", **flags)
    datasets.Dataset.from_list(GSM8K_LIKE[:20]).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(
        UsageError,
        match=r"--eval-split train: the split 'train' of .*d\.parquet' is the one trained "
        r"on: the held-out rows would be the training rows",
    ):
        load_data(str(tmp_path / "d.parquet"), None, 5, eval_split="train", prompt_field="question")


def test_a_prompt_that_ends_with_the_assistants_message_is_continued(tmp_path, capsys):
    """[user, assistant 'The answer is']: the assistant's turn is continued (a prefill), as TRL does with
    continue_final_message, not closed and a new one opened; the start-up says how many prompts end so (SFT data's
    `messages`, whose last message is the gold answer, would put it into every prompt)."""
    import grpo
    from common import format_prompt
    from harness import DEFAULT_MODEL, check_flags, cli, load_task, load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prefill = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "1+2="}]
    assert format_prompt(tokenizer, prefill, True) == "<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n1+2="
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}+2"}, {"role": "assistant", "content": f"{a}+2="}],
            "answer": str(a + 2),
        }
        for a in range(10, 20)
    ] + [{"prompt": "3+4", "answer": "7"}] * 4
    check_flags(args := cli(grpo.Args, ["--dataset", write_jsonl(tmp_path / "p.jsonl", rows), "--eval-size", "4"]))
    load_task(args)
    assert (
        "training data: 10 of 10 prompts end with the assistant's message, continued (a prefill"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize("chat_template", [True, False])
def test_empty_prompts_are_dropped_and_counted_with_and_without_the_chat_template(tmp_path, capsys, chat_template):
    """'' and ' ' as text, and (with the template) a user message whose content is empty: no question, so dropped and
    counted, as docs/data.md says; with the template on they used to become an empty user turn, trained on."""
    import grpo
    from harness import check_flags, cli, load_task

    rows = [{"prompt": f"{a}+2", "answer": str(a + 2)} for a in range(10, 20)]
    rows += [{"prompt": "", "answer": "1"}, {"prompt": " ", "answer": "1"}]
    if chat_template:
        rows += [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": ""}], "answer": "1"}]
    flags = ["--dataset", write_jsonl(tmp_path / "e.jsonl", rows), "--eval-size", "0", "--eval-every", "0"]
    check_flags(args := cli(grpo.Args, flags + ([] if chat_template else ["--no-chat-template"])))
    train = load_task(args).train
    assert len(train) == 10 and all(row["prompt"] for row in train)
    dropped = 3 if chat_template else 2
    out = capsys.readouterr().out
    assert f"training data: dropped {dropped} of {len(rows)} prompts that are empty or longer" in out


GEMMA_LIKE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_empty_message_list_or_a_template_that_raises_is_one_line(tmp_path):
    """`"prompt": []` was transformers' ValueError (or an IndexError with --system-prompt); a chat template that
    raises (Gemma 2's refuses a system role) was a jinja2 traceback. Each is one line before any model loads: the
    file and line, or the flag, and the template's own message."""
    import shutil

    from harness import DEFAULT_MODEL

    good = [{"prompt": f"{a}+2", "answer": str(a + 2)} for a in range(10, 20)]
    main_fails(
        tmp_path,
        r"x\.jsonl:11: field prompt: no messages \(an empty list\)\. Fix the row, or name another "
        r"field with --prompt-field\.",
        dataset=write_jsonl(tmp_path / "x.jsonl", good + [{"prompt": [], "answer": "1"}]),
        eval_size=2,
    )
    shutil.copytree(DEFAULT_MODEL, tmp_path / "gemma_like")
    (tmp_path / "gemma_like" / "chat_template.jinja").write_text(GEMMA_LIKE)
    model = str(tmp_path / "gemma_like")
    main_fails(
        tmp_path,
        r"--system-prompt 'be brief': the chat template of --model .*gemma_like refuses it: System "
        r"role not supported\.",
        model=model,
        system_prompt="be brief",
        eval_size=4,
    )
    system = [{"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2"}], "answer": "3"}]
    main_fails(
        tmp_path,
        r"--dataset .*s\.jsonl: row 11: the chat template of --model .*gemma_like refuses its "
        r"prompt: System role not supported\.",
        model=model,
        eval_size=2,
        dataset=write_jsonl(tmp_path / "s.jsonl", good + system),
    )


def test_gzipped_jsonl_and_json_are_read(tmp_path):
    """`.jsonl.gz` (how many datasets ship) read as JSONL, without `datasets` and without a Hub look-up (it was looked
    up as a dataset named 'gz': 25 s of retries, then a misleading line); `.json.gz` as JSON."""
    import gzip

    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(row) + "\n" for row in GSM8K_LIKE[:20]))
    with gzip.open(tmp_path / "d.json.gz", "wt") as f:
        f.write(json.dumps(GSM8K_LIKE[:20]))
    for name in ("d.jsonl.gz", "d.json.gz"):
        train, held_out = load_data(str(tmp_path / name), None, 5, prompt_field="question")
        assert (len(train), len(held_out)) == (15, 5) and train[0]["prompt"] == "what is 10 plus 0?", name
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "1+1", "answer": "2"}\nnot json\n'))
    with pytest.raises(UsageError, match=r"bad\.jsonl\.gz:2: not valid JSON"):
        load_data(str(tmp_path / "bad.jsonl.gz"), None, 1)
