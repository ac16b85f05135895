"""Training and held-out data: the built-in a+b task, JSONL files and anything `datasets` reads, the
prompts as the model sees them, and each step's batch of prompts."""

import functools
import json
import math
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from common import UsageError, print0
from models import from_pretrained


def builtin_splits(max_operand: int = 99, eval_size: int = 500) -> tuple[list[dict], list[dict]]:
    """The built-in task: `a+b` for 0 <= a, b <= max_operand, answered with the sum's digits.
    All pairs, shuffled once with a fixed seed: the first `eval_size` are the held-out split, the rest
    (9,500 by default) the train split."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1234)).tolist()
    examples = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in (pairs[i] for i in order)]
    return examples[eval_size:], examples[:eval_size]


def load_rows(source: str, flag: str = "--dataset", config: str | None = None, split: str | None = "train",
              prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict]:
    """`{"prompt", "answer"}` rows from `source`'s `prompt_field` and `answer_field`: a JSONL file (read here,
    so it needs nothing more, and a bad line names its number), or anything `datasets` reads, with
    `config` and `split`: a Hugging Face dataset name, a JSON, Parquet or CSV file, a folder of such files,
    a `save_to_disk` folder. A missing, null or non-text field stops naming the file and line (or row).
    `split` None takes the dataset's 'test' split, or its only one."""
    if source.endswith(".jsonl") and config is None:
        records = _jsonl_records(Path(source).expanduser(), flag)
    else:
        records = _dataset_records(source, flag, config, split)
    rows = []
    for where, record in records:
        if not isinstance(record, dict):
            raise UsageError(f"{where}: not an object with the fields {prompt_field!r} and {answer_field!r}.")
        for key, field_flag in ((prompt_field, "--prompt-field"), (answer_field, "--answer-field")):
            if key not in record:
                raise UsageError(f"{where}: missing field {key} (it has {', '.join(record) or 'none'}). "
                                 f"Name the field with {field_flag}.")
            if record[key] is None:
                raise UsageError(f"{where}: field {key} is null. Every row needs a {key}.")
            if not isinstance(record[key], (str, int, float)) or isinstance(record[key], bool):
                raise UsageError(f"{where}: field {key} is a {type(record[key]).__name__}; it must be text or a "
                                 "number.")
        rows.append({"prompt": str(record[prompt_field]), "answer": str(record[answer_field])})
    if not rows:
        raise UsageError(f"{flag} {source!r}: the dataset has no examples.")
    return rows


def _jsonl_records(path: Path, flag: str):
    """(file:line, object) for each non-empty line of a JSONL file."""
    if not path.is_file():
        raise UsageError(f"{flag} {str(path)!r}: no such file. Pass a JSONL file with one "
                         '{"prompt": ..., "answer": ...} object a line, or leave it out for the built-in task.')
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start}). "
                                 "Save it as UTF-8.") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise UsageError(f"{path}:{line_no}: not valid JSON ({json_error(e)}). "
                                 "Each line must be one JSON object.") from None
            yield f"{path}:{line_no}", record


def json_error(error: Exception) -> str:
    """What `json.loads` objected to, in a few words (its own message for a number names a function to call)."""
    if isinstance(error, RecursionError):
        return "nested too deep"
    if isinstance(error, json.JSONDecodeError):
        return error.msg
    return f"a number of more than {sys.get_int_max_str_digits()} digits"


