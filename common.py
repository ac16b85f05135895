"""Shared plumbing for the algorithm files: distributed set-up, logging, models, data, generation,
log-probs, rewards, evaluation and checkpoints.

Nothing here appears in an algorithm's equations: advantages, ratios, clipping, KL and loss
aggregation live in each algorithm file. This is what your own codebase already has, so a copied
algorithm file can be rewired to it.
"""

import contextlib
import datetime
import fcntl
import functools
import importlib
import importlib.util
import json
import math
import os
import pickle
import random
import re
import resource
import select
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
from safetensors import SafetensorError
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
)

DEFAULT_MODEL = str(Path(__file__).parent / "tiny_model")  # made by make_tiny_model.py
transformers.utils.logging.disable_progress_bar()


def fail(message: str) -> SystemExit:
    """A usage error: `raise fail("...")` prints one line naming the flag or file and the fix, no traceback."""
    return SystemExit(f"error: {message}")


# (flag, valid, what it must be, why): the flags every algorithm file shares, checked by `check_flags`.
FLAG_RULES = [
    ("num_steps", lambda v: v >= 1, ">= 1", "0 would save the untrained model as final/"),
    ("prompts_per_step", lambda v: v >= 1, ">= 1", ""),
    ("max_new_tokens", lambda v: v >= 1, ">= 1", "each completion has at least its EOS token"),
    ("temperature", lambda v: 0 < v < math.inf, "> 0", "the log-probs divide the logits by it; for sharper "
     "sampling try 0.5, and eval/accuracy_greedy reports greedy decoding"),
    ("learning_rate", lambda v: 0 < v < math.inf, "> 0", ""),
    ("updates_per_rollout", lambda v: v >= 1, ">= 1", ""),
    ("num_minibatches", lambda v: v >= 1, ">= 1", ""),
    ("micro_batch_size", lambda v: v is None or v >= 1, ">= 1", "or left out: the whole minibatch"),
    ("max_grad_norm", lambda v: 0 < v <= math.inf, "> 0", "inf: no clipping"),
    ("weight_decay", lambda v: 0 <= v < math.inf, ">= 0", ""),
    ("eval_every", lambda v: v >= 0, ">= 0", "0: never evaluate"),
    ("save_every", lambda v: v >= 0, ">= 0", "0: only the final weights"),
    ("keep_checkpoints", lambda v: v >= 0, ">= 0", "0: keep all"),
    ("eval_size", lambda v: v >= 0, ">= 0", ""),
    ("max_prompt_length", lambda v: v is None or v >= 1, ">= 1", "or left out: as long as the model allows"),
    ("format_weight", lambda v: math.isfinite(v), "finite", ""),
    ("dist_timeout", lambda v: 0 < v < math.inf, "> 0", "minutes"),
]


def require(valid: bool, flag: str, value, must: str) -> None:
    """Stop at start-up unless `valid`: `require(args.beta >= 0, "--beta", args.beta, ">= 0")`."""
    if not valid:
        raise fail(f"{flag} {value}: must be {must}.")


def check_flags(args) -> None:
    """The shared flags, before anything is loaded or written: one line naming the flag, the value and
    what it must be. Each algorithm file checks its own flags after this (`require`)."""
    for name, valid, must, why in FLAG_RULES:
        value = getattr(args, name)
        require(valid(value), f"--{name.replace('_', '-')}", value, must + (f" ({why})" if why else ""))
    if args.eval_every and args.eval_size == 0 and args.eval_dataset is None and args.eval_split is None:
        raise fail(f"--eval-size 0 leaves nothing to evaluate every --eval-every {args.eval_every} steps: pass "
                   "--eval-every 0, a positive --eval-size, or --eval-dataset.")
    if args.run_name is not None and (args.run_name in ("", ".", "..") or re.search(r"[/\\]", args.run_name)):
        raise fail(f"--run-name {args.run_name!r}: must be a folder name under --output-dir, without '/' "
                   "(pass --output-dir for another place).")
    output = Path(args.output_dir).expanduser()
    existing = next(p for p in (output, *output.parents) if p.exists())
    if not existing.is_dir():
        raise fail(f"--output-dir {args.output_dir}: {existing} is a file, not a folder. Pass a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise fail(f"--output-dir {args.output_dir}: {existing} is not writable by this user. Pass a folder you "
                   "can write to.")


def exact_div(numerator: int, denominator: int, message: str) -> int:
    """`numerator // denominator`, failing at start-up with `message` when it does not divide."""
    if denominator <= 0 or numerator % denominator != 0:
        raise fail(f"{message} (got {numerator} and {denominator})")
    return numerator // denominator


# ---------------------------------------------------------------------------------------------
# Distributed
# ---------------------------------------------------------------------------------------------


def setup_distributed(timeout_minutes: float = 60) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment; a plain `python x.py` is rank 0 of 1.
    A collective that waits longer than `timeout_minutes` for another rank (one that died, or one still
    generating or scoring) fails; the message then names --dist-timeout."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        sys.excepthook = functools.partial(_explain_timeout, sys.excepthook, timeout_minutes)
    return rank, world_size, device


def _explain_timeout(excepthook, minutes: float, kind, value, traceback) -> None:
    """After the traceback of a collective that timed out, one line that says what happened and what to do."""
    excepthook(kind, value, traceback)
    if isinstance(value, RuntimeError) and re.search(r"timed out|timeout", str(value), re.IGNORECASE):
        print(f"error: rank {os.environ.get('RANK', 0)} waited more than --dist-timeout {minutes:g} minutes for "
              "another rank (one that died or hung, or one still generating or scoring). If a step can take that "
              "long, raise --dist-timeout; else look at the other ranks' output. Go on with --resume latest.",
              file=sys.stderr, flush=True)


def cleanup_distributed() -> None:
    """The last call of a distributed run: wait for every rank, tear the process group down, and end the
    process at once. Ending it without running interpreter-exit destructors is deliberate: with torch
    2.13, a gloo group still referenced from elsewhere (FSDP's device mesh, a DDP reducer) was seen to
    abort ("terminate called without an active exception") or hang when destroyed at exit."""
    if dist.is_initialized():
        dist.barrier()  # rank 0 may still be writing the checkpoint; tearing gloo down under it can abort
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def print0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def _all_reduce(x: torch.Tensor, op) -> torch.Tensor:
    x = x.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(x, op=op)
    return x


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (a copy; identity on one process)."""
    return _all_reduce(x, dist.ReduceOp.SUM)


def all_reduce_min(x: torch.Tensor) -> torch.Tensor:
    """Minimum of a tensor over ranks (a copy; identity on one process)."""
    return _all_reduce(x, dist.ReduceOp.MIN)


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Maximum of a tensor over ranks (a copy; identity on one process)."""
    return _all_reduce(x, dist.ReduceOp.MAX)


