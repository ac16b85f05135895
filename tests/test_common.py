"""The plumbing (common.py, models.py, data.py, rewards.py): tokenizer, data, generation, log-probs and rewards."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from common import (
    UsageError,
    call_reward_fn,
    cat_rollouts,
    final_answer,
    format_prompt,
    generate,
    get_logprobs,
    micro_batches,
    prompt_batch,
    score,
    select_rows,
)
from conftest import ROOT
from harness import DEFAULT_MODEL, builtin_splits, load_model, load_object, load_rows, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model(tokenizer):
    return load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)


# --- tokenizer and data -------------------------------------------------------------------------


def test_tiny_tokenizer_round_trips_spaces_and_newlines():
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)  # what any user code does
    text = "12 + 3\n= 15"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.eos_token == "<|im_end|>"
    prompt = format_prompt(tok, "3+4", chat_template=True)
    assert prompt == "<|im_start|>user\n3+4<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(tok, "3+4", chat_template=False) == "3+4"


def test_builtin_splits_are_disjoint_and_fixed():
    train, eval_set = builtin_splits()
    assert len(eval_set) == 500 and len(train) == 9500
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in eval_set}
    assert eval_set == builtin_splits()[1]
    a, b = map(int, eval_set[0]["prompt"].split("+"))
    assert eval_set[0]["answer"] == str(a + b)


def test_prompt_batch_shards_one_global_order():
    examples = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    for step in range(4):  # 4 steps x 4 prompts crosses an epoch boundary
        whole = prompt_batch(examples, step, 4, rank=0, world_size=1, seed=3)
        shards = prompt_batch(examples, step, 4, 0, 2, 3) + prompt_batch(examples, step, 4, 1, 2, 3)
        assert shards == whole
    epoch0 = [p["prompt"] for s in range(2) for p in prompt_batch(examples, s, 5, 0, 1, seed=3)]
    assert sorted(epoch0, key=int) == [str(i) for i in range(10)]  # each example once per epoch
    assert prompt_batch(examples, 0, 4, 0, 1, seed=4) != prompt_batch(examples, 0, 4, 0, 1, seed=3)


def test_load_rows_of_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+1", "answer": 2}\n\n{"prompt": "x", "answer": "y", "extra": 1}\n')
    assert load_rows(str(path)) == [{"prompt": "1+1", "answer": "2"}, {"prompt": "x", "answer": "y", "extra": 1}]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a", "answer": "b"}\n{"prompt": "a" "answer"}\n', "d.jsonl:2: not valid JSON"),
        ('{"prompt": "a", "answer": "b"}\n{"prompt": "a"}\n', "d.jsonl:2: missing field answer"),
        ('["prompt", "answer"]\n', r"d.jsonl:1: missing field prompt \(the row has no fields\)"),
        ("\n\n", "has no examples"),
    ],
)
def test_load_rows_errors_name_file_and_line(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        load_rows(str(path))


# --- generation and log-probs -------------------------------------------------------------------


def test_rollout_masks_and_groups(model, tokenizer):
    torch.manual_seed(0)
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")]  # different lengths: left padding
    r = generate(model, tokenizer, prompts, group_size=3, max_new_tokens=6, temperature=1.0)
    B, L = r.response_mask.shape
    assert B == 6 and r.input_ids.shape == (6, r.prompt_length + L)
    response = r.input_ids[:, r.prompt_length :]
    for i in range(B):
        n = int(r.response_mask[i].sum())
        assert r.response_mask[i, :n].all() and not r.response_mask[i, n:].any()  # a prefix
        if r.truncated[i]:
            assert n == 6 and tokenizer.eos_token_id not in response[i].tolist()
        else:
            assert response[i, n - 1] == tokenizer.eos_token_id  # EOS is the last masked-in token
            assert (response[i, n:] == tokenizer.pad_token_id).all()
        assert r.texts[i] == tokenizer.decode(response[i, : n - (not r.truncated[i])])
    assert (r.attention_mask[:, r.prompt_length :] == r.response_mask).all()
    first_prompt = r.input_ids[0, : r.prompt_length]
    assert (r.input_ids[:3, : r.prompt_length] == first_prompt).all()  # a group shares its prompt, rows 0..2
    assert r.attention_mask[0, 0] == 0 and r.attention_mask[3, 0] == 1  # the shorter prompt is left-padded


def test_recomputed_logprobs_match_generate_logits_under_temperature(model, tokenizer):
    """The training forward (full sequence, position ids from the mask) scores the sampled tokens
    exactly as the sampler's own logits did: log_softmax(raw_logits / T)."""
    T = 0.7
    torch.manual_seed(0)
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67", "99+9")]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **enc,
        do_sample=True,
        temperature=T,
        top_k=0,
        top_p=1.0,
        max_new_tokens=6,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    P = enc.input_ids.shape[1]
    response = out.sequences[:, P:]
    raw = torch.stack(out.logits, 1)  # (B, L, V) before any processing
    expected = torch.log_softmax(raw.float() / T, -1).gather(-1, response[..., None]).squeeze(-1)
    is_eos = response == tokenizer.eos_token_id
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), response.shape[1])
    mask = (torch.arange(response.shape[1])[None] <= first[:, None]).long()
    ids = torch.cat([enc.input_ids, response], 1)
    attention = torch.cat([enc.attention_mask, mask], 1)
    logprobs, entropy = get_logprobs(model, ids, attention, P, T)
    torch.testing.assert_close(logprobs * mask, expected * mask, atol=2e-5, rtol=0)
    assert (entropy[mask.bool()] > 0).all()
    without_entropy, none = get_logprobs(model, ids, attention, P, T, entropy=False)  # the no-grad passes' call
    assert none is None and torch.equal(without_entropy, logprobs)