def _dataset_records(source: str, flag: str, config: str | None, split: str | None):
    """('<source> [split] row i', row) for each row of what `datasets` reads from `source`."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"{flag} {source!r}: reading a Hugging Face dataset or a file other than JSONL needs "
                         "the datasets package: pip install datasets") from None
    path = Path(source).expanduser()
    builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
    if path.is_file() and builder is None:
        raise UsageError(f"{flag} {source!r}: a {path.suffix or 'extensionless'} file; pass JSONL, JSON, Parquet "
                         "or CSV, a dataset folder or a Hugging Face dataset name.")
    try:
        if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json")):
            data = datasets.load_from_disk(str(path))  # written by save_to_disk
        elif path.is_file():
            data = datasets.load_dataset(builder, data_files=str(path))
        else:
            data = datasets.load_dataset(source, config)
    except (OSError, ValueError, ImportError, RuntimeError) as e:  # RuntimeError: a loading script, refused
        raise UsageError(f"{flag} {source!r}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]}). "
                         "Pass a dataset file or folder, or a Hugging Face dataset name reachable from this "
                         "machine.") from None
    name = split
    if isinstance(data, datasets.DatasetDict):
        if name is None:
            name = "test" if "test" in data or len(data) != 1 else next(iter(data))
        if name not in data:
            which = "--split" if flag == "--dataset" else "--eval-split"
            raise UsageError(f"{flag} {source!r}: no split {name!r}; it has {list(data)}. Choose one with {which}.")
        data = data[name]
    for i, row in enumerate(data):
        yield f"{source} [{name or 'train'}] row {i}", row


def load_data(dataset: str | None, eval_dataset: str | None, eval_size: int, dataset_config: str | None = None,
              split: str = "train", eval_split: str | None = None, prompt_field: str = "prompt",
              answer_field: str = "answer") -> tuple[list[dict], list[dict]]:
    """(train, eval) examples: the built-in task (eval: the first `eval_size` of its fixed order), or
    `load_rows` of `--dataset` (eval: `--eval-dataset`, at `--eval-split` or its 'test' split; else
    `--eval-split` of `--dataset`; else the last `eval_size` rows of `--dataset`)."""
    if dataset is None:
        train, held_out = builtin_splits(eval_size=eval_size)
        if not train:
            raise UsageError(f"--eval-size {eval_size}: the built-in task has {len(held_out)} prompts, so none "
                             "would be left to train on. Hold out fewer (the default is 500).")
        return train, held_out
    fields = dict(prompt_field=prompt_field, answer_field=answer_field)
    train = load_rows(dataset, "--dataset", dataset_config, split, **fields)
    if eval_dataset is not None:
        return train, load_rows(eval_dataset, "--eval-dataset", None, eval_split, **fields)
    if eval_split is not None:
        return train, load_rows(dataset, "--dataset", dataset_config, eval_split, **fields)
    if len(train) <= eval_size:
        raise UsageError(f"--dataset {dataset!r} has {len(train)} rows, too few to hold out --eval-size {eval_size}. "
                         "Pass --eval-dataset or --eval-split, or a smaller --eval-size.")
    return train[:len(train) - eval_size], train[len(train) - eval_size:]  # eval_size 0: all rows train


def model_positions(name: str, flag: str = "--model") -> int | None:
    """How many positions (prompt and completion tokens together) the model at `name` takes, from its
    config; None when the config states no limit."""
    try:
        config = from_pretrained(AutoConfig, name, flag).get_text_config()
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {name!r}: cannot read its config ({str(e).splitlines()[0]}). "
                         "Pass a local folder or a Hugging Face model name reachable from this machine.") from None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def fit_prompts(train: list[dict], held_out: list[dict], tokenizer, chat_template: bool,
                max_prompt_length: int | None, max_new_tokens: int, positions: int | None
                ) -> tuple[list[dict], list[dict]]:
    """(train, held_out) restricted to the examples whose prompt, formatted as it will be sampled from, has
    at most `max_prompt_length` tokens and leaves room for `max_new_tokens` within the model's
    `positions`. A longer one would be trained on garbage (rotary positions past the trained range) or
    crash the step that draws it (learned positions). The others are dropped with a printed count; a
    set left empty stops the run."""
    limit = min(max_prompt_length or math.inf, positions - max_new_tokens if positions else math.inf)
    if limit < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's {positions} "
                         "positions. Lower --max-new-tokens.")
    if limit == max_prompt_length:
        why = f"longer than --max-prompt-length {limit} tokens"
    else:
        why = (f"longer than {limit} tokens (the model takes {positions} positions, --max-new-tokens "
               f"{max_new_tokens} of them for the completion)")
    fitted = []
    for examples, what in ((train, "training data"), (held_out, "held-out data")):
        if not examples:  # no held-out data (--eval-size 0)
            fitted.append([])
            continue
        texts = [format_prompt(tokenizer, e["prompt"], chat_template) for e in examples]
        try:
            prompts = tokenizer(texts, add_special_tokens=False).input_ids
        except Exception as e:  # e.g. a word-level tokenizer without an unknown token meets a new character
            raise UsageError(_unencodable(tokenizer, examples, what, e)) from None
        empty = sum(len(ids) == 0 for ids in prompts)  # nothing to continue from
        if empty == len(examples):
            raise UsageError(f"{what}: all {len(examples)} prompts are empty (no token, and no chat template or BOS "
                             "token around them). Check --prompt-field, or leave --chat-template on.")
        if empty:
            print0(f"{what}: dropped {empty} of {len(examples)} prompts that are empty (no token)")
        kept = [e for e, ids in zip(examples, prompts) if 0 < len(ids) <= limit]
        if not kept:
            raise UsageError(f"{what}: all {len(examples)} prompts are {why}. Raise --max-prompt-length, or lower "
                             "--max-new-tokens.")
        if len(kept) < len(examples) - empty:
            print0(f"{what}: dropped {len(examples) - empty - len(kept)} of {len(examples)} prompts {why}")
        fitted.append(kept)
    check_round_trip(tokenizer, train[:64])
    return fitted[0], fitted[1]


def check_round_trip(tokenizer, examples: list[dict]) -> None:
    """Warn when prompts do not come back from encode + decode as they were: the model would be trained
    on other text than the data's (e.g. a tokenizer class that drops spaces, or an unknown-token fallback)."""
    for example in examples:
        text = example["prompt"]
        back = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids)
        if back != text:
            print0(f"warning: the tokenizer of --model ({type(tokenizer).__name__}) does not give the prompts back "
                   f"as they were: {text[:60]!r} comes back as {back[:60]!r}. The model is trained on what it "
                   "encodes; check that the folder's tokenizer files are the model's own.")
            return