def all_reduce_mean(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks, so that what rank 0 logs describes the whole step."""
    if not dist.is_initialized() or not metrics:
        return metrics
    values = all_reduce_sum(torch.tensor(list(metrics.values()), dtype=torch.float64, device=device))
    return dict(zip(metrics, (values / dist.get_world_size()).tolist()))


# ---------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------


class Logger:
    """One line per step on stdout, every metric as JSON lines in `<run_dir>/metrics.jsonl` (a NaN or
    infinite value is written as null, so that every line is valid JSON), TensorBoard when installed,
    Weights & Biases with `--track`. A no-op on ranks other than 0."""

    SHOWN = ("reward/mean", "eval/accuracy", "eval/accuracy_greedy", "loss/policy", "policy/clipfrac", "perf/step_s")

    def __init__(self, run_dir: Path, config: dict, rank: int, track: bool = False):
        self.enabled = rank == 0
        self.wandb = self.tensorboard = None
        if not self.enabled:
            return
        if track:
            try:
                import wandb
            except ImportError:
                raise fail("--track needs wandb: pip install wandb") from None
            self.wandb = wandb.init(name=run_dir.name, config=config)
        (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.file = open(run_dir / "metrics.jsonl", "a")  # a resumed run appends (prepare_run_dir cut it back)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir))
        except ImportError:
            pass

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **finite}, allow_nan=False) + "\n")  # NaN/inf: null
        self.file.flush()
        shown = " | ".join(f"{k} {metrics[k]:.4g}" for k in self.SHOWN if k in metrics)
        print(f"step {step:>4} | {shown}", flush=True)
        if self.tensorboard:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tensorboard:
                self.tensorboard.close()
            if self.wandb:
                self.wandb.finish()


def mean_metrics(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Average each key over the dicts that have it (e.g. per-micro-batch metrics of a step)."""
    keys = dict.fromkeys(key for d in dicts for key in d)
    return {key: sum(d[key] for d in dicts if key in d) / sum(key in d for d in dicts) for key in keys}


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or this process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_bytes() / 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident memory: /proc's VmHWM where there is one, since Linux carries
    `ru_maxrss` over fork and exec, so that a process started by a larger one reports the other's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: rough


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def check_model_name(name: str, flag: str = "--model") -> None:
    """Fail at once on a local-looking path that does not exist, rather than asking the Hub for it, and on
    a local folder whose config.json is not a JSON object."""
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise fail(f"{flag} {name!r}: no such folder. Pass an existing folder or a Hugging Face model name.")
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:
            config = e
        if not isinstance(config, dict):
            what = f"not valid JSON ({config})" if isinstance(config, Exception) else f"a JSON {type(config).__name__}"
            raise fail(f"{flag} {name!r}: its config.json is {what}, not a JSON object. Restore the model's "
                       "config.json (copy it again from where the model came from).")


def load_tokenizer(name: str, flag: str = "--model"):
    """Left padding (prompts end where generation starts) and a pad token distinct from EOS, so that
    masking padding can never mask the real EOS token, which is an action and gets gradient."""
    check_model_name(name, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise fail(f"{flag} {name!r}: cannot load its tokenizer ({str(e).splitlines()[0]}). "
                   "Pass a local folder or a Hugging Face model name reachable from this machine.") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def load_model(name: str, dtype: str, device: torch.device, tokenizer, auto_class=AutoModelForCausalLM,
               flag: str = "--model"):
    """Any causal LM (or, with `auto_class`, e.g. `AutoModel`, its backbone) by Hugging Face name or local
    path, every form of dropout off, in `dtype` ("auto": fp32 on CPU, bf16 on GPU), its embeddings grown if
    `load_tokenizer` added a pad token.

    Log-probs must be a deterministic function of the weights, also in train mode (which
    --gradient-checkpointing needs): dropout is zeroed in the config before the model is built (attention
    dropout is applied functionally from it, with no module to switch off; the saved config.json says 0,
    as trained) and in every dropout module. A causal LM is then checked to return the logits that
    `get_logprobs` recomputes from its last hidden state (`check_output_logits`)."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    check_model_name(name, flag)
    try:
        config = AutoConfig.from_pretrained(name)
        _zero_dropout(config)
        backbone = auto_class is not AutoModelForCausalLM  # e.g. a critic: a causal LM's head is left unused
        with _transformers_quiet(backbone):
            model, info = auto_class.from_pretrained(name, config=config, dtype=getattr(torch, dtype),
                                                     output_loading_info=True)
        missing = info["missing_keys"] or info["mismatched_keys"]
        if backbone and missing:  # the report that was silenced, when it says something worth saying
            print0(f"warning: {flag} {name!r}: weights not in the checkpoint, left as initialised: "
                   f"{sorted(map(str, missing))[:5]}")
    except SafetensorError as e:
        raise fail(f"{flag} {name!r}: cannot read its weights ({e}). A file is damaged or incomplete (an "
                   "interrupted download or copy?): copy the model again.") from None
    except (OSError, ValueError) as e:
        raise fail(f"{flag} {name!r}: cannot load it ({str(e).splitlines()[0]}). "
                   "Pass a local folder or a Hugging Face model name reachable from this machine.") from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))  # a pad token was added
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    for module in model.modules():  # also dropout modules built with a rate of their own, not the config's
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
    model = model.to(device)
    if model.get_output_embeddings() is not None:
        check_output_logits(model, name, flag)
    return model


@contextlib.contextmanager
def _transformers_quiet(quiet: bool):
    """transformers' warnings off while loading a backbone from a causal LM checkpoint, whose load report
    lists the unused LM head (`lm_head.weight | UNEXPECTED`) as if something were wrong."""
    level = transformers.utils.logging.get_verbosity()
    if quiet:
        transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)


def _zero_dropout(config) -> None:
    """Every dropout-like rate of a model config (attention_dropout, resid_pdrop, layerdrop, ...) set to 0,
    in nested configs too."""
    for key, value in vars(config).items():
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
        elif isinstance(value, transformers.PretrainedConfig):
            _zero_dropout(value)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return getattr(model, "module", model)


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2, in place: each decoder layer (the model's `_no_split_modules` classes) and then the rest
    (embeddings, final norm, LM head or value head) are sharded over all ranks; each forward all-gathers
    one layer at a time, each backward reduce-scatters (averages) its gradients. On GPU the shards are
    fp32 master weights and the compute is bf16, with gradients reduced in fp32."""
    if device.type == "cuda":
        model.float()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    layer_classes = set()
    for module in model.modules():
        layer_classes |= set(getattr(module, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` that returns the total norm as a plain tensor, also for FSDP's sharded gradients."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


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
            raise fail(f"{where}: not an object with the fields {prompt_field!r} and {answer_field!r}.")
        for key, field_flag in ((prompt_field, "--prompt-field"), (answer_field, "--answer-field")):
            if key not in record:
                raise fail(f"{where}: missing field {key} (it has {', '.join(record) or 'none'}). "
                           f"Name the field with {field_flag}.")
            if record[key] is None:
                raise fail(f"{where}: field {key} is null. Every row needs a {key}.")
            if not isinstance(record[key], (str, int, float)) or isinstance(record[key], bool):
                raise fail(f"{where}: field {key} is a {type(record[key]).__name__}; it must be text or a number.")
        rows.append({"prompt": str(record[prompt_field]), "answer": str(record[answer_field])})
    if not rows:
        raise fail(f"{flag} {source!r}: the dataset has no examples.")
    return rows


def _jsonl_records(path: Path, flag: str):
    """(file:line, object) for each non-empty line of a JSONL file."""
    if not path.is_file():
        raise fail(f"{flag} {str(path)!r}: no such file. Pass a JSONL file with one "
                   '{"prompt": ..., "answer": ...} object a line, or leave it out for the built-in task.')
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise fail(f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start}). Save it as UTF-8.") from None
            if not line.strip():
                continue
            try:
                yield f"{path}:{line_no}", json.loads(line)
            except json.JSONDecodeError as e:
                raise fail(f"{path}:{line_no}: not valid JSON ({e.msg}). Each line must be one JSON object.") from None


def _dataset_records(source: str, flag: str, config: str | None, split: str | None):
    """('<source> [split] row i', row) for each row of what `datasets` reads from `source`."""
    try:
        import datasets
    except ImportError:
        raise fail(f"{flag} {source!r}: reading a Hugging Face dataset or a file other than JSONL needs the datasets "
                   "package: pip install datasets") from None
    path = Path(source).expanduser()
    try:
        if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "dataset_info.json")):
            data = datasets.load_from_disk(str(path))  # written by save_to_disk
        elif path.is_file():
            builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
            if builder is None:
                raise fail(f"{flag} {source!r}: a {path.suffix or 'extensionless'} file; pass JSONL, JSON, Parquet or "
                           "CSV, a dataset folder or a Hugging Face dataset name.")
            data = datasets.load_dataset(builder, data_files=str(path))
        else:
            data = datasets.load_dataset(source, config)
    except (OSError, ValueError, ImportError) as e:
        raise fail(f"{flag} {source!r}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0]}). Pass a "
                   "dataset file or folder, or a Hugging Face dataset name reachable from this machine.") from None
    name = split
    if isinstance(data, datasets.DatasetDict):
        if name is None:
            name = "test" if "test" in data or len(data) != 1 else next(iter(data))
        if name not in data:
            which = "--split" if flag == "--dataset" else "--eval-split"
            raise fail(f"{flag} {source!r}: no split {name!r}; it has {list(data)}. Choose one with {which}.")
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
            raise fail(f"--eval-size {eval_size}: the built-in task has {len(held_out)} prompts, so none would be "
                       "left to train on. Hold out fewer (the default is 500).")
        return train, held_out
    fields = dict(prompt_field=prompt_field, answer_field=answer_field)
    train = load_rows(dataset, "--dataset", dataset_config, split, **fields)
    if eval_dataset is not None:
        return train, load_rows(eval_dataset, "--eval-dataset", None, eval_split, **fields)
    if eval_split is not None:
        return train, load_rows(dataset, "--dataset", dataset_config, eval_split, **fields)
    if len(train) <= eval_size:
        raise fail(f"--dataset {dataset!r} has {len(train)} rows, too few to hold out --eval-size {eval_size}. "
                   "Pass --eval-dataset or --eval-split, or a smaller --eval-size.")
    return train[:len(train) - eval_size], train[len(train) - eval_size:]  # eval_size 0: all rows train


def model_positions(name: str, flag: str = "--model") -> int | None:
    """How many positions (prompt and completion tokens together) the model at `name` takes, from its
    config; None when the config states no limit."""
    try:
        config = AutoConfig.from_pretrained(name).get_text_config()
    except (OSError, ValueError) as e:
        raise fail(f"{flag} {name!r}: cannot read its config ({str(e).splitlines()[0]}). "
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
        raise fail(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's {positions} "
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
            raise fail(_unencodable(tokenizer, examples, what, e)) from None
        kept = [e for e, ids in zip(examples, prompts) if len(ids) <= limit]
        if not kept:
            raise fail(f"{what}: all {len(examples)} prompts are {why}. Raise --max-prompt-length, or lower "
                       "--max-new-tokens.")
        if len(kept) < len(examples):
            print0(f"{what}: dropped {len(examples) - len(kept)} of {len(examples)} prompts {why}")
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
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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


# ---------------------------------------------------------------------------------------------
# Generation and log-probs
# ---------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """G completions per prompt, stored contiguously (group j is rows j*G .. j*G+G-1).

    input_ids:      (B, P+L) left-padded prompt then response, padded after EOS
    attention_mask: (B, P+L) 1 on real prompt and response tokens
    response_mask:  (B, L)   1 on response tokens up to and including EOS, 0 after it
    prompt_length:  P, the padded prompt width (responses start at column P)
    texts:          B decoded responses (EOS and padding removed)
    truncated:      (B,) True where the response hit --max-new-tokens without EOS
    sampler_logprobs: (B, L) log-prob of each response token under the distribution the sampler drew it
                    from (0 after EOS; 0 everywhere for greedy decoding, where each token had probability 1)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    texts: list[str]
    truncated: torch.Tensor
    sampler_logprobs: torch.Tensor


def cat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts (or parts of them) into one: prompts re-padded on the left to the widest prompt,
    responses on the right to the longest response. Rows keep their order, so groups stay contiguous."""
    P = max(r.prompt_length for r in rollouts)
    L = max(r.response_mask.shape[1] for r in rollouts)

    def pad(r: Rollout, x: torch.Tensor, value) -> torch.Tensor:  # (B, p+l) -> (B, P+L)
        return F.pad(x, (P - r.prompt_length, L - (x.shape[1] - r.prompt_length)), value=value)

    return Rollout(
        input_ids=torch.cat([pad(r, r.input_ids, pad_token_id) for r in rollouts]),
        attention_mask=torch.cat([pad(r, r.attention_mask, 0) for r in rollouts]),
        response_mask=torch.cat([F.pad(r.response_mask, (0, L - r.response_mask.shape[1])) for r in rollouts]),
        prompt_length=P,
        texts=[t for r in rollouts for t in r.texts],
        truncated=torch.cat([r.truncated for r in rollouts]),
        sampler_logprobs=torch.cat([F.pad(r.sampler_logprobs, (0, L - r.response_mask.shape[1])) for r in rollouts]),
    )


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout restricted to `rows` (indices or a boolean mask over the B rows)."""
    rows = (rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows).to(rollout.input_ids.device)
    return Rollout(rollout.input_ids[rows], rollout.attention_mask[rows], rollout.response_mask[rows],
                   rollout.prompt_length, [rollout.texts[i] for i in rows.tolist()], rollout.truncated[rows],
                   rollout.sampler_logprobs[rows])


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return sorted(set(ids) | {tokenizer.eos_token_id} - {None})


class SamplerLogprobs(LogitsProcessor):
    """Sampling's only logits processor: divides the logits by the temperature (so that nothing in
    transformers runs after it) and keeps the log-probability of each sampled token under that
    distribution. It holds one step's (B, V) log-softmax at a time: the token drawn from it is read from
    `input_ids` at the next step, and the last one from the finished sequences (`result`)."""

    def __init__(self, temperature: float):
        self.temperature, self.previous, self.logprobs = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores / self.temperature
        self._gather(input_ids[:, -1])
        self.previous = scores.log_softmax(-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, tokens[:, None]).squeeze(-1))
            self.previous = None

    def result(self, response: torch.Tensor) -> torch.Tensor:
        """(B, L) log-probs of the sampled `response` tokens (B, L)."""
        if len(self.logprobs) < response.shape[1]:
            self._gather(response[:, len(self.logprobs)])
        return torch.stack(self.logprobs[: response.shape[1]], 1)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], group_size: int, max_new_tokens: int, temperature: float,
             greedy: bool = False) -> Rollout:
    """Sample `group_size` completions for each prompt text (already formatted) with `model.generate`.

    Sampling is plain softmax(logits / T), the distribution that every loss here assumes (greedy:
    argmax), whatever the checkpoint's generation_config.json holds: the generation configuration is
    built here in full, taking only the EOS, pad and BOS ids from the checkpoint. transformers would
    otherwise merge each field left unset (repetition_penalty, min_p, top_k 50, no_repeat_ngram_size,
    min_new_tokens, suppress_tokens, ...) from `model.generation_config`, so that one is swapped out for
    the call (and kept for saving). The sampler's own log-prob of every token is recorded as it samples
    (`SamplerLogprobs`), so the gap to the trainer's can be logged."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    prompt_ids = enc.input_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, dim=0)
    eos_ids = eos_token_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=model.generation_config.bos_token_id, do_sample=not greedy)
    if not greedy:
        config.top_k = 0  # transformers fills in top_k=50 when unset; the temperature is SamplerLogprobs' step
    recorder = SamplerLogprobs(temperature)
    # Under FSDP every forward is collective: a rank whose completions all ended keeps stepping with
    # the others (synced_gpus) instead of leaving them waiting for its shards.
    synced = dist.is_initialized() and isinstance(unwrap(model), FSDPModule)
    checkpoint_config, model.generation_config = model.generation_config, config
    try:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                             logits_processor=None if greedy else [recorder], synced_gpus=synced)
    finally:
        model.generation_config = checkpoint_config
    P = prompt_ids.shape[1]
    response = out[:, P:]  # (B, L); HF pads after EOS with pad_token_id
    is_eos = torch.isin(response, torch.tensor(eos_ids, device=response.device))
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(-1), response.shape[1])  # (B,)
    positions = torch.arange(response.shape[1], device=response.device)
    response_mask = (positions[None] <= first_eos[:, None]).long()  # EOS is an action: keep it in the mask
    response = response.masked_fill(response_mask == 0, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode([r[:n] for r, n in zip(response.tolist(), first_eos.tolist())],
                                   skip_special_tokens=True)
    sampler_logprobs = torch.zeros(response.shape, device=response.device) if greedy else recorder.result(response)
    return Rollout(
        input_ids=torch.cat([prompt_ids, response], 1),
        attention_mask=torch.cat([prompt_mask, response_mask], 1),
        response_mask=response_mask.float(),
        prompt_length=P,
        texts=texts,
        truncated=~has_eos,
        sampler_logprobs=sampler_logprobs.masked_fill(response_mask == 0, 0.0),
    )


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `model`'s forward returns, recomputed from its last hidden states (N, H) -> (N, V), in at
    least fp32: the LM head, then what some architectures apply after it in their forward (Gemma's
    soft-capping, Cohere's logit_scale, Granite's logits_scaling). The sampler draws from these logits
    divided by the temperature, so the temperature goes after them, never before."""
    hf_model = unwrap(model)
    logits = hf_model.get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    config = hf_model.config
    if getattr(config, "logit_scale", None):  # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2 and 3: cap * tanh(z / cap)
        logits = config.final_logit_softcapping * torch.tanh(logits / config.final_logit_softcapping)
    return logits


@torch.no_grad()
def check_output_logits(model, name: str, flag: str = "--model") -> None:
    """Fail at load time unless `output_logits` reproduces the model's own logits on a few tokens:
    `get_logprobs` projects hidden states itself (in chunks, to bound memory), so an architecture whose
    forward changes the logits in a way it does not know would be trained on another distribution than
    the one sampled. Tolerance: 1e-4 of the largest logit in fp32, 2e-2 in 16-bit (rounding of the
    model's own transform)."""
    ids = torch.arange(8, device=model.device)[None] % model.config.get_text_config().vocab_size
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    theirs = out.logits.float()
    ours = output_logits(model, out.hidden_states[-1]).float()
    tolerance = (1e-4 if model.dtype == torch.float32 else 2e-2) * theirs.abs().max().clamp(min=1)
    difference = (ours - theirs).abs().max()
    if not difference <= tolerance:
        raise fail(f"{flag} {name!r}: its forward changes the LM head's logits in a way get_logprobs does not "
                   f"reproduce (largest difference {difference.item():.3g}). Supported: a plain LM head, "
                   "final_logit_softcapping, logit_scale, logits_scaling; add its transform to common.output_logits.")


def _token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, model, temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy for a chunk of positions: (N, H), (N,) -> (N,), (N,)."""
    logits = output_logits(model, hidden) / temperature  # (N, V), >= fp32; T as sampled, after any soft-cap
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    with torch.no_grad():  # H = lse - sum_v p_v logit_v, as a batched dot product: no (N, V) product tensor
        entropy = lse - torch.bmm(logits.softmax(-1)[:, None, :], logits[:, :, None]).view(-1)
    return logprobs, entropy


def get_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                 temperature: float, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the response tokens under `model` (DDP-wrapped or not), and their entropy.

    (B, P+L) ids and mask -> logprobs (B, L) in fp32, entropy (B, L) without gradient; both are 0
    after EOS.
    The logit at position t predicts token t+1, so response tokens are scored from the hidden states
    at columns P-1 .. P+L-2. The vocabulary projection runs in chunks of `chunk_size` positions (and is
    recomputed in the backward pass), so the full (B, L, V) log-softmax never exists at once; by default
    a chunk holds 2^25 logits (128 MB in fp32: 220 positions of a 151,936-token vocabulary)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens start at 0
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                output_hidden_states=True, logits_to_keep=1, use_cache=False)
    hidden = out.hidden_states[-1][:, prompt_length - 1 : -1]  # (B, L, H), after the final norm
    targets = input_ids[:, prompt_length:]  # (B, L)
    B, L, H = hidden.shape
    hidden, targets = hidden.reshape(B * L, H), targets.reshape(B * L)
    vocab_size = unwrap(model).get_output_embeddings().weight.shape[0]
    chunk_size = chunk_size or max(1, 2**25 // vocab_size)  # positions per chunk
    logprobs, entropy = [], []
    for i in range(0, B * L, chunk_size):
        args = (hidden[i : i + chunk_size], targets[i : i + chunk_size], model, temperature)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_token_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _token_logprobs(*args)
        logprobs.append(lp)
        entropy.append(ent)
    real = attention_mask[:, prompt_length:]  # (B, L) 0 after EOS: those positions are set to 0, not garbage
    return torch.cat(logprobs).view(B, L) * real, torch.cat(entropy).view(B, L) * real


@torch.no_grad()
def rollout_logprobs(model, rollout: Rollout, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """Log-probs (B, L) of a whole rollout's response tokens, `micro_batch_size` sequences at a time."""
    ids, mask, n = rollout.input_ids, rollout.attention_mask, micro_batch_size
    return torch.cat([get_logprobs(model, ids[i : i + n], mask[i : i + n], rollout.prompt_length, temperature)[0]
                      for i in range(0, len(ids), n)] or [rollout.response_mask.float()])  # (0, L) if empty


def sampler_logprob_gap(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, response_mask: torch.Tensor
                        ) -> dict[str, float]:
    """How far the trainer's log-probs (B, L) of the sampled tokens are from the sampler's (B, L), over the
    response tokens of every rank: `policy/sampler_logprob_gap` (mean |difference|) and `_max`. Both are
    ~1e-6 when the two compute the same distribution in fp32; a large value means the completions were
    not drawn from the distribution that the loss assumes."""
    mask = response_mask.bool()
    difference = torch.where(mask, (sampler_logprobs - logprobs).abs(), 0.0).double()  # (B, L)
    total = all_reduce_sum(torch.stack([difference.sum(), mask.sum().double()]))
    largest = all_reduce_max(difference.max() if difference.numel() else difference.new_zeros(()))
    return {"policy/sampler_logprob_gap": (total[0] / total[1].clamp(min=1)).item(),
            "policy/sampler_logprob_gap_max": largest.item()}


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------

def final_answer(text: str) -> str | None:
    """The final answer a completion states: the content of its last \\boxed{...}, else what follows its
    last '####' (GSM8K's format), else None (no explicit answer; `correctness_reward` then lets math-verify
    look for the last expression in the whole text)."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
        return None  # unclosed brace
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    return None


def _to_number(text: str) -> float | None:
    """A plain number ('1,234', '-3.5', '$12', '3/4', '1.5e3'), or None."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")  # '12 13' is two numbers, not 1213
    try:
        if "/" in text:
            num, den = text.split("/")
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


MATH_VERIFY_TIMEOUT_S = 2.0  # wall-clock seconds math-verify may spend on one completion before it scores 0

# The child process that runs math-verify: one (gold, completion) JSON line in, "1" or "0" out.
# Its own timeouts are off (they are signal.alarm, which fails outside a main thread and cannot stop C
# code such as big-integer arithmetic); the parent enforces the deadline. An address-space limit turns a
# runaway allocation into a MemoryError (scored 0) rather than the machine's OOM killer.
_MATH_VERIFY_CHILD = r"""
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
logging.disable(logging.WARNING)
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
config = [LatexExtractionConfig(), ExprExtractionConfig()]
print("ready", flush=True)
for line in sys.stdin:
    gold, completion = json.loads(line)
    try:
        right = verify(parse(gold, config, parsing_timeout=None), parse(completion, config, parsing_timeout=None),
                       timeout_seconds=None)
    except Exception:
        right = False
    print(int(right), flush=True)
"""


class MathVerifier:
    """math-verify (the grader of TRL's accuracy reward) in a child process of this one, with a hard
    deadline: a completion it has not graded within `timeout_s` seconds scores 0, and the child is killed
    and started afresh. So no completion can hang a step, which under torchrun would leave the other
    ranks waiting in a collective until the backend's timeout ends the run; and, no signal being used
    in this process, it works from any thread. One child per process (per rank), started on first use."""

    def __init__(self, timeout_s: float = MATH_VERIFY_TIMEOUT_S):
        self.timeout_s, self.child, self.timeouts = timeout_s, None, 0

    def _start(self) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise fail("the math reward needs math-verify: pip install -r requirements.txt")
        self.child = subprocess.Popen([sys.executable, "-c", _MATH_VERIFY_CHILD], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if not select.select([self.child.stdout], [], [], 120)[0] or self.child.stdout.readline() != "ready\n":
            self._stop()
            raise fail("the math reward's math-verify process did not start: check `python -c 'import math_verify'`")

    def _stop(self) -> None:
        self.child.kill()
        self.child.wait()
        self.child = None

    def __call__(self, gold: str, completion: str) -> bool:
        if self.child is None or self.child.poll() is not None:  # not started yet, or ended from outside
            self._start()
        self.child.stdin.write(json.dumps([gold, completion]) + "\n")
        self.child.stdin.flush()
        if select.select([self.child.stdout], [], [], self.timeout_s)[0]:
            answer = self.child.stdout.readline()
            if answer:
                return answer == "1\n"
        self.timeouts += 1  # over the deadline, or the child died: it is replaced for the next completion
        self._stop()
        return False


_math_verifier = MathVerifier()


def math_reward(completion: str, answer: str) -> bool:
    """Is `completion` right, for a gold `answer` such as '72', '\\frac{1}{2}', '(1, 3]', 'B' or GSM8K's
    'reasoning #### 72'? When the completion's final answer (`final_answer`; or the whole completion, if it
    is a bare number) and the gold answer are both plain numbers they are compared numerically (1e-6
    relative), which is exact and instant; a gold letter A-J is compared with the letter the completion
    chooses (`chosen_letter`). Anything else goes to math-verify (`MathVerifier`), which compares them
    symbolically: fractions, roots, pi, percentages, units, intervals, tuples, sets, equations."""
    gold = answer.rsplit("####", 1)[-1].strip()
    stated = final_answer(completion)
    prediction = stated if stated is not None else completion.strip()
    numbers = _to_number(gold), _to_number(prediction)
    if None not in numbers:
        return math.isclose(*numbers, rel_tol=1e-6, abs_tol=1e-9)
    letter = re.fullmatch(r"\(?([A-J])\)?", gold)
    if letter:
        return chosen_letter(completion) == letter.group(1)
    if numbers[0] is not None and re.fullmatch(r"-?[\d.]+[eE][-+]?\d+", gold):
        gold = f"{numbers[0]:f}".rstrip("0").rstrip(".")  # LaTeX reads 1.5e3 as 1.5 times a symbol e
    if "\\boxed" not in gold and "$" not in gold:
        gold = f"${gold}$"  # LaTeX, e.g. \frac{1}{2}, (1, 3], \{1, 2\}
    return _math_verifier(gold, f"\\boxed{{{stated}}}" if stated is not None else completion)


def chosen_letter(completion: str) -> str | None:
    """The multiple-choice letter a completion gives: its final answer ('B', '(B)', '\\text{B}'), else the
    last '(B)' or 'answer is B' / 'Answer: B' in the text."""
    stated = final_answer(completion)
    if stated is not None:
        letter = re.fullmatch(r"\(?(?:\\text\{)?\s*([A-J])\s*\}?\)?", stated)
        return letter.group(1) if letter else None
    found = re.findall(r"\(([A-J])\)|(?i:answer)(?:\s+is|\s*:)?\s*\(?([A-J])\b", completion)
    return "".join(found[-1]) if found else None


def correctness_reward(completions: list[str], answers: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the completion is right: the whole text equals the answer (`exact`, the built-in task),
    or it states the gold answer, by `math_reward` (real data)."""
    right = [c.strip() == a.strip() if exact else math_reward(c, a) for c, a in zip(completions, answers)]
    timeouts = _math_verifier.timeouts
    if timeouts:
        _math_verifier.timeouts = 0
        print(f"math reward: {timeouts} completion(s) not graded within {_math_verifier.timeout_s} s scored 0",
              flush=True)
    return torch.tensor(right, dtype=torch.float32)


def format_reward(completions: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the answer is given in the expected form: a bare number (built-in) or \\boxed{} / ####."""
    if exact:
        ok = [re.fullmatch(r"\s*-?\d+\s*", c) is not None for c in completions]
    else:
        ok = ["\\boxed{" in c or "####" in c for c in completions]
    return torch.tensor(ok, dtype=torch.float32)


def load_reward_fn(spec: str, examples: list[dict] = ()):
    """`module:function` or `path/to/file.py:function`. The function is called as
    `fn(prompts, completions, answers) -> list of one finite float per completion`; its contract is
    checked at once on `examples` (their answers as completions), not after the first rollout."""
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise fail(f"--reward-fn {spec!r}: expected 'module:function' or 'file.py:function'.")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if loader_spec is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except Exception as e:
        raise fail(f"--reward-fn {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}).") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise fail(f"--reward-fn {spec!r}: {module_name!r} has no function {fn_name!r}.")
    if examples:
        answers = [e["answer"] for e in examples]
        call_reward_fn(fn, spec, [e["prompt"] for e in examples], answers, answers)
    return fn


def call_reward_fn(fn, spec: str, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
    """Call a user reward function and hold it to its contract, failing with a clear message."""
    try:
        values = fn(prompts, completions, answers)
    except Exception as e:
        raise fail(f"--reward-fn {spec!r} raised {type(e).__name__}: {e}") from None
    if not hasattr(values, "__len__") or len(values) != len(completions):
        got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else repr(values)
        raise fail(f"--reward-fn {spec!r} must return one float per completion ({len(completions)}), got {got}.")
    try:
        out = torch.tensor([float(v) for v in values], dtype=torch.float32)
    except (TypeError, ValueError):
        raise fail(f"--reward-fn {spec!r} returned a value that is not a float: {list(values)[:4]}...") from None
    if not torch.isfinite(out).all():
        raise fail(f"--reward-fn {spec!r} returned NaN or inf for {(~torch.isfinite(out)).sum().item()} completions.")
    return out


def score(prompts: list[str], completions: list[str], answers: list[str], exact: bool, format_weight: float = 0.0,
          reward_fn=None, reward_fn_spec: str = "") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total reward (B,) = correct + format_weight * format + user reward, and each component (B,)."""
    components = {"correct": correctness_reward(completions, answers, exact)}
    if format_weight:
        components["format"] = format_reward(completions, exact)
    if reward_fn is not None:
        components["user"] = call_reward_fn(reward_fn, reward_fn_spec, prompts, completions, answers)
    rewards = components["correct"] + format_weight * components.get("format", 0.0) + components.get("user", 0.0)
    return rewards, components


def load_reward_model(name: str, dtype: str, device: torch.device):
    """A frozen `AutoModelForSequenceClassification` with one output (a reward model) and its own
    tokenizer, which need not be the policy's: completions are scored as text."""
    tokenizer = load_tokenizer(name, "--reward-model")
    model = load_model(name, dtype, device, tokenizer, AutoModelForSequenceClassification, "--reward-model")
    if model.config.num_labels != 1:
        raise fail(f"--reward-model {name!r}: has {model.config.num_labels} outputs; a reward model has one "
                   "(AutoModelForSequenceClassification with num_labels=1).")
    return model.eval().requires_grad_(False), tokenizer


@torch.no_grad()
def reward_model_scores(reward_model, tokenizer, prompts: list[str], completions: list[str], ended: torch.Tensor,
                        chat_template: bool, batch_size: int) -> torch.Tensor:
    """Scores (B,) of prompt + completion (+ EOS where the completion `ended` with it), re-tokenized with
    the reward model's own tokenizer and read at the last token: left padding puts it in the last column,
    where the sequence-classification head picks the last non-pad token."""
    texts = [format_prompt(tokenizer, p, chat_template) + c + ((tokenizer.eos_token or "") if e else "")
             for p, c, e in zip(prompts, completions, ended.tolist())]
    device, scores = next(reward_model.parameters()).device, []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        mask = enc["attention_mask"].to(device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens start at 0
        scores.append(reward_model(input_ids=enc["input_ids"].to(device), attention_mask=mask,
                                   position_ids=position_ids).logits[:, 0].float().cpu())
    return torch.cat(scores)


# ---------------------------------------------------------------------------------------------
# Evaluation and checkpoints
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], chat_template: bool, exact: bool, max_new_tokens: int,
             rank: int, world_size: int, seed: int, batch_size: int = 256) -> dict[str, float]:
    """Held-out accuracy: one sample at T=1 (`eval/accuracy`) and greedy (`eval/accuracy_greedy`).
    Each rank scores a strided shard; sampling is seeded and forked so that evaluation neither
    depends on nor disturbs the training RNG. `perf/eval_s` is its wall time (part of the step's `perf/step_s`)."""
    start, shard = time.perf_counter(), examples[rank::world_size]
    right = torch.zeros(2, dtype=torch.float64, device=model.device)
    largest = -(-len(examples) // world_size)  # every rank runs as many batches (FSDP's forward is collective)
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed + rank)
        for i in range(0, largest, batch_size):
            batch, counted = shard[i : i + batch_size], True
            if not batch:  # this rank's shard is one example short: generate for nothing, count nothing
                batch, counted = examples[:1], False
            prompts = [format_prompt(tokenizer, e["prompt"], chat_template) for e in batch]
            answers = [e["answer"] for e in batch]
            for j, greedy in enumerate((False, True)):
                texts = generate(model, tokenizer, prompts, 1, max_new_tokens, 1.0, greedy=greedy).texts
                right[j] += correctness_reward(texts, answers, exact).sum().item() * counted
    right = all_reduce_sum(right) / len(examples)
    return {"eval/accuracy": right[0].item(), "eval/accuracy_greedy": right[1].item(),
            "perf/eval_s": time.perf_counter() - start}


CHECKPOINT_INFO = "checkpoint.json"  # in every checkpoint folder: the file, step, ranks and flags that wrote it
TRAINING_STATE = "training_state"  # the resumable state: a torch.distributed.checkpoint folder of shards
RUN_LOCK = ".run.lock"  # in every run folder; held (fcntl) by the process that writes into the folder
_HELD_LOCKS: dict[str, int] = {}  # run folder -> open lock file: kept open for the life of the process
NOT_COMPARED = ("resume", "run_name", "output_dir")  # flags that differ between a run and its resumption


def prepare_run_dir(run_info: dict, rank: int) -> tuple[Path, Path | None]:
    """(the run's folder, the checkpoint to resume from or None), the same on every rank; nothing is
    written yet (`claim_run_dir` does, once the models are loaded).

    run_info: {"algorithm": the file's name, "config": asdict(args)}. A run writes to
    <output-dir>/<run-name>, with one exception: `--resume <run>/step_N` without `--run-name` goes on in
    <run>, the run that wrote the checkpoint (when <run> is a run folder: a checkpoint copied elsewhere
    starts a new run folder under --output-dir). A checkpoint of another algorithm file, model or number
    of ranks stops here; other changed flags are printed."""
    return _decided_on_rank_0(_find_run_dir, rank, run_info)


def claim_run_dir(run_dir: Path, checkpoint: Path | None, rank: int) -> None:
    """Take run_dir for this process, before it writes anything there. A new folder is created with its
    lock already held (an atomic rename) and an existing one is locked (fcntl, released by the OS when
    the process ends, even killed), so a second run with the same name stops here. A new run takes only
    a folder with no logged step and no checkpoint (a start that failed before step 0 is taken over). A
    resumed run moves what its checkpoint's branch no longer leads to (later checkpoints, `final/`, later
    metrics) aside into <run>/abandoned_after_step_N/, so `--resume latest` and metrics.jsonl follow the
    live run; branching into another folder, that folder starts with the checkpoint's run's earlier
    metrics. Nothing is deleted."""
    _decided_on_rank_0(_claim_run_dir, rank, run_dir, checkpoint)
    sys.excepthook = functools.partial(_explain_interrupt, sys.excepthook, run_dir, rank)


def _explain_interrupt(excepthook, run_dir: Path, rank: int, kind, value, traceback) -> None:
    """Ctrl-C: instead of a traceback (of every rank), one line from rank 0 on how to go on."""
    if not issubclass(kind, KeyboardInterrupt):
        return excepthook(kind, value, traceback)
    if rank == 0:
        print(f"\nstopped (Ctrl-C). {resume_hint(run_dir)}", file=sys.stderr, flush=True)


def resume_hint(run_dir: Path) -> str:
    """Where the run can go on from, and the command that does it (this process's own flags)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return f"No checkpoint was written (see --save-every): the run cannot be resumed. Its metrics are in {run_dir}."
    argv, kept = sys.argv[1:], []
    replaced = ("--resume", "--run-name", "--output-dir", "--run_name", "--output_dir")
    for i, arg in enumerate(argv):
        if arg in replaced or arg.startswith(tuple(f"{flag}=" for flag in replaced)) or \
                (i > 0 and argv[i - 1] in replaced):
            continue
        kept.append(arg)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    launcher = ["python"] if world_size == 1 else ["torchrun", f"--nproc_per_node={world_size}"]
    command = shlex.join([*launcher, sys.argv[0], *kept, "--output-dir", str(run_dir.parent), "--run-name",
                          run_dir.name, "--resume", "latest"])
    return f"Last checkpoint: {checkpoint}. Go on from it with: {command}"


def _decided_on_rank_0(fn, rank: int, *args):
    """fn(*args) on rank 0, its result (or its usage error, raised) on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn(*args)
        except SystemExit as stop:
            error = str(stop)
    if dist.is_initialized():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error:
        raise SystemExit(error)
    return result


def _find_run_dir(run_info: dict) -> tuple[Path, Path | None]:
    config = run_info["config"]
    resume, run_name = config["resume"], config["run_name"]
    default_name = f"{Path(run_info['algorithm']).stem}__{config['seed']}__{int(time.time())}"
    default_dir = Path(config["output_dir"]) / default_name
    checkpoint = None
    if resume == "latest":
        if run_name is None:
            raise fail("--resume latest continues the run named by --run-name: pass it.")
        run_dir = Path(config["output_dir"]) / run_name
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise fail(f"--resume latest: no checkpoint under {run_dir}. Pass the --run-name of the run to "
                       "continue (its checkpoints are written every --save-every steps), or a checkpoint folder.")
    elif resume:
        checkpoint = Path(resume)
        if not _checkpoint_info(checkpoint).get("resumable"):
            raise fail(f"--resume {resume}: not a resumable checkpoint (no {CHECKPOINT_INFO} of a step "
                       f"checkpoint). Pass a <run>/step_N folder written by --save-every, or 'latest' with --run-name.")
        if run_name is not None:
            run_dir = Path(config["output_dir"]) / run_name
        elif _is_run_dir(checkpoint.parent):
            run_dir = checkpoint.parent
        else:  # a checkpoint copied out of its run: never write among files this project did not write
            run_dir = default_dir
    else:
        run_dir = Path(config["output_dir"]) / run_name if run_name else default_dir
    if checkpoint is not None:
        _check_same_run(checkpoint, run_info)
    if not _continues(run_dir, checkpoint) and run_dir.exists() and _holds_a_run(run_dir):
        raise _taken(run_dir)
    return run_dir, checkpoint


def _taken(run_dir: Path) -> SystemExit:
    return fail(f"--run-name {run_dir.name}: {run_dir} already holds a run. Continue it with --resume latest, "
                "or choose another --run-name or --output-dir.")


def _continues(run_dir: Path, checkpoint: Path | None) -> bool:
    return checkpoint is not None and checkpoint.parent.resolve() == run_dir.resolve()


def _claim_run_dir(run_dir: Path, checkpoint: Path | None) -> None:
    _lock(run_dir)
    if _continues(run_dir, checkpoint):
        _set_aside_after(run_dir, _checkpoint_info(checkpoint)["step"])
        return
    if _holds_a_run(run_dir):  # checked again under the lock: another run may have taken it since start-up
        raise _taken(run_dir)
    if checkpoint is not None:
        step, lines = _checkpoint_info(checkpoint)["step"], _metrics_lines(checkpoint.parent)
        (run_dir / "metrics.jsonl").write_text("".join(line for line in lines if _step_of(line) < step))


def _lock(run_dir: Path) -> None:
    """Hold run_dir's lock for the rest of this process (released by the OS when it ends, even killed)."""
    key = str(run_dir.resolve())
    if key in _HELD_LOCKS:
        return
    try:
        if not run_dir.exists():  # create it with the lock already held: there is no moment it is unclaimed
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            claim = run_dir.with_name(f".{run_dir.name}.claim-{os.getpid()}")
            claim.mkdir()
            fd = os.open(claim / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                claim.rename(run_dir)
                _HELD_LOCKS[key] = fd
                return
            except OSError:  # another run created it first: that run's lock decides below
                os.close(fd)
                shutil.rmtree(claim)
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise fail(f"--output-dir {run_dir.parent}: cannot create the run folder {run_dir}: "
                   f"{error.strerror or error}. Choose a writable --output-dir.") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        os.close(fd)
        raise fail(f"--run-name {run_dir.name}: {run_dir} is in use by another run that is still going "
                   "(it holds the folder's lock). Wait for it to end, or choose another --run-name.") from None
    except OSError as error:  # e.g. a file system without locks
        os.close(fd)
        raise fail(f"--output-dir {run_dir.parent}: cannot lock {run_dir / RUN_LOCK} ({error.strerror}), so two "
                   "runs could write into one folder. Use an --output-dir on a file system with locks.") from None
    _HELD_LOCKS[key] = fd


def _is_run_dir(path: Path) -> bool:
    return (path / RUN_LOCK).exists() or (path / "metrics.jsonl").exists()


def _step_of(line: str) -> int:
    return json.loads(line)["step"] if line.endswith("\n") else math.inf  # a line cut by a crash is dropped


def _holds_a_run(run_dir: Path) -> bool:
    """True when a new run must not take run_dir: it has a logged step or a checkpoint, or it holds files
    of its own (it is not a run folder)."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.read_text().strip():
        return True
    ours = {RUN_LOCK, "metrics.jsonl", "config.json"}
    return any(p.name not in ours and not p.name.startswith("events.out.tfevents") for p in run_dir.iterdir())


def _checkpoint_info(path: Path) -> dict:
    try:
        info = json.loads((Path(path) / CHECKPOINT_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The resumable checkpoint of the highest step in run_dir (never a half-written `step_N.tmp`)."""
    found = [p for p in _step_folders(run_dir) if _checkpoint_info(p).get("resumable")]
    return found[-1] if found else None


def _step_folders(run_dir: Path) -> list[Path]:
    """run_dir's step_N folders (never step_N.tmp), by step."""
    found = [p for p in Path(run_dir).glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _metrics_lines(run_dir: Path) -> list[str]:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().splitlines(keepends=True) if metrics.exists() else []


def _check_same_run(checkpoint: Path, run_info: dict) -> None:
    """Stop when the checkpoint was written by another algorithm file, model or number of ranks; print the
    other flags that changed."""
    saved, config = _checkpoint_info(checkpoint), run_info["config"]
    if saved["algorithm"] != run_info["algorithm"]:
        raise fail(f"--resume {checkpoint}: written by {saved['algorithm']}, resumed by {run_info['algorithm']}. "
                   f"Resume it with {saved['algorithm']}, or start {run_info['algorithm']} from its weights "
                   f"with --model {checkpoint}.")
    if saved["config"]["model"] != config["model"]:
        raise fail(f"--resume {checkpoint}: trained from --model {saved['config']['model']}, resumed with "
                   f"--model {config['model']}. Resume with --model {saved['config']['model']}.")
    if saved["world_size"] != config["world_size"]:
        raise fail(f"--resume {checkpoint}: written by {saved['world_size']} rank(s), resumed on "
                   f"{config['world_size']}. Resume with --nproc_per_node={saved['world_size']} (each rank's "
                   f"sampling stream and algorithm state are its own), or start a new run from its weights "
                   f"with --model {checkpoint}.")
    changed = [f"--{key.replace('_', '-')} {saved['config'][key]} -> {value}" for key, value in config.items()
               if key not in NOT_COMPARED and key in saved["config"] and saved["config"][key] != value]
    if changed:
        print(f"--resume {checkpoint}: flags changed since the checkpoint: {', '.join(changed)}", flush=True)


def _set_aside_after(run_dir: Path, step: int) -> None:
    """Move the checkpoints after `step`, `final/` and the metrics lines from `step` on, which the
    resumed run will write anew, into run_dir/abandoned_after_step_<step>[.k]/."""
    later = [p for p in _step_folders(run_dir) if int(p.name[5:]) > step]
    later += [run_dir / "final"] if (run_dir / "final").exists() else []
    lines = _metrics_lines(run_dir)
    dropped = [line for line in lines if _step_of(line) >= step]
    if not later and not dropped:
        return
    aside = _unused(run_dir / f"abandoned_after_step_{step}")
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    (aside / "metrics.jsonl").write_text("".join(dropped))
    (run_dir / "metrics.jsonl").write_text("".join(line for line in lines if _step_of(line) < step))
    print(f"resuming from step {step}: what the run wrote after it is kept in {aside}", flush=True)


def _training_state(modules: dict[str, torch.nn.Module], optimizer) -> dict:
    """The resumable state as DCP reads and writes it: model and optimizer state dicts whose tensors are
    this rank's own (FSDP: its shards, as DTensors; DDP and one process: the full tensors)."""
    model = torch.nn.ModuleDict(modules)  # names the tensors "policy.<...>", "critic.<...>"
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_checkpoint(path: Path, modules: dict[str, torch.nn.Module], tokenizer, rank: int, run_info: dict,
                    optimizer=None, step: int = 0, extra: dict | None = None, keep: int = 0) -> None:
    """Write a checkpoint folder; call on every rank. It holds:

    - the policy (modules["policy"]) and tokenizer in `save_pretrained` format, so it loads anywhere
      with `from_pretrained`; under FSDP the weights are gathered to rank 0's CPU memory for this;
    - checkpoint.json: the algorithm file, the step, the number of ranks and every flag (run_info);
    - with an optimizer, the resumable state (`load_checkpoint`): the weights of every module and the
      optimizer state in training_state/, written with torch.distributed.checkpoint (each rank writes only
      its own shards: no rank ever holds the full optimizer state), and rank_<r>.pt with each rank's
      RNG states (torch, CUDA, Python) and its algorithm state `extra`.

    Everything is written into `<path>.tmp`, fsync'd, and renamed to `path` only when every rank has
    written its part, so a crash never leaves a partial folder under `path`. A failed write (disk full,
    no permission) removes the .tmp folder and stops with the path and the cause; earlier checkpoints
    are untouched. A folder already at `path` is moved aside, never deleted. With `keep` > 0, only the
    newest `keep` step checkpoints are kept after the save."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    policy, distributed = modules["policy"], dist.is_initialized()
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a .tmp folder is always this project's, left by a crash
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    _stop_if_any_failed(error, path, tmp, rank)  # the folder exists before any rank writes into it
    try:
        if optimizer is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(_training_state(modules, optimizer), storage_writer=dcp.FileSystemWriter(tmp / TRAINING_STATE),
                         no_dist=not distributed)
            cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
            rng = {"rng": torch.get_rng_state(), "cuda_rng": cuda_rng, "python_rng": random.getstate()}
            torch.save({**rng, "extra": extra or {}}, tmp / f"rank_{rank}.pt")
    except (Exception, dcp.CheckpointException) as exc:  # reported with its path below, on every rank
        error = exc
    weights = None
    if isinstance(unwrap(policy), FSDPModule):  # collective: every rank takes part, rank 0 receives the weights
        weights = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and error is None:
        try:
            unwrap(policy).save_pretrained(tmp, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            info = {"algorithm": run_info["algorithm"], "step": step, "resumable": optimizer is not None,
                    "world_size": dist.get_world_size() if distributed else 1, "config": run_info["config"]}
            (tmp / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2, default=str))
            _fsync_tree(tmp)
        except Exception as exc:
            error = exc
    del weights
    _stop_if_any_failed(error, path, tmp, rank)  # every rank has written its part
    if rank == 0:
        try:
            if path.exists():
                _move_aside(path)
            tmp.rename(path)
            _fsync(path.parent)
        except OSError as exc:
            error = exc
    _stop_if_any_failed(error, path, tmp, rank)
    if rank == 0 and keep > 0:
        steps = [p for p in _step_folders(path.parent) if _checkpoint_info(p)]
        for old in steps[:-keep]:
            try:
                shutil.rmtree(old)
            except OSError as error:  # rank 0 alone: a warning, never a stop that would leave the others waiting
                print(f"warning: --keep-checkpoints {keep}: could not remove {old} ({error.strerror})", flush=True)


def _stop_if_any_failed(error: BaseException | None, path: Path, tmp: Path, rank: int) -> None:
    """Collective: when a rank's write failed, every rank stops with the path and each failed rank's
    cause, and rank 0 removes the partial .tmp folder; earlier checkpoints are left as they are."""
    errors = [None if error is None else _write_error(error)]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else _write_error(error))
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    where = "; ".join(f"rank {r}: {e}" for r, e in failed) if dist.is_initialized() else failed[0][1]
    previous = latest_checkpoint(path.parent) if path.parent.exists() else None
    kept = f"the last complete checkpoint, {previous}, is untouched" if previous else "there is no earlier checkpoint"
    raise fail(f"could not write the checkpoint {path} ({where}). Removed {tmp.name}; {kept}.")


def _write_error(error: Exception) -> str:
    """The cause of a failed write in one line: the OS error and file when there is one, anywhere in the chain."""
    seen = _first_failure(error)
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror}: {seen.filename}" if seen.filename else seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` to disk, so the rename that publishes it is durable."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _unused(path: Path) -> Path:
    """`path`, or the first of `path.2`, `path.3`, ... that does not exist yet."""
    k = 1
    while (found := path if k == 1 else path.with_name(f"{path.name}.{k}")).exists():
        k += 1
    return found


def _move_aside(path: Path) -> None:
    aside = _unused(path.with_name(f"{path.name}.old"))
    path.rename(aside)
    print0(f"moved the earlier {path} aside to {aside}")


class _MetadataUnpickler(pickle.Unpickler):
    """Reads DCP's `.metadata` (a pickle) allowing only the plain classes it is made of: a planted
    payload that names any other callable (os.system, eval, ...) is refused before it can run."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name) for name in
        ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
         "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
         ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:  # non-tensor values (optimizer hyper-parameters): plain data only
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_checkpoint(path: Path, modules: dict[str, torch.nn.Module], optimizer, rank: int) -> tuple[int, dict]:
    """Restore what `save_checkpoint` wrote: every module's weights and the optimizer state in place (each
    rank reads only its own shards), and this rank's RNG state. Returns (the step to continue from,
    this rank's algorithm state).

    Nothing in the folder is unpickled beyond tensors and plain data: DCP's metadata through an
    allow-list, everything else with `torch.load(weights_only=True)`.

    The number of ranks must be the one that saved (`prepare_run_dir` checks it). DCP itself could
    reshard the weights and optimizer state to another count, but each rank's sampling stream and
    algorithm state (GVPO's replayed groups are its own completions) have no counterpart on another
    count, and a resumed run is meant to be the run that stopped, bitwise. To go on with other hardware,
    start a new run from the step's weights (`--model <run>/step_N`)."""
    state = _training_state(modules, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_SafeReader(path / TRAINING_STATE), planner=_SafeLoadPlanner(),
                     no_dist=not dist.is_initialized())
        model = torch.nn.ModuleDict(modules)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        with torch.serialization.safe_globals([Rollout]):  # GVPO's replayed groups
            own = torch.load(path / f"rank_{rank}.pt", weights_only=True)
    except (Exception, dcp.CheckpointException) as error:  # a refused pickle, a shape that does not fit, ...
        raise fail(f"--resume {path}: cannot restore it: {_load_error(error)}") from None
    torch.set_rng_state(own["rng"])
    random.setstate(own["python_rng"])  # unused by these files, kept for code you add
    if own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"])
    return _checkpoint_info(path)["step"], own["extra"]


def _first_failure(error: BaseException) -> BaseException:
    """The exception inside a CheckpointException (DCP gathers each rank's failure, with its traceback)."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def _load_error(error: BaseException) -> str:
    """One line for a failed restore. A refused pickle is named as such, in our words: torch's own text
    suggests `weights_only=False`, which would run it."""
    error = _first_failure(error)
    text = " ".join(str(error).split())
    if isinstance(error, pickle.UnpicklingError) or "is not allowed in a checkpoint" in text:
        found = re.search(r"GLOBAL ([\w.]+)|([\w.]+) is not allowed|WeightsUnpickler error: ([^.]*)", text)
        what = next((g for g in found.groups() if g), "") if found else ""
        return (f"it holds pickled data other than tensors and plain data ({what}). Refused without running "
                "it: do not resume from a folder you do not trust.")
    return text if len(text) < 400 else text[:400] + " ..."


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str):
    """`with timed(times, "gen"): ...` adds the section's wall time to times["gen"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