@pytest.fixture
def float64_model(model, monkeypatch):
    """The model in float64 throughout, so that only a real difference shows. transformers' Qwen3 RMSNorm
    computes in float32 whatever the weights' dtype; in a float64 model that rounds to float32, and two
    forwards that sum the same gradients in another order (a prompt's, once per row or once per group)
    then differ by float32's ~1e-7. Here it computes in the input's dtype, as it does in float32 runs."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(Qwen3RMSNorm, "forward", forward)
    return copy.deepcopy(model).double()


def naive_logprobs(model, ids, attention, P, T):
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits[:, P - 1 : -1]
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / T, -1)
    return logprobs.gather(-1, ids[:, P:, None]).squeeze(-1) * attention[:, P:]


@pytest.mark.parametrize(
    "recompute_above, chunk_size",
    [
        (0, 5),  # chunks recomputed in the backward pass
        (2**27, 5),  # chunks kept for it
        (2**27, None),  # kept, in one product (the default below the threshold)
    ],
)
def test_chunked_logprobs_and_gradients_equal_full_log_softmax(float64_model, tokenizer, recompute_above, chunk_size):
    model = float64_model
    torch.manual_seed(0)
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")]
    r = generate(model, tokenizer, prompts, 2, 6, 1.0)
    expected = naive_logprobs(model, r.input_ids, r.attention_mask, r.prompt_length, 1.3)
    (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logprobs, _ = get_logprobs(
        model,
        r.input_ids,
        r.attention_mask,
        r.prompt_length,
        1.3,
        chunk_size=chunk_size,
        recompute_above=recompute_above,
    )
    torch.testing.assert_close(logprobs, expected, atol=1e-12, rtol=0)
    (logprobs * torch.arange(logprobs.numel()).view_as(logprobs)).sum().backward()
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-9, rtol=1e-9)


def positions_through_first_layer(model) -> tuple[list[tuple[int, int]], object]:
    """(rows, positions) of every call of the first decoder layer, and the hook's handle."""
    shapes = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape[:2])))
    return shapes, handle