def _unencodable(tokenizer, examples: list[dict], what: str, error: Exception) -> str:
    """The message naming the first row, and character, of `examples` that `tokenizer` cannot encode."""
    for i, example in enumerate(examples):
        for char in dict.fromkeys(example["prompt"]):
            try:
                tokenizer(char, add_special_tokens=False)
            except Exception:
                return (f"{what}, row {i}: the tokenizer of --model cannot encode {char!r} in the prompt "
                        f"{example['prompt'][:60]!r} ({type(error).__name__}: {error}). Pass a --model whose tokenizer "
                        "covers the data's characters.")
    return f"{what}: the tokenizer of --model cannot encode the prompts ({type(error).__name__}: {error})."


def format_prompt(tokenizer, prompt: str, chat_template: bool) -> str:
    """The text the model continues: the chat template's user turn + assistant header when the
    tokenizer has a template (and `--chat-template` is on), else the raw prompt after BOS."""
    if chat_template and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja2's TemplateError, or what the template raises itself
            raise UsageError(f"the chat template of --model cannot render a prompt ({type(e).__name__}: {e}). Fix its "
                             "chat_template.jinja (or chat_template in tokenizer_config.json), or pass "
                             "--no-chat-template.") from None
    return (tokenizer.bos_token or "") + prompt


def prompt_batch(examples: list[dict], step: int, batch_size: int, rank: int, world_size: int, seed: int) -> list[dict]:
    """This rank's slice of step `step`'s global batch of `batch_size` prompts.

    Every rank computes the same global order (a fresh permutation each epoch, seeded by seed+epoch)
    and takes a contiguous slice, so the data order depends only on (seed, step): resuming is exact
    and the global batch is the same whatever the number of ranks."""
    local = batch_size // world_size
    start = step * batch_size + rank * local
    return [examples[_epoch_order(len(examples), seed + pos // len(examples))[pos % len(examples)]]
            for pos in range(start, start + local)]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int) -> list[int]:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()