def test_rows_that_share_a_prompt_run_its_forward_once(float64_model, tokenizer):
    """A group's G completions share their prompt. get_logprobs runs each distinct prompt once, then every
    row's response tokens against that prompt's cached keys and values, wherever the rows sit in the
    batch (the update's micro-batches are random rows). Causal attention: a prompt's states never see
    the response, so the log-probs are the ones of the whole rows' forward, and each weight's gradient
    is the sum over the rows, as there. Checked in float64 against the plain forward of every row."""
    model = float64_model
    torch.manual_seed(0)
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")]
    r = generate(model, tokenizer, prompts, 3, 6, 1.0)
    rows = torch.tensor([4, 0, 3, 1, 5, 2])  # the two groups interleaved
    ids, attention, P = r.input_ids[rows], r.attention_mask[rows], r.prompt_length
    L = ids.shape[1] - P
    expected = naive_logprobs(model, ids, attention, P, 1.3)
    (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    shapes, handle = positions_through_first_layer(model)
    logprobs, entropy = get_logprobs(model, ids, attention, P, 1.3)
    handle.remove()
    assert shapes == [(2, P), (6, L)]  # 2 distinct prompts of P tokens, then 6 responses of L (not 6 x (P + L))
    torch.testing.assert_close(logprobs, expected, atol=1e-12, rtol=0)
    (logprobs * torch.arange(logprobs.numel()).view_as(logprobs)).sum().backward()
    for p, g in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, g, atol=1e-9, rtol=1e-9)

    with torch.no_grad():  # the reference and old log-probs: the same forward, without gradients
        shapes, handle = positions_through_first_layer(model)
        no_grad, _ = get_logprobs(model, ids, attention, P, 1.3, entropy=False)
        handle.remove()
    assert shapes == [(2, P), (6, L)]
    torch.testing.assert_close(no_grad, expected, atol=1e-12, rtol=0)


def test_without_a_repeated_prompt_or_under_gradient_checkpointing_the_rows_run_whole(model, tokenizer):
    """Nothing to share (one completion per prompt), or gradient checkpointing in train mode, where
    transformers drops the KV cache: one forward of the whole rows, with the same log-probs."""
    model = copy.deepcopy(model)
    torch.manual_seed(0)
    r = generate(model, tokenizer, [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")], 2, 6, 1.0)
    ids, attention, P = r.input_ids, r.attention_mask, r.prompt_length
    shared, _ = get_logprobs(model, ids, attention, P, 1.0)

    shapes, handle = positions_through_first_layer(model)
    get_logprobs(model, ids[::2], attention[::2], P, 1.0)  # one row per prompt
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    whole, _ = get_logprobs(model, ids, attention, P, 1.0)
    handle.remove()
    assert shapes == [(2, ids.shape[1]), (4, ids.shape[1])]
    torch.testing.assert_close(whole, shared, atol=1e-6, rtol=0)


def test_a_micro_batch_runs_on_the_columns_its_rows_use(model, tokenizer):
    """A micro-batch of a rollout whose other rows are longer on both sides (here 3 columns of left padding and 5
    of right padding that none of its rows needs) runs its forward on its own rows' columns only: its prompt's
    last P' and its responses' first L' columns. Its log-probs, entropies and a critic's values (ppo.py's, with a
    random head) are each row's alone without any padding, to 1e-5 in fp32, and 0 on the columns cut."""
    from transformers import AutoModel

    import ppo

    torch.manual_seed(0)
    r = generate(model, tokenizer, [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")], 2, 6, 1.0)
    P = r.prompt_length + 3
    ids = torch.nn.functional.pad(r.input_ids, (3, 5), value=tokenizer.pad_token_id)  # (4, P + L), as a wider rollout
    mask = torch.nn.functional.pad(r.attention_mask, (3, 5))
    critic = ppo.Critic(load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer, AutoModel))
    torch.nn.init.normal_(critic.value_head.weight)
    shapes, handle = positions_through_first_layer(model)
    logprobs, entropy = get_logprobs(model, ids, mask, P, 1.0)
    handle.remove()
    assert shapes == [(2, r.prompt_length), (4, r.input_ids.shape[1] - r.prompt_length)]  # not (2, P), (4, L)
    values = critic(ids, mask, P)
    for i in range(4):  # each row alone: its real tokens only
        used = mask[i].bool()
        row_ids, row_P = ids[i, used][None], int(mask[i, :P].sum())
        alone = [x[0] for x in get_logprobs(model, row_ids, torch.ones_like(row_ids), row_P, 1.0)]
        n = len(alone[0])
        for cut, row in zip(
            (logprobs[i], entropy[i], values[i]), (*alone, critic(row_ids, torch.ones_like(row_ids), row_P)[0])
        ):
            torch.testing.assert_close(cut[:n], row, atol=1e-5, rtol=0)
            assert (cut[n:] == 0).all()


def test_micro_batches_by_a_token_budget_hand_worked():
    """Five rows of (prompt, response) tokens (2, 6), (4, 1), (3, 3), (2, 2), (4, 5), left- and right-padded to 4 + 6
    columns; a micro-batch costs its rows x (widest prompt + longest response). Longest first (9, 8, 6, 5, 4) into
    16 tokens: row 4 (9); row 0 would make 2 x (4 + 6) = 20, so alone (8); row 2 (6), then row 1: 2 x (4 + 3) = 14;
    row 3 would make 3 x 7 = 21: alone. A row over the budget runs alone."""
    lengths = [(2, 6), (4, 1), (3, 3), (2, 2), (4, 5)]
    mask = torch.tensor([[0] * (4 - p) + [1] * (p + r) + [0] * (6 - r) for p, r in lengths])

    def cut(*args, **kwargs) -> list[list[int]]:
        return [batch.tolist() for batch in micro_batches(*args, **kwargs)]

    rows = torch.arange(5)
    assert cut(rows, mask, 4, 5, 16) == [[4], [0], [1, 2], [3]]
    assert cut(rows, mask, 4, 5, 4) == [[4], [0], [2], [1], [3]]  # each over 4 tokens: alone
    assert cut(rows, mask, 4, 1, 100) == [[4], [0], [2], [1], [3]]  # at most 1 row
    assert cut(rows, mask, 4, 2) == [[0, 1], [2, 3], [4]]  # no budget: --micro-batch-size rows in their order


def test_micro_batches_keep_groups_whole_where_their_shared_prompt_pays():
    """Two groups of 2 rows (rows 0-1 and 2-3 share a prompt), budget 20. Responses long and uneven (prompts 1,
    responses 8, 1, 8, 1): by rows, [0, 2] and [1, 3] compute 2 x 1 + 2 x 8 and 2 x 1 + 2 x 1 = 22 positions (each
    group's prompt once a micro-batch); by groups, [0, 1] and [2, 3] 2 x (1 + 2 x 8) = 34: rows. Prompts long
    (8, responses 1, 4, 2, 3), budget 24: by rows, [1, 3] and [0, 2], 2 x 8 + 2 x 4 + 2 x 8 + 2 x 2 = 44; by
    groups, 8 + 2 x 4 + 8 + 2 x 3 = 30: groups. `whole` keeps groups together even where rows compute fewer."""

    def cut(lengths: list[tuple[int, int]], budget: int, group_size: int = 2, **kwargs) -> list[list[int]]:
        mask = torch.tensor([[0] * (8 - p) + [1] * (p + r) + [0] * (8 - r) for p, r in lengths])
        return [b.tolist() for b in micro_batches(torch.arange(4), mask, 8, 4, budget, group_size, **kwargs)]

    long_responses = [(1, 8), (1, 1), (1, 8), (1, 1)]
    assert cut(long_responses, 20) == [[0, 2], [1, 3]]
    assert cut(long_responses, 20, whole_groups=True) == [[0, 1], [2, 3]]
    assert cut([(8, 1), (8, 4), (8, 2), (8, 3)], 24) == [[0, 1], [2, 3]]
    assert cut([(8, 1), (8, 4), (8, 2), (8, 3)], 24, group_size=1) == [[1, 3], [0, 2]]  # no groups: by rows


def test_left_padding_does_not_change_logprobs(model, tokenizer):
    """Position ids follow the mask: a sequence scores the same alone and left-padded in a batch."""
    torch.manual_seed(0)
    r = generate(model, tokenizer, [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")], 1, 6, 1.0)
    batched, _ = get_logprobs(model, r.input_ids, r.attention_mask, r.prompt_length, 1.0)
    pad = int((r.attention_mask[0, : r.prompt_length] == 0).sum())
    alone, _ = get_logprobs(model, r.input_ids[:1, pad:], r.attention_mask[:1, pad:], r.prompt_length - pad, 1.0)
    assert pad > 0
    torch.testing.assert_close(alone, batched[:1], atol=1e-5, rtol=0)


# --- rewards ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box, nested braces
        ("work... #### 1,234", "1,234"),
        ("#### 72 dollars\nQuestion: 5 apples", "72"),  # the number after '####', not what follows it
        ("#### \\frac{1}{2}\nmore", "\\frac{1}{2}"),  # not a plain number: the line after '####'
        ("3 apples and 5 pears: 8", None),  # no explicit answer: math-verify reads the whole text
        ("\\boxed{7", ""),  # opened and not closed (cut off): no answer, rather than a guess
        ("\\boxed{7} then \\boxed{8", ""),
        ("total 7 ####\n", ""),
        ("", None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_score_components():
    completions = ["12", " 12 ", "12 13", "13"]
    rewards, parts = score([{"prompt": "p", "answer": "12"}], completions, 4, exact_match=True, format_weight=0.5)
    assert parts["correct"].tolist() == [1, 1, 0, 0]  # exact: the whole completion is the answer
    assert parts["format"].tolist() == [1, 1, 0, 1]
    assert rewards.tolist() == [1.5, 1.5, 0, 0.5]
    _, parts = score([{"prompt": "p", "answer": "13"}], completions, 4, exact_match=False)
    assert parts["correct"].tolist() == [0, 0, 1, 1]  # math: the last number


def test_user_reward_fn(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, answers):\n    return [len(c) for c in completions]\n"
        "def broken(prompts, completions, answers):\n    raise KeyError('oops')\n"
        "def short(prompts, completions, answers):\n    return [1.0]\n"
        "def none(prompts, completions, answers):\n    return None\n"
        "def nan(prompts, completions, answers):\n    return [float('nan')] * len(completions)\n"
        "def text(prompts, completions, answers):\n    return ['a'] * len(completions)\n"
    )
    spec = str(tmp_path / "my_rewards.py") + ":length"
    fn = load_object(spec, "--reward-fn", "function")
    rewards, parts = score(
        [{"prompt": "p", "answer": "1"}], ["1", "abc"], 2, exact_match=True, reward_fn=fn, reward_fn_spec=spec
    )
    assert parts["user"].tolist() == [1, 3] and rewards.tolist() == [2, 3]
    for name, message in [
        ("broken", "raised KeyError: 'oops'"),
        ("short", r"one finite float per completion \(2\), got \[1.0\]"),
        ("none", "got None"),
        ("nan", r"got \[nan, nan\]"),
        ("text", r"got \['a', 'a'\]"),
    ]:
        spec = f"{tmp_path / 'my_rewards.py'}:{name}"
        with pytest.raises(UsageError, match=message):
            call_reward_fn(load_object(spec, "--reward-fn", "function"), spec, ["p", "p"], ["1", "2"], ["1", "1"])
    for spec, message in [
        ("no_such_module_xyz:f", "cannot import"),
        ("nocolon", "expected 'module:function'"),
        (f"{tmp_path / 'my_rewards.py'}:missing", "no function"),
        (f"{tmp_path / 'nofile.py'}:f", "cannot import"),
    ]:
        with pytest.raises(UsageError, match=message):
            load_object(spec, "--reward-fn", "function")


def test_a_reward_module_is_imported_from_the_working_directory_and_sys_path_is_left_as_it_was(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards.py").write_text(
        "def one(prompts, completions, answers):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    fn = load_object("cwd_rewards:one", "--reward-fn", "function")
    assert fn(["p"], ["c"], ["a"]) == [1.0] and sys.path == before


@pytest.mark.parametrize("name", ["common", "harness"])
def test_a_users_module_with_the_name_of_one_of_this_projects_is_named_not_shadowed(tmp_path, monkeypatch, name):
    """A user's common.py or harness.py in the working directory is shadowed by this project's module of that name
    (imported already): `name:fn` would be looked up in ours. It stops, saying to pass the file's path, which works."""
    (tmp_path / f"{name}.py").write_text("def mine(prompts, completions, answers):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    message = f"'{name}' is a module of this project; pass your file as path/to/{name}.py:mine"
    with pytest.raises(UsageError, match=message):
        load_object(f"{name}:mine", "--reward-fn", "function")
    assert load_object(f"{tmp_path / name}.py:mine", "--reward-fn", "function")(["p"], ["c"], ["a"]) == [0.0]


def test_importing_the_plumbing_changes_nothing_outside_it():
    """No import-time side effects: transformers' progress bars and sys.path are as they were."""
    child = (
        "import sys, transformers; path = list(sys.path); import common, harness; "
        "print(transformers.utils.logging.is_progress_bar_enabled(), sys.path == path)"
    )
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_a_tokenizer_without_a_pad_token_pads_with_an_existing_id(tmp_path):
    """The model's vocabulary is never changed (a grown one would not load the run's LoRA adapter onto the
    original model): padding takes an existing id, and the masks say where prompts start and completions end,
    so rows padded with it score as they do alone."""
    from test_runs import tiny_llama_without_pad_token

    vocab_size = tiny_llama_without_pad_token(tmp_path / "llama")
    tokenizer = load_tokenizer(str(tmp_path / "llama"))
    model = load_model(str(tmp_path / "llama"), "float32", torch.device("cpu"), tokenizer)
    assert len(tokenizer) == vocab_size == model.get_input_embeddings().num_embeddings
    assert tokenizer.pad_token_id is not None
    torch.manual_seed(0)
    rollout = generate(model, tokenizer, ["1+2=", "12+34="], 4, 6, 1.0)
    logprobs, _ = get_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0)
    for i in range(8):
        n = int(rollout.response_mask[i].sum())
        real = rollout.attention_mask[i, : rollout.prompt_length + n].bool()  # the row without its padding
        ids = rollout.input_ids[i, : rollout.prompt_length + n][real][None]
        alone, _ = get_logprobs(model, ids, torch.ones_like(ids), ids.shape[1] - n, 1.0)
        torch.testing.assert_close(logprobs[i, :n], alone[0], atol=1e-5, rtol=0)
        assert not logprobs[i, n:].any()


def test_cat_and_select_rollouts_keep_rows_and_logprobs(model, tokenizer):
    torch.manual_seed(0)
    a = generate(model, tokenizer, [format_prompt(tokenizer, "1+2", True)], 2, 6, 1.0)
    b = generate(model, tokenizer, [format_prompt(tokenizer, p, True) for p in ("45+67", "9+99")], 2, 3, 1.0)
    both = cat_rollouts([a, b], tokenizer.pad_token_id)
    assert both.prompt_length == b.prompt_length > a.prompt_length
    assert both.texts == a.texts + b.texts and both.truncated.tolist() == a.truncated.tolist() + b.truncated.tolist()
    lp_both, _ = get_logprobs(model, both.input_ids, both.attention_mask, both.prompt_length, 1.0)
    for part, rows in [(a, slice(0, 2)), (b, slice(2, 6))]:
        lp, _ = get_logprobs(model, part.input_ids, part.attention_mask, part.prompt_length, 1.0)
        L = lp.shape[1]
        torch.testing.assert_close(lp_both[rows, :L], lp, atol=1e-5, rtol=0)  # re-padding changes nothing
        assert not lp_both[rows, L:].any() and not both.response_mask[rows, L:].any()
    picked = select_rows(both, torch.tensor([False, True, False, False, True, False]))
    assert picked.texts == [both.texts[1], both.texts[4]]
    assert torch.equal(picked.input_ids, both.input_ids[[1, 4]])


def test_gradient_checkpointing_keeps_only_layer_inputs_in_train_mode(tokenizer):
    """What --gradient-checkpointing does: in train mode the forward keeps far fewer tensors for the
    backward pass (each layer's input; the rest is recomputed), in eval mode HF ignores it (why the
    algorithm files call .train()), and sampling, without gradients, still uses the KV cache."""
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    rollout = generate(model, tokenizer, [format_prompt(tokenizer, "1+2", True)], 2, 4, 1.0)

    def saved_for_backward() -> int:
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(1) or t, lambda t: t):
            get_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0)
        return len(count)

    plain = saved_for_backward()
    model.activation_checkpointing_enable({"use_reentrant": False})
    assert saved_for_backward() == plain  # eval mode: no checkpointing
    model.train()
    assert saved_for_backward() < plain / 4
    calls = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    generate(model, tokenizer, [format_prompt(tokenizer, "1+2", True)], 2, 4, 1.0)
    handle.remove()
    assert len(calls) <= 4  # one forward per new token at most: the KV cache was used


def test_peak_memory_is_this_process_own(tmp_path):
    """Linux carries ru_maxrss over fork and exec: a process started by a larger one would report the
    other's peak (this made the memory benchmark measure 0 growth when pytest held more than it). The
    child started here, after this process touched 2 GiB, reports its own peak, far below that."""
    import subprocess
    import sys
    from pathlib import Path

    held = bytearray(2**31)
    held[:: 2**12] = b"\x01" * (2**31 // 2**12)  # every page resident
    child = "import torch; from common import peak_memory_gb; print(peak_memory_gb(torch.device('cpu')))"
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    del held
    assert 0.05 < float(out.stdout) < 1.5, out.stdout  # torch imported: a few hundred MB, not 2 GiB
