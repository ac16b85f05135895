"""The plumbing every algorithm file shares, in one file to copy beside it. Nothing here appears in an
algorithm's equations: advantages, ratios, clipping, KL and loss aggregation live in each algorithm file.

1. Flags: `cli`, `check_flags`, `require`, `UsageError` (bad input: one line naming the flag and the fix)
2. Distributed: `setup_distributed`, `cleanup_distributed`, `print0`, `all_reduce`, `no_sync`
3. Models: `load_tokenizer`, `load_model` (any Hugging Face causal LM, dropout off), `add_lora` (peft),
   `load_reference` (a frozen copy, or the policy with its adapters off), `shard_model` (FSDP2)
4. Data: `load_task` (built-in a+b task, JSONL, `datasets`; prompts that fit), `format_prompt`, `prompt_batch`
5. Rewards and evaluation: `score` (correctness by math-verify, format, a user's function), `evaluate`
6. Generation and log-probs: `Rollout`, `generate` (`model.generate`, or `VllmEngine`), `get_logprobs`,
   `sampler_logprob_gap`, `rollout_weights` and `reweighted` (the rollout correction)
7. Metrics and logging: `Logger` (stdout, metrics.jsonl, TensorBoard, W&B), `step_metrics`
8. Run folder: `prepare_run_dir`, `claim_run_dir`, `resume_hint` (the rules: docs/checkpoints.md)
9. Checkpoints: `save_checkpoint`, `load_checkpoint` (torch.distributed.checkpoint, safetensors only)
"""

import contextlib
import dataclasses
import datetime
import errno
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
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers
import tyro
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

ROOT = Path(__file__).resolve().parent  # the repository: a --model inside it is recorded relative to it
DEFAULT_MODEL = str(ROOT / "tiny_model")  # made by make_tiny_model.py
# The KV cache's name in forward's arguments and outputs: `cache` from transformers 5.20, `past_key_values`
# before (the vLLM environment's transformers, pinned by vLLM, is older than requirements.txt's).
CACHE = "cache" if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__ else \
    "past_key_values"

# ---------------------------------------------------------------------------------------------
# 1. Flags
# ---------------------------------------------------------------------------------------------


class UsageError(ValueError):
    """Bad input (a flag, a file, a dataset row), with a message that names it and the fix. Each algorithm
    file's `__main__` prints it as one line and exits with status 2, as for a malformed flag."""


# (flag, valid, what it must be, why): the flags every algorithm file shares, checked by `check_flags`.
FLAG_RULES = [
    ("num_steps", lambda v: v >= 1, ">= 1", "0 would save the untrained model as final/"),
    ("prompts_per_step", lambda v: v >= 1, ">= 1", ""),
    ("group_size", lambda v: v >= 1, ">= 1", ""),
    ("max_new_tokens", lambda v: v >= 1, ">= 1", "each completion has at least its EOS token"),
    ("seed", lambda v: 0 <= v < 2**63, "in [0, 2**63)", "torch's seeds are 64-bit; each rank adds its rank"),
    ("temperature", lambda v: 0.01 <= v < math.inf, ">= 0.01", "the log-probs divide the logits by it, and below "
     "0.01 float32 log-probs lose the precision a ratio needs; for sharper sampling try 0.5, and "
     "eval/accuracy_greedy reports greedy decoding"),
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
    ("dist_timeout", lambda v: 0 < v < math.inf, "> 0", "minutes"),
    ("correction_cap", lambda v: v >= 1, ">= 1", "pi_old / pi_sampler is 1 where the two agree"),
    ("lora_rank", lambda v: v >= 0, ">= 0", "0: full fine-tuning"),
    ("lora_alpha", lambda v: v > 0, "> 0", "the adapters' scale is alpha / rank"),
    ("vllm_gpu_memory", lambda v: 0 < v <= 1, "in (0, 1]", "a fraction of the GPU's memory"),
]
INFINITE_ALLOWED = {"max_grad_norm"}  # float flags where inf means something (no clipping); any other must be finite


def cli(args_class, args: list[str] | None = None):
    """tyro.cli for an Args made of flag groups (its dataclass bases): `--help` shows each group under its
    name ("Model & data options"), and the flags and Args stay flat (--seed, args.seed). tyro groups only
    nested dataclasses, so a nested one is built from the bases here and flattened after parsing."""
    groups = [c for c in reversed(args_class.__mro__[1:]) if dataclasses.is_dataclass(c)]  # ExperimentFlags first
    titles = [re.sub(r"(?<=[a-z])(?=[A-Z])", " ", group.__name__.removesuffix("Flags")).capitalize()
              .replace(" and ", " & ") for group in groups]  # ModelAndDataFlags -> "Model & data"
    grouped = dataclasses.make_dataclass(args_class.__name__, [
        (group.__name__, Annotated[group, tyro.conf.arg(name=title)], dataclasses.field(default_factory=group))
        for group, title in zip(groups, titles)])
    parsed = vars(tyro.cli(grouped, args=args, config=(tyro.conf.OmitArgPrefixes,)))
    return args_class(**{key: value for group in parsed.values() for key, value in vars(group).items()})


def require(valid: bool, flag: str, value, must: str) -> None:
    """Stop at start-up unless `valid`: `require(args.beta >= 0, "--beta", args.beta, ">= 0")`."""
    if not valid:
        raise UsageError(f"{flag} {value}: must be {must}.")


def check_flags(args) -> None:
    """The shared flags, before anything is loaded or written: one line naming the flag, the value and
    what it must be. Sets the per-rank sizes (args.world_size, local_prompts_per_step, local_batch_size,
    minibatch_size, micro_batch_size). Each algorithm file checks its own flags after this (`require`)."""
    for field in dataclasses.fields(args):  # every float flag, the algorithm's too: nan and inf pass any comparison
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value) and field.name not in INFINITE_ALLOWED:
            raise UsageError(f"--{field.name.replace('_', '-')} {value}: must be a finite number.")
    for name, valid, must, why in FLAG_RULES:
        value = getattr(args, name)
        require(valid(value), f"--{name.replace('_', '-')}", value, must + (f" ({why})" if why else ""))
    if args.eval_every and args.eval_size == 0 and args.eval_dataset is None and args.eval_split is None:
        raise UsageError(f"--eval-size 0 leaves nothing to evaluate every --eval-every {args.eval_every} steps: pass "
                         "--eval-every 0, a positive --eval-size, or --eval-dataset.")
    if args.run_name is not None and (args.run_name in ("", ".", "..") or re.search(r"[/\\]", args.run_name)):
        raise UsageError(f"--run-name {args.run_name!r}: must be a folder name under --output-dir, without '/' "
                         "(pass --output-dir for another place).")
    output = Path(args.output_dir).expanduser()
    existing = next(p for p in (output, *output.parents) if p.exists())
    longest = os.pathconf(existing, "PC_NAME_MAX")
    if args.run_name is not None and len(args.run_name.encode()) > longest:
        raise UsageError(f"--run-name: {len(args.run_name.encode())} bytes, longer than the {longest} that a folder "
                         "name may have here. Choose a shorter one.")
    if not existing.is_dir():
        raise UsageError(f"--output-dir {args.output_dir}: {existing} is a file, not a folder. Pass a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {args.output_dir}: {existing} is not writable by this user. Pass a folder you "
                         "can write to.")
    if args.rollout_correction == "auto":  # another engine's numerics differ from the trainer's
        args.rollout_correction = "tis" if args.vllm else "none"
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))  # as setup_distributed reads it
    if args.fsdp and args.world_size < 2:
        raise UsageError("--fsdp shards the model over ranks: launch with torchrun --nproc_per_node=2 or more.")
    args.local_prompts_per_step = exact_div(
        args.prompts_per_step, args.world_size, "--prompts-per-step must be divisible by the number of ranks")
    args.local_batch_size = args.local_prompts_per_step * args.group_size
    args.minibatch_size = exact_div(
        args.local_batch_size, args.num_minibatches,
        "--num-minibatches must divide the sequences per rank (--prompts-per-step / ranks * --group-size)")
    args.micro_batch_size = args.micro_batch_size or args.minibatch_size
    exact_div(args.minibatch_size, args.micro_batch_size,
              "--micro-batch-size must divide the sequences per rank and minibatch")


def exact_div(numerator: int, denominator: int, message: str) -> int:
    """`numerator // denominator`, failing at start-up with `message` when it does not divide."""
    if denominator <= 0 or numerator % denominator != 0:
        raise UsageError(f"{message} (got {numerator} and {denominator})")
    return numerator // denominator


# ---------------------------------------------------------------------------------------------
# 2. Distributed
# ---------------------------------------------------------------------------------------------


def setup_distributed(timeout_minutes: float = 60) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment; a plain `python x.py` is rank 0 of 1. A
    collective that waits longer than `timeout_minutes` for another rank fails, naming --dist-timeout."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
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
    """The last call of a distributed run, once main has returned: wait for every rank (rank 0 may still be
    writing), then tear the process group down. On CPU the process then ends at once: gloo's worker
    threads outlive destroy_process_group while anything holds the group (after FSDP, DTensor's caches
    hold its mesh), and one that needs the GIL during interpreter teardown aborts the process
    ('terminate called without an active exception', exit code -6)."""
    if dist.is_initialized():
        on_cpu = dist.get_backend() == "gloo"
        dist.barrier()
        dist.destroy_process_group()
        if on_cpu:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # every file is closed by now (main has returned); the OS frees the rest


def print0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A copy of `x` reduced over ranks by "sum", "min" or "max" (identity on one process)."""
    x = x.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(x, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return x


def current_device() -> torch.device:
    """The device this rank computes on (set by `setup_distributed`): its GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def all_reduce_mean(metrics: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Scalar metrics (floats or 0-dim tensors) averaged over ranks, so that what rank 0 logs describes the
    whole step: one all-reduce and one device-to-host copy for all of them."""
    if not metrics:
        return {}
    device = current_device()
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach() for v in metrics.values()])
    if dist.is_initialized():
        values = all_reduce(values) / dist.get_world_size()
    return dict(zip(metrics, values.tolist()))


def no_sync(models, last: bool) -> contextlib.ExitStack:
    """Inside, backward() accumulates gradients without DDP's all-reduce for each DDP-wrapped module of
    `models`, unless this is the `last` micro-batch of the optimizer step, whose backward syncs them."""
    stack = contextlib.ExitStack()
    for model in () if last else models:
        if isinstance(model, DistributedDataParallel):
            stack.enter_context(model.no_sync())
    return stack


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (collective: every rank calls it), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return getattr(model, "module", model)


def on_every_rank(model, flag: bool, device: torch.device) -> bool:
    """`flag` where every rank has it, for a model whose forward is collective (DDP broadcasts its buffers,
    FSDP all-gathers its weights), so that the ranks run the same forwards; `flag` for any other model."""
    collective = isinstance(model, DistributedDataParallel) or isinstance(unwrap(model), FSDPModule)
    if not (dist.is_initialized() and collective):
        return flag
    return bool(all_reduce(torch.tensor(int(flag), device=device), "min"))


# ---------------------------------------------------------------------------------------------
# 3. Models
# ---------------------------------------------------------------------------------------------


def from_pretrained(auto_class, name: str, flag: str = "--model", **kwargs):
    """`auto_class.from_pretrained` that never runs code from the model's folder or repository (every config,
    tokenizer and model here loads through it): a model that needs it (`auto_map`) stops with one line
    instead of transformers' question "Do you wish to run the custom code?", which a `yes |` would answer."""
    path = Path(name).expanduser()
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise UsageError(f"{flag} {name!r}: no such folder. Pass an existing folder or a Hugging Face model name.")
    if (path / "adapter" / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise UsageError(f"{flag} {name!r}: a step checkpoint of a LoRA run holds its adapters (adapter/), not a "
                         "model. Go on with --resume, or start from the run's final/ (the merged model).")
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:
            config = e
        if not isinstance(config, dict):
            what = f"not valid JSON ({config})" if isinstance(config, Exception) else f"a JSON {type(config).__name__}"
            raise UsageError(f"{flag} {name!r}: its config.json is {what}, not a JSON object. Restore the model's "
                             "config.json (copy it again from where the model came from).")
    try:
        return auto_class.from_pretrained(name, trust_remote_code=False, **kwargs)
    except SafetensorError as e:
        raise UsageError(f"{flag} {name!r}: cannot read its weights ({e}). A file is damaged or incomplete (an "
                         "interrupted download or copy?): copy the model again.") from None
    except pickle.UnpicklingError:  # torch.load(weights_only=True) met something other than tensors
        raise UsageError(f"{flag} {name!r}: its weights file holds pickled data other than tensors. Refused without "
                         "running it: use the model's safetensors weights, or a copy you trust.") from None
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise UsageError(f"{flag} {name!r}: it needs code from the model's folder or repository (auto_map), and "
                             "code from a model is never run here. Use a model whose architecture transformers "
                             "has.") from None
        raise UsageError(f"{flag} {name!r}: cannot load it ({str(e).splitlines()[0]}). Pass a local folder or a "
                         "Hugging Face model name reachable from this machine.") from None


def load_tokenizer(name: str, flag: str = "--model"):
    """Left padding (prompts end where generation starts) and a pad token distinct from EOS, so that
    masking padding can never mask the real EOS token, which is an action and gets gradient."""
    tokenizer = from_pretrained(AutoTokenizer, name, flag)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def load_model(name: str, dtype: str, device: torch.device, tokenizer, auto_class=AutoModelForCausalLM,
               flag: str = "--model", gradient_checkpointing: bool = False):
    """Any causal LM (or, with `auto_class`, e.g. `AutoModel`, its backbone) by Hugging Face name or local
    path, in `dtype` ("auto": fp32 on CPU, bf16 on GPU), its embeddings grown if `load_tokenizer` added a
    pad token. Log-probs must be a deterministic function of the weights, also in train mode (which
    --gradient-checkpointing needs): every dropout rate is zeroed in the config before the model is built
    (attention dropout is applied functionally from it) and in every dropout module. `gradient_checkpointing`
    recomputes each layer in the backward pass, which transformers does in train mode only."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = from_pretrained(AutoConfig, name, flag)
    _zero_dropout(config)
    backbone = auto_class is not AutoModelForCausalLM  # e.g. a critic: a causal LM's head is left unused
    with transformers_quiet(backbone):
        model, info = from_pretrained(auto_class, name, flag, config=config, dtype=getattr(torch, dtype),
                                      output_loading_info=True)
    if backbone and (info["missing_keys"] or info["mismatched_keys"]):  # what the silenced report said of worth
        print0(f"warning: {flag} {name!r}: weights not in the checkpoint, left as initialised: "
               f"{sorted(map(str, info['missing_keys'] or info['mismatched_keys']))[:5]}")
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
    if gradient_checkpointing:  # dropout is off: train mode changes nothing else
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # < 5.20
        enable({"use_reentrant": False})
        model.train()
    return model


def _zero_dropout(config) -> None:
    """Every dropout-like rate of a model config (attention_dropout, resid_pdrop, layerdrop, ...) set to 0."""
    for key, value in vars(config).items():
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
        elif isinstance(value, transformers.PretrainedConfig):
            _zero_dropout(value)


@contextlib.contextmanager
def transformers_quiet(quiet: bool = False):
    """transformers' progress bars off while loading or saving (one bar per rank under torchrun), and with
    `quiet` its warnings too (a backbone's load report lists the unused LM head as UNEXPECTED)."""
    level, bars = transformers.utils.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    if quiet:
        transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()


@torch.no_grad()
def check_output_logits(model, name: str, flag: str = "--model") -> None:
    """Fail at load time unless `output_logits` reproduces the model's own logits on a few tokens (tolerance:
    1e-4 of the largest logit in fp32, 2e-2 in 16-bit): `get_logprobs` projects hidden states itself, so a
    forward that changes the logits in a way it does not know would train another distribution than the
    one sampled."""
    ids = torch.arange(8, device=model.device)[None] % model.config.get_text_config().vocab_size
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    theirs, ours = out.logits.float(), output_logits(model, out.hidden_states[-1]).float()
    tolerance = (1e-4 if model.dtype == torch.float32 else 2e-2) * theirs.abs().max().clamp(min=1)
    difference = (ours - theirs).abs().max()
    if not difference <= tolerance:
        raise UsageError(f"{flag} {name!r}: its forward changes the LM head's logits in a way get_logprobs does not "
                         f"reproduce (largest difference {difference.item():.3g}). Supported: a plain LM head, "
                         "final_logit_softcapping, logit_scale, logits_scaling; add its transform to "
                         "common.output_logits.")


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2, in place: each decoder layer (the model's `_no_split_modules` classes), then the rest. On GPU
    the shards are fp32 master weights and the compute is bf16, with gradients reduced in fp32."""
    mp = MixedPrecisionPolicy()
    if device.type == "cuda":
        model.float()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layer_classes = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def add_lora(model, rank: int, alpha: float, targets: str):
    """`model` with LoRA adapters (peft) of `rank` on `targets` ("all-linear": every linear layer of the
    transformer blocks, not the LM head; or comma-separated module names), the only weights trained; the
    model itself when `rank` is 0. Dropout 0: the trained distribution must be the sampled one."""
    if not rank:
        return model
    try:
        import peft
    except ImportError:
        raise UsageError("--lora-rank needs peft: pip install peft") from None
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                             target_modules=targets if targets == "all-linear" else targets.split(","))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # peft on transformers' renamed attributes
            return peft.get_peft_model(model, config).train(model.training)  # in the mode the model was
    except (ValueError, TypeError) as e:  # no module matched, or one of a type peft does not adapt
        raise UsageError(f"--lora-targets {targets}: {str(e).splitlines()[0]} Name modules of the model's "
                         "transformer blocks (e.g. q_proj,v_proj), or leave it at all-linear.") from None


def is_lora(model) -> bool:
    return getattr(unwrap(model), "peft_config", None) is not None


class AdaptersOff:
    """The policy with its LoRA adapters switched off: the base model it started from, the frozen
    reference, without a second copy of the weights (for `get_logprobs`, which reaches it via `module`)."""

    def __init__(self, policy):
        self.module = policy

    def __call__(self, *args, **kwargs):
        with self.module.disable_adapter():
            return self.module(*args, **kwargs)


def load_reference(args, policy, tokenizer, device: torch.device):
    """The frozen reference model: with LoRA the policy with its adapters off; else a copy of --model (with
    the loading seed, as the policy), sharded like the policy under --fsdp."""
    if is_lora(policy):
        return AdaptersOff(unwrap(policy))
    torch.manual_seed(args.seed)
    reference = load_model(args.model, args.dtype, device, tokenizer).eval().requires_grad_(False)
    return shard_model(reference, device) if args.fsdp else reference


def plain_weights(model, state: dict | None = None):
    """(name, tensor) of the model's weights as plain transformers names them, one at a time: under FSDP each
    gathered whole in turn; with LoRA each adapted weight merged, W + scale * B A, out of place (the
    adapters stay as they are). `state`: a full state dict of the model to read instead of its own."""
    peft_model = unwrap(model)
    state = peft_model.state_dict() if state is None else state
    for key, value in state.items():
        if ".lora_" in key:
            continue
        value, layer = whole(value), key.rsplit(".base_layer.", 1)[0]
        if key.endswith(".base_layer.weight") and f"{layer}.lora_A.default.weight" in state:
            a, b = (whole(state[f"{layer}.lora_{x}.default.weight"]) for x in "AB")
            value = value + peft_model.get_submodule(layer).scaling["default"] * b @ a
        yield key.removeprefix("base_model.model.").replace(".base_layer.", "."), value


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` that returns the total norm as a plain tensor, also for FSDP's sharded gradients."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return whole(norm)


def check_grad_norm(grad_norm: torch.Tensor, step: int, run_dir: Path) -> None:
    """Stop the run before the optimizer step when the gradient norm is not finite (the same value on every
    rank: all stop), naming the checkpoint to go on from. One host sync per optimizer step."""
    if not torch.isfinite(grad_norm):
        raise UsageError(f"step {step}: non-finite gradient norm ({grad_norm.item()}); stopped before the optimizer "
                         f"step. Try a lower --learning-rate, or check --reward-fn. {resume_hint(run_dir)}")


def model_positions(name: str, flag: str = "--model") -> int | None:
    """How many positions (prompt and completion together) the model takes, from its config (None: no limit)."""
    config = from_pretrained(AutoConfig, name, flag).get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


# ---------------------------------------------------------------------------------------------
# 4. Data
# ---------------------------------------------------------------------------------------------


def builtin_splits(max_operand: int = 99, eval_size: int = 500) -> tuple[list[dict], list[dict]]:
    """The built-in task: `a+b` for 0 <= a, b <= max_operand, answered with the sum's digits. All pairs,
    shuffled once with a fixed seed: the first `eval_size` are held out, the rest (9,500) train."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(1234)).tolist()
    examples = [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in (pairs[i] for i in order)]
    return examples[eval_size:], examples[:eval_size]


def load_rows(source: str, flag: str = "--dataset", config: str | None = None, split: str | None = "train",
              prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict]:
    """`{"prompt", "answer"}` rows from a JSONL file (read here: it needs nothing more) or anything `datasets`
    reads (a Hub name, JSON/Parquet/CSV files, a `save_to_disk` folder) at `config` and `split` (None: its
    'test' split, or its only one). A missing, null or non-text field stops naming the file and line."""
    records = _jsonl_records(source, flag) if source.endswith(".jsonl") and config is None else \
        _dataset_records(source, flag, config, split)
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


def _jsonl_records(source: str, flag: str):
    """(file:line, object) for each non-empty line of a JSONL file."""
    path = Path(source).expanduser()
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
            if line.strip():
                yield f"{path}:{line_no}", _json(line, f"{path}:{line_no}", "Each line must be one JSON object.")


def _json(text: str, where: str, fix: str):
    """`json.loads(text)`, or a stop naming `where` and what json objected to, in a few words."""
    try:
        return json.loads(text)
    except RecursionError:
        problem = "nested too deep"
    except json.JSONDecodeError as e:
        problem = e.msg
    except ValueError:  # its own message names a function to call
        problem = f"a number of more than {sys.get_int_max_str_digits()} digits"
    raise UsageError(f"{where}: not valid JSON ({problem}). {fix}")


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
    """(train, eval) examples: the built-in task, or `load_rows` of --dataset with, held out, --eval-dataset
    (at --eval-split or its 'test' split), else --eval-split of --dataset, else its last `eval_size` rows."""
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


def load_task(args) -> tuple:
    """(tokenizer, train, held_out, exact, reward_fn): what a run trains on, from the flags, checked before any
    model is loaded so that bad input fails fast. The tokenizer of --model; the examples of `load_data` whose
    prompts fit the model (`fit_prompts`); `exact`: the built-in task's answers are compared as whole
    strings; the --reward-fn function, tried on two examples, or None."""
    train, held_out = load_data(args.dataset, args.eval_dataset, args.eval_size, args.dataset_config, args.split,
                                args.eval_split, args.prompt_field, args.answer_field)
    reward_fn = load_reward_fn(args.reward_fn, train[:2]) if args.reward_fn else None
    tokenizer = load_tokenizer(args.model)
    train, held_out = fit_prompts(train, held_out, tokenizer, args.chat_template, args.max_prompt_length,
                                  args.max_new_tokens, args.model)
    return tokenizer, train, held_out, args.dataset is None, reward_fn


def fit_prompts(train: list[dict], held_out: list[dict], tokenizer, chat_template: bool,
                max_prompt_length: int | None, max_new_tokens: int, model: str) -> tuple[list[dict], list[dict]]:
    """The examples whose prompt, formatted as it will be sampled from, is not empty, has at most
    `max_prompt_length` tokens and leaves room for `max_new_tokens` in the positions of `model` (a longer
    one would be trained on positions past the trained range, or crash the step that draws it). The
    others are dropped with a printed count; a set left empty stops the run."""
    positions = model_positions(model)
    limit = min(max_prompt_length or math.inf, positions - max_new_tokens if positions else math.inf)
    if limit < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's {positions} "
                         "positions. Lower --max-new-tokens.")
    why = f"longer than --max-prompt-length {limit} tokens" if limit == max_prompt_length else \
        (f"longer than {limit} tokens (the model takes {positions} positions, --max-new-tokens {max_new_tokens} of "
         "them for the completion)")
    fitted = []
    for examples, what in ((train, "training data"), (held_out, "held-out data")):
        texts = [format_prompt(tokenizer, e["prompt"], chat_template) for e in examples]
        try:
            prompts = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
        except Exception as e:  # e.g. a word-level tokenizer without an unknown token meets a new character
            raise UsageError(_unencodable(tokenizer, examples, what, e)) from None
        empty = sum(len(ids) == 0 for ids in prompts)  # nothing to continue from
        if examples and empty == len(examples):
            raise UsageError(f"{what}: all {len(examples)} prompts are empty (no token, and no chat template or BOS "
                             "token around them). Check --prompt-field, or leave --chat-template on.")
        if empty:
            print0(f"{what}: dropped {empty} of {len(examples)} prompts that are empty (no token)")
        kept = [e for e, ids in zip(examples, prompts) if 0 < len(ids) <= limit]
        if examples and not kept:
            raise UsageError(f"{what}: all {len(examples)} prompts are {why}. Raise --max-prompt-length, or lower "
                             "--max-new-tokens.")
        if len(kept) < len(examples) - empty:
            print0(f"{what}: dropped {len(examples) - empty - len(kept)} of {len(examples)} prompts {why}")
        fitted.append(kept)
    check_round_trip(tokenizer, train[:64])
    return fitted[0], fitted[1]


def check_round_trip(tokenizer, examples: list[dict]) -> None:
    """Warn when prompts do not come back from encode + decode as they were: the model would be trained on
    other text than the data's (a tokenizer class that drops spaces, or an unknown-token fallback)."""
    for example in examples:
        text = example["prompt"]
        back = tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids)
        if back != text:
            return print0(f"warning: the tokenizer of --model ({type(tokenizer).__name__}) does not give the prompts "
                          f"back as they were: {text[:60]!r} comes back as {back[:60]!r}. The model is trained on what "
                          "it encodes; check that the folder's tokenizer files are the model's own.")


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
    """This rank's slice of step `step`'s global batch of `batch_size` prompts. Every rank computes the same
    global order (a fresh permutation each epoch, seeded by seed + epoch), so the data order depends only on
    (seed, step): resuming is exact and the global batch is the same whatever the number of ranks."""
    local = batch_size // world_size
    start = step * batch_size + rank * local
    return [examples[_epoch_order(len(examples), seed + pos // len(examples))[pos % len(examples)]]
            for pos in range(start, start + local)]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int) -> list[int]:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------
# 5. Rewards and evaluation
# ---------------------------------------------------------------------------------------------


def final_answer(text: str) -> str | None:
    """The content of a completion's last \\boxed{...}, else what follows its last '####' (GSM8K), else None."""
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


# The child process that runs math-verify: one (gold, completion) JSON line in, "1" or "0" out. It runs
# isolated (`python -I`: a `json.py` in the working directory is not imported), with the folder that holds
# math_verify (argv[1]) on its path. Its own timeouts are off (signal.alarm cannot stop C code such as
# big-integer arithmetic): the parent enforces the deadline. An address-space limit turns a runaway
# allocation into a MemoryError (scored 0) rather than the machine's OOM killer.
_MATH_VERIFY_CHILD = r"""
import sys
sys.path.append(sys.argv[1])
import json, logging, resource
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
    """math-verify (the grader of TRL's accuracy reward) in a child process, with a hard deadline: a completion
    not graded within `timeout_s` scores 0 and the child is started afresh, so no completion can hang a step
    (under torchrun the other ranks would wait in a collective). One child per rank, started on first use."""

    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s, self.child, self.timeouts = timeout_s, None, 0

    def _start(self) -> None:
        found = importlib.util.find_spec("math_verify")
        if found is None:
            raise UsageError("the math reward needs math-verify: pip install -r requirements.txt")
        where = str(Path(found.origin).parent.parent)  # the site-packages (or other folder) it is installed in
        self.child = subprocess.Popen([sys.executable, "-I", "-c", _MATH_VERIFY_CHILD, where], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if not select.select([self.child.stdout], [], [], 120)[0] or self.child.stdout.readline() != "ready\n":
            self._stop()
            raise UsageError("the math reward's math-verify process did not start: check "
                             "`python -c 'import math_verify'`")

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
    'reasoning #### 72'? Plain numbers (the completion's final answer, or the whole completion) are compared
    numerically (1e-6 relative); a gold letter A-J with the letter chosen (`chosen_letter`); anything else
    symbolically by math-verify (fractions, roots, pi, units, intervals, tuples, sets, equations)."""
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
    if _math_verifier.timeouts:
        print(f"math reward: {_math_verifier.timeouts} completion(s) not graded within {_math_verifier.timeout_s} s "
              "scored 0", flush=True)
        _math_verifier.timeouts = 0
    return torch.tensor(right, dtype=torch.float32)


def format_reward(completions: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the answer is given in the expected form: a bare number (built-in) or \\boxed{} / ####."""
    if exact:
        return torch.tensor([re.fullmatch(r"\s*-?\d+\s*", c) is not None for c in completions], dtype=torch.float32)
    return torch.tensor(["\\boxed{" in c or "####" in c for c in completions], dtype=torch.float32)


def load_reward_fn(spec: str, examples: list[dict] = ()):
    """`module:function` (importable from the working directory) or `path/to/file.py:function`, called as
    `fn(prompts, completions, answers)` -> one float per completion; tried at once on `examples`."""
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise UsageError(f"--reward-fn {spec!r}: expected 'module:function' or 'file.py:function'.")
    ours = sys.modules.get(module_name.partition(".")[0])
    if not module_name.endswith(".py") and Path(getattr(ours, "__file__", None) or "/").parent == ROOT:
        raise UsageError(f"--reward-fn {spec!r}: {module_name!r} is a module of this project; pass your file as "
                         f"path/to/{module_name}.py:{fn_name}, or rename it.")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if loader_spec is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())  # for this import only: found from the working directory first
            try:
                module = importlib.import_module(module_name)
            finally:
                sys.path.remove(os.getcwd())
    except Exception as e:
        raise UsageError(f"--reward-fn {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}).") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--reward-fn {spec!r}: {module_name!r} has no function {fn_name!r}.")
    if examples:
        answers = [e["answer"] for e in examples]
        call_reward_fn(fn, spec, [e["prompt"] for e in examples], answers, answers)
    return fn


def call_reward_fn(fn, spec: str, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
    """A user reward function's values (B,): one finite float per completion, or a stop that says what it gave.
    It gets copies of the lists. It has no deadline: it runs in this process, where it may hold a model or a
    connection (under torchrun the other ranks stop after --dist-timeout; give its own calls a timeout)."""
    try:
        values = fn(list(prompts), list(completions), list(answers))
    except SystemExit as e:  # an exit inside it would end the run with its status, and no final/
        raise UsageError(f"--reward-fn {spec!r} called sys.exit({e.code}). A reward function must return its "
                         "values; to stop the run, raise an exception.") from None
    except Exception as e:
        raise UsageError(f"--reward-fn {spec!r} raised {type(e).__name__}: {e}") from None
    out = None
    if isinstance(values, (list, tuple, torch.Tensor)) or type(values).__name__ == "ndarray":  # not a dict's keys
        with contextlib.suppress(TypeError, ValueError):
            out = torch.tensor([float(v) for v in values], dtype=torch.float32)
    if out is None or len(out) != len(completions) or not out.isfinite().all():
        shown = repr(values) if out is None else repr(out.tolist()[:4])
        raise UsageError(f"--reward-fn {spec!r} must return a list of one finite float per completion "
                         f"({len(completions)}), got {shown[:200]}.")
    return out


def score(examples: list[dict], completions: list[str], group_size: int, exact: bool, format_weight: float = 0.0,
          reward_fn=None, reward_fn_spec: str = "") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total reward (B,) = correct + format_weight * format + user reward, and each component (B,), of the
    completions of `examples` ({"prompt", "answer"}): `group_size` of each, stored contiguously."""
    prompts = [e["prompt"] for e in examples for _ in range(group_size)]
    answers = [e["answer"] for e in examples for _ in range(group_size)]
    components = {"correct": correctness_reward(completions, answers, exact)}
    if format_weight:
        components["format"] = format_reward(completions, exact)
    if reward_fn is not None:
        components["user"] = call_reward_fn(reward_fn, reward_fn_spec, prompts, completions, answers)
    rewards = components["correct"] + format_weight * components.get("format", 0.0) + components.get("user", 0.0)
    return rewards, components


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], chat_template: bool, exact: bool, max_new_tokens: int, seed: int,
             batch_size: int = 256, vllm: "VllmEngine | None" = None) -> dict[str, float]:
    """Held-out accuracy: one sample at T=1 (`eval/accuracy`) and greedy (`eval/accuracy_greedy`). Each rank
    scores a strided shard; sampling is seeded and forked, so evaluation neither depends on nor disturbs the
    training RNG (`vllm`: its engine samples). `perf/eval_s` is its wall time (part of the step's `perf/step_s`)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
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
            for j, greedy in enumerate((False, True)):
                texts = generate(model, tokenizer, prompts, 1, max_new_tokens, 1.0, greedy, vllm).texts
                right[j] += correctness_reward(texts, [e["answer"] for e in batch], exact).sum().item() * counted
    right = all_reduce(right) / len(examples)
    return {"eval/accuracy": right[0].item(), "eval/accuracy_greedy": right[1].item(),
            "perf/eval_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------
# 6. Generation and log-probs
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
                    from (0 after EOS; 0 everywhere for greedy decoding)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    texts: list[str]
    truncated: torch.Tensor
    sampler_logprobs: torch.Tensor


def cat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts into one: prompts re-padded on the left to the widest, responses on the right to the
    longest. Rows keep their order, so groups stay contiguous."""
    P, L = max(r.prompt_length for r in rollouts), max(r.response_mask.shape[1] for r in rollouts)

    def pad(r: Rollout, x: torch.Tensor, value, left: bool = True) -> torch.Tensor:  # to (B, P+L), or (B, L)
        return F.pad(x, (P - r.prompt_length if left else 0, L - r.response_mask.shape[1]), value=value)

    return Rollout(torch.cat([pad(r, r.input_ids, pad_token_id) for r in rollouts]),
                   torch.cat([pad(r, r.attention_mask, 0) for r in rollouts]),
                   torch.cat([pad(r, r.response_mask, 0, left=False) for r in rollouts]), P,
                   [t for r in rollouts for t in r.texts], torch.cat([r.truncated for r in rollouts]),
                   torch.cat([pad(r, r.sampler_logprobs, 0, left=False) for r in rollouts]))


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout restricted to `rows` (indices or a boolean mask over the B rows)."""
    rows = (rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows).to(rollout.input_ids.device)
    return Rollout(rollout.input_ids[rows], rollout.attention_mask[rows], rollout.response_mask[rows],
                   rollout.prompt_length, [rollout.texts[i] for i in rows.tolist()], rollout.truncated[rows],
                   rollout.sampler_logprobs[rows])


class Sampler(LogitsProcessor):
    """Sampling's only logits processor, in transformers' greedy loop: it draws each row's token from
    softmax(logits / T), keeps its log-prob under that distribution, and returns scores that are 0 at the
    drawn token and -inf elsewhere, which the greedy step then takes. So the recorded log-prob is that of
    the distribution the token was drawn from, whatever else transformers does around the processor."""

    def __init__(self, temperature: float):
        self.temperature, self.logprobs = temperature, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = (scores / self.temperature).log_softmax(-1)  # (B, V)
        tokens = torch.multinomial(logprobs.exp(), 1)  # (B, 1)
        self.logprobs.append(logprobs.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], group_size: int, max_new_tokens: int, temperature: float,
             greedy: bool = False, vllm: "VllmEngine | None" = None) -> Rollout:
    """Sample `group_size` completions for each prompt text (already formatted) with `model.generate`, or
    with `vllm`'s engine after pushing the model's weights to it.

    Sampling is plain softmax(logits / T), the distribution every loss here assumes (greedy: argmax),
    whatever the checkpoint's generation_config.json holds: the configuration is built here in full,
    taking only the EOS, pad and BOS ids from the checkpoint's, which is swapped out for the call (else
    transformers would merge its top_k, repetition_penalty, min_new_tokens, ... into sampling)."""
    if vllm is not None:
        return vllm.generate(model, tokenizer, prompts, group_size, max_new_tokens, temperature, greedy)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    prompt_ids = enc.input_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, dim=0)
    eos_ids = stop_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=model.generation_config.bos_token_id, do_sample=False)  # Sampler draws
    sampler = Sampler(temperature)
    # Under FSDP every forward is collective: a rank whose completions all ended keeps stepping with the
    # others (synced_gpus) instead of leaving them waiting for its shards.
    synced = dist.is_initialized() and isinstance(unwrap(model), FSDPModule)
    checkpoint_config, model.generation_config = model.generation_config, config
    try:
        cache = shared_prompt_cache(model, enc.input_ids, enc.attention_mask, group_size)
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                             logits_processor=None if greedy else [sampler], synced_gpus=synced, **{CACHE: cache})
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
    sampler_logprobs = (torch.zeros(response.shape, device=response.device) if greedy
                        else torch.stack(sampler.logprobs, 1)[:, : response.shape[1]])
    return Rollout(input_ids=torch.cat([prompt_ids, response], 1),
                   attention_mask=torch.cat([prompt_mask, response_mask], 1), response_mask=response_mask.float(),
                   prompt_length=P, texts=texts, truncated=~has_eos,
                   sampler_logprobs=sampler_logprobs.masked_fill(response_mask == 0, 0.0))


def stop_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the checkpoint's EOS ids (generation_config.json) and the tokenizer's."""
    eos_ids = unwrap(model).generation_config.eos_token_id
    return sorted(set([eos_ids] if isinstance(eos_ids, int) else eos_ids or []) | {tokenizer.eos_token_id} - {None})


class VllmEngine:
    """A vLLM engine on this rank's device, in this process, that samples for `generate` (--vllm): paged
    attention and continuous batching, for long completions on a GPU. Before each call it gets the policy's
    current weights (it starts with dummy ones), so it samples from the policy being trained
    (`policy/sampler_logprob_gap` says how close). Sampling is plain softmax(logits / T) as in `generate`
    (nothing from generation_config.json), with each token's log-prob under that distribution
    (processed_logprobs). Its random stream is its own (seeded per rank), not in checkpoints: a resumed
    run samples other completions than the run that stopped. On a GPU it sleeps between calls, freeing
    its memory for the update."""

    def __init__(self, model, name: str, dtype: str, seed: int, gpu_memory_utilization: float = 0.3):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: weights in memory
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import vllm
        except ImportError:
            raise UsageError("--vllm needs vLLM, in an environment of its own: pip install -r requirements-vllm.txt "
                             "(see the README)") from None
        self.vllm, self.gpu = vllm, torch.cuda.is_available()
        dtype = ("bfloat16" if self.gpu else "float32") if dtype == "auto" else dtype  # as load_model's
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            self.llm = vllm.LLM(
                name, dtype=dtype, seed=seed, load_format="dummy", skip_tokenizer_init=True, generation_config="vllm",
                logprobs_mode="processed_logprobs", max_model_len=model_positions(name), enforce_eager=not self.gpu,
                hf_overrides={"vocab_size": unwrap(model).get_input_embeddings().num_embeddings},  # a pad token added
                distributed_executor_backend="external_launcher" if dist.is_initialized() else None,
                enable_sleep_mode=self.gpu, **({"gpu_memory_utilization": gpu_memory_utilization} if self.gpu else {}))
        if self.gpu:
            self.llm.sleep(level=2)  # its weights are pushed before each call

    def push(self, model) -> None:
        """The model's weights into the engine, one tensor at a time (`plain_weights`: under FSDP each gathered
        in turn, never the whole model at once; LoRA merged), the LM head included where it is tied to the
        embeddings. Then the prefix cache is emptied: it holds keys and values of the old weights, which
        prompts longer than a block would reuse."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": plain_weights(model)})
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def generate(self, model, tokenizer, prompts: list[str], group_size: int, max_new_tokens: int,
                 temperature: float, greedy: bool = False) -> Rollout:
        if self.gpu:  # asleep (level 2: nothing kept): memory for the weights, the weights, then the rest
            self.llm.wake_up(tags=["weights"])
        self.push(model)
        if self.gpu:
            self.llm.wake_up()
        prompt_ids = tokenizer(prompts, add_special_tokens=False).input_ids
        eos_ids = stop_ids(model, tokenizer)
        params = self.vllm.SamplingParams(n=group_size, temperature=0.0 if greedy else temperature, logprobs=0,
                                          max_tokens=max_new_tokens, stop_token_ids=eos_ids, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        if self.gpu:
            self.llm.sleep(level=2)
        rows = [(ids, list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
                for ids, request in zip(prompt_ids, outputs) for out in request.outputs]
        P, L = max(len(ids) for ids, _, _ in rows), max(len(response) for _, response, _ in rows)
        input_ids = torch.full((len(rows), P + L), tokenizer.pad_token_id)
        attention_mask, sampler_logprobs = torch.zeros_like(input_ids), torch.zeros(len(rows), L)
        for i, (ids, response, logprobs) in enumerate(rows):
            input_ids[i, P - len(ids) : P + len(response)] = torch.tensor(ids + response)
            attention_mask[i, P - len(ids) : P + len(response)] = 1
            sampler_logprobs[i, : len(response)] = torch.tensor(logprobs) * (not greedy)
        truncated = torch.tensor([response[-1] not in eos_ids for _, response, _ in rows])
        texts = tokenizer.batch_decode([response[:len(response) - (not cut)] for (_, response, _), cut
                                        in zip(rows, truncated.tolist())], skip_special_tokens=True)
        device = current_device()
        return Rollout(input_ids.to(device), attention_mask.to(device), attention_mask[:, P:].float().to(device), P,
                       texts, truncated.to(device), sampler_logprobs.to(device))


def shared_prompt_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int):
    """The KV cache of each prompt's tokens but its last, computed once per prompt and repeated for its
    `group_size` rows, for `model.generate` to go on from. None where there is nothing to share or the
    cache is not plain keys and values: generate then runs every row's prompt."""
    if not on_every_rank(model, group_size > 1 and prompt_ids.shape[1] > 1, prompt_ids.device):
        return None
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True, logits_to_keep=1)
    cache = getattr(out, CACHE)
    if not plain_cache(cache, ids.shape[1]):
        return None
    cache.batch_repeat_interleave(group_size)
    return cache


def plain_cache(cache, length: int) -> bool:
    """Whether `cache` holds plain keys and values for `length` tokens, which can be indexed by row: not so
    for linear-attention or state-space layers, nor under gradient checkpointing (transformers drops it)."""
    return (isinstance(cache, DynamicCache) and cache.get_seq_length() == length
            and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions from the mask: with left padding, each row's real tokens start at 0 (padding gets 0 too)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `model`'s forward returns, recomputed from its last hidden states (N, H) -> (N, V), in at
    least fp32: the LM head, then what some architectures apply after it (Gemma's soft-capping, Cohere's
    logit_scale, Granite's logits_scaling). The temperature goes after these, as the sampler's does."""
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


def response_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                           **forward_kwargs) -> torch.Tensor:
    """The last hidden states that score the response tokens: (B, P+L) ids and mask -> (B, L, H), from
    columns P-1 .. P+L-2 (the state at column t predicts token t+1).

    Rows with the same prompt (a group's G completions) share its forward: each distinct prompt runs once
    with the KV cache, then every row's response runs against its prompt's cached keys and values.
    Attention is causal, so the values are those of one forward of the whole rows, and each weight's
    gradient is the same sum over the rows, for P + G L positions instead of G (P + L). The rows run whole
    when no prompt repeats (on some rank, for a DDP or FSDP model), under gradient checkpointing in train
    mode, and for a model whose cache is not plain keys and values."""
    P, hf_model = prompt_length, unwrap(model)
    prompts, row_prompt = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                       return_inverse=True)  # (N, 2P) distinct prompts; (B,) each row's
    checkpointed = torch.is_grad_enabled() and hf_model.training and (hf_model.is_activation_checkpointing if hasattr(
        hf_model, "is_activation_checkpointing") else hf_model.is_gradient_checkpointing)  # transformers < 5.20
    if on_every_rank(model, len(prompts) < len(input_ids) and not checkpointed, input_ids.device):
        prompt_ids, prompt_mask = prompts[:, :P], prompts[:, P:]
        first = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                      use_cache=True, output_hidden_states=True, **forward_kwargs)
        cache = getattr(first, CACHE)
        if plain_cache(cache, P):
            cache.batch_select_indices(row_prompt)  # each row's prompt keys and values; gradients add up over rows
            rest = model(input_ids=input_ids[:, P:], attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask)[:, P:], **{CACHE: cache}, use_cache=True,
                         output_hidden_states=True, **forward_kwargs)
            return torch.cat([first.hidden_states[-1][row_prompt, -1:], rest.hidden_states[-1][:, :-1]], 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=False, output_hidden_states=True, **forward_kwargs)
    return out.hidden_states[-1][:, P - 1 : -1]


def _token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, model, temperature: float, entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and, when `entropy`, the entropy for a chunk of positions: (N, H), (N,) -> (N,), (N,)."""
    logits = output_logits(model, hidden)  # (N, V), >= fp32
    if temperature != 1:  # T as sampled, after any soft-cap (dividing by 1 changes nothing, and costs a pass)
        logits = logits / temperature
    lse = logits.logsumexp(-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not entropy:
        return logprobs, None
    with torch.no_grad():  # H = lse - sum_v p_v logit_v, as a batched dot product: no (N, V) product tensor
        return logprobs, lse - torch.bmm(logits.softmax(-1)[:, None, :], logits[:, :, None]).view(-1)


def get_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, temperature: float,
                 chunk_size: int | None = None, entropy: bool = True, recompute_above: int = 2**27
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of the response tokens under `model` (DDP-wrapped or not), and their entropy:
    (B, P+L) ids and mask -> logprobs (B, L) in fp32, entropy (B, L) without gradient (None unless
    `entropy`); both 0 after EOS. With gradients and up to `recompute_above` logits (512 MB in fp32), the
    logits are computed in one product and kept for the backward pass. Otherwise the vocabulary projection
    runs in chunks of `chunk_size` positions (default: 2^25 logits), recomputed in the backward pass, so
    the full (B, L, V) log-softmax never exists at once."""
    hidden = response_hidden_states(model, input_ids, attention_mask, prompt_length, logits_to_keep=1)  # (B, L, H)
    B, L, H = hidden.shape
    hidden, targets = hidden.reshape(B * L, H), input_ids[:, prompt_length:].reshape(B * L)
    vocab_size = unwrap(model).get_output_embeddings().weight.shape[0]
    recompute = torch.is_grad_enabled() and B * L * vocab_size > recompute_above
    kept = torch.is_grad_enabled() and not recompute
    chunk_size = chunk_size or (max(1, B * L) if kept else max(1, 2**25 // vocab_size))  # positions per chunk
    logprobs, entropies = [], []
    for i in range(0, B * L, chunk_size):
        args = (hidden[i : i + chunk_size], targets[i : i + chunk_size], model, temperature, entropy)
        lp, ent = checkpoint(_token_logprobs, *args, use_reentrant=False) if recompute else _token_logprobs(*args)
        logprobs.append(lp)
        entropies.append(ent)
    real = attention_mask[:, prompt_length:]  # (B, L) 0 after EOS: those positions are set to 0, not garbage
    return torch.cat(logprobs).view(B, L) * real, torch.cat(entropies).view(B, L) * real if entropy else None


@torch.no_grad()
def rollout_logprobs(model, rollout: Rollout, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """Log-probs (B, L), no entropy, of a rollout's responses, `micro_batch_size` rows at a time ((0, L) if empty)."""
    ids, mask, n = rollout.input_ids, rollout.attention_mask, micro_batch_size
    return torch.cat([get_logprobs(model, ids[i : i + n], mask[i : i + n], rollout.prompt_length, temperature,
                                   entropy=False)[0] for i in range(0, len(ids), n)] or [rollout.response_mask.float()])


def sampler_logprob_gap(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, response_mask: torch.Tensor,
                        correction: str = "none", cap: float = 2.0) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs (B, L) of the sampled tokens are from the sampler's, over every rank's
    response tokens: `policy/sampler_logprob_gap` (mean |difference|) and `_max`. Both are ~1e-6 when the two
    compute the same distribution in fp32; a large value means the completions were not drawn from the
    distribution that the loss assumes. With a `correction`, what it did: the mean of its weights and the
    fraction of tokens truncated (tis: w > cap) or masked (mis: w outside [1/cap, cap])."""
    mask = response_mask.bool()
    difference = torch.where(mask, (sampler_logprobs - logprobs).abs(), 0.0).double()  # (B, L)
    sums = [difference.sum(), mask.sum().double()]
    weights = rollout_weights(logprobs, sampler_logprobs, correction, cap)
    if weights is not None:
        changed = weights < (logprobs - sampler_logprobs).exp() if correction == "tis" else weights == 0
        sums += [(weights * mask).sum().double(), (changed & mask).sum().double()]
    total = all_reduce(torch.stack(sums))
    mean = total / total[1].clamp(min=1)  # over the response tokens
    largest = all_reduce(difference.max() if difference.numel() else difference.new_zeros(()), "max")
    metrics = {"policy/sampler_logprob_gap": mean[0], "policy/sampler_logprob_gap_max": largest}
    if weights is not None:
        changed = "truncated" if correction == "tis" else "masked"
        metrics |= {"policy/correction_weight_mean": mean[2], f"policy/correction_{changed}_frac": mean[3]}
    return metrics


def rollout_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, correction: str, cap: float
                    ) -> torch.Tensor | None:
    """The rollout correction's per-token weights (B, L), without gradient; None for "none". A sampler other
    than the trainer (vLLM: bf16, its own kernels) draws from a distribution pi_s that is not the trainer's
    pi_old even at the same weights, so each token's term of the loss is weighted by w = pi_old / pi_s:
    "tis": min(w, cap), truncated importance sampling (Yao et al. 2025); "mis": 1 where 1/cap <= w <= cap,
    else 0, the token left out (masked importance sampling, IcePop). Positions after EOS (both 0) get 1."""
    if correction == "none":
        return None
    ratio = (old_logprobs - sampler_logprobs).clamp(-20, 20).exp().detach()  # (B, L) pi_old / pi_s
    if correction == "tis":
        return ratio.clamp(max=cap)
    return ((ratio >= 1 / cap) & (ratio <= cap)).to(ratio.dtype)


def reweighted(logprobs: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`logprobs` (B, L) with the same values and each token's gradient multiplied by its weight (None: as they
    are). Every loss here reaches the policy's weights through the log-probs only, so every term of a token's
    loss is weighted, whatever the loss, and the normaliser (tokens, sequences) stays as it is."""
    return logprobs if weights is None else weights * logprobs + (1 - weights) * logprobs.detach()


# ---------------------------------------------------------------------------------------------
# 7. Metrics and logging
# ---------------------------------------------------------------------------------------------


def mean_metrics(dicts: list[dict[str, float | torch.Tensor]]) -> dict[str, float | torch.Tensor]:
    """Average each key over the dicts that have it (e.g. per-micro-batch metrics of a step)."""
    keys = dict.fromkeys(key for d in dicts for key in d)
    return {key: sum(d[key] for d in dicts if key in d) / sum(key in d for d in dicts) for key in keys}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (0 when there are none), without gradient."""
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def step_metrics(rewards: torch.Tensor, components: dict[str, torch.Tensor], rollout: Rollout,
                 times: dict[str, float], step_start: float) -> dict[str, float | torch.Tensor]:
    """What a step sampled: reward/mean, /std and each component's mean, response/length_mean and
    /truncated_frac; and what it cost: perf/step_s, perf/<name>_s for each timed part, perf/tokens_per_s
    (this rank's response tokens times the ranks: averaged over ranks, the whole step's) and perf/peak_mem_gb."""
    lengths, step_s = rollout.response_mask.sum(-1), time.perf_counter() - step_start
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return {"reward/mean": rewards.mean(), "reward/std": rewards.std(),
            **{f"reward/{name}": value.mean() for name, value in components.items()},
            "response/length_mean": lengths.mean(), "response/truncated_frac": rollout.truncated.float().mean(),
            "perf/step_s": step_s, **{f"perf/{name}_s": seconds for name, seconds in times.items()},
            "perf/tokens_per_s": lengths.sum() * world_size / step_s,
            "perf/peak_mem_gb": peak_memory_gb(rollout.response_mask.device)}


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or this process's peak resident memory on CPU."""
    return (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) / 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident memory: /proc's VmHWM where there is one (Linux carries `ru_maxrss` over
    fork and exec, so a process started by a larger one would report the other's peak)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: rough


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str):
    """`with timed(times, "gen"): ...` adds the section's wall time to times["gen"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


class Logger:
    """Takes the run folder (`claim_run_dir`), then logs each step's metrics, averaged over ranks (call it on
    every rank): one line on stdout, every metric as JSON lines in `<run_dir>/metrics.jsonl` (NaN and inf
    as null, so every line is valid JSON), TensorBoard when installed, Weights & Biases with `--track`.
    Only rank 0 writes."""

    SHOWN = ("reward/mean", "eval/accuracy", "eval/accuracy_greedy", "loss/policy", "policy/clipfrac", "perf/step_s")

    def __init__(self, run_dir: Path, checkpoint: Path | None, config: dict, rank: int, track: bool = False,
                 num_steps: int | None = None):
        claim_run_dir(run_dir, checkpoint, rank)  # from here on this run writes there; a run holding it stops here
        self.enabled, self.num_steps, self.start, self.first_step = rank == 0, num_steps, time.perf_counter(), None
        self.wandb = self.tensorboard = None
        if not self.enabled:
            return
        if track:
            try:
                import wandb
            except ImportError:
                raise UsageError("--track needs wandb: pip install wandb") from None
            self.wandb = wandb.init(name=run_dir.name, config=config)
        replace_file(run_dir / "config.json", json.dumps(recorded(config), indent=2, default=str))
        self.file = open_to_append(run_dir / "metrics.jsonl")  # a resumed run appends (claim_run_dir cut it back)
        with contextlib.suppress(ImportError):
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir))

    def log(self, step: int, metrics: dict[str, float | torch.Tensor]) -> None:
        metrics = all_reduce_mean(metrics)
        if not self.enabled:
            return
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **finite}, allow_nan=False) + "\n")
        self.file.flush()
        shown = " | ".join(f"{k} {metrics[k]:.4g}" for k in self.SHOWN if k in metrics)
        progress = ""
        if self.num_steps is not None:  # from the mean time of the steps this process ran
            self.first_step = step if self.first_step is None else self.first_step
            elapsed, left = time.perf_counter() - self.start, self.num_steps - step - 1
            done = step + 1 - self.first_step
            eta = f", ETA {datetime.timedelta(seconds=round(elapsed / done * left))}" if left > 0 else ""
            progress = f"/{self.num_steps}"
            shown += f" | {datetime.timedelta(seconds=round(elapsed))} elapsed{eta}"
        print(f"step {step:>4}{progress} | {shown}", flush=True)
        for key, value in metrics.items() if self.tensorboard else ():
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


# ---------------------------------------------------------------------------------------------
# 8. Run folder
# ---------------------------------------------------------------------------------------------

CHECKPOINT_INFO = "checkpoint.json"  # in every checkpoint folder: the file, step, ranks and flags that wrote it
TRAINING_STATE = "training_state"  # the resumable state: torch.distributed.checkpoint's safetensors shards
RUN_LOCK = ".run.lock"  # in every run folder; held (fcntl) by the process that writes into the folder
NOT_COMPARED = ("resume", "run_name", "output_dir")  # flags that differ between a run and its resumption
_HELD_LOCKS: dict[str, int] = {}  # run folder -> open lock file: kept open for the life of the process


def prepare_run_dir(run_info: dict, rank: int) -> tuple[Path, Path | None]:
    """(the run's folder, the checkpoint to resume from or None), the same on every rank; nothing is written
    yet (`claim_run_dir` does, once the models are loaded). run_info: {"algorithm": the file's name,
    "config": asdict(args)}. A run writes to <output-dir>/<run-name>, with one exception: `--resume
    <run>/step_N` without --run-name goes on in <run> when step_N is its newest checkpoint. Any other
    resume starts a new run folder. A checkpoint of another file, model or number of ranks stops here."""
    return _decided_on_rank_0(_find_run_dir, rank, run_info)


def claim_run_dir(run_dir: Path, checkpoint: Path | None, rank: int) -> None:
    """Take run_dir for this process, before it writes anything there: a new folder is created with its lock
    held (an atomic rename), an existing one is locked (fcntl: released by the OS when the process ends,
    even killed), so a second run with the same name stops here. Its metrics.jsonl then holds what the run
    logged before the checkpoint's step (a new folder: the checkpoint's run's); a metrics file that held
    more is kept as metrics.jsonl.old."""
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
        if not (arg in replaced or arg.startswith(tuple(f"{flag}=" for flag in replaced))
                or (i > 0 and argv[i - 1] in replaced)):
            kept.append(arg)
    world_size, nodes = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("GROUP_WORLD_SIZE", 1))
    launcher = ["python"] if world_size == 1 else ["torchrun", f"--nproc_per_node={world_size}"]
    if nodes > 1:  # torchrun's agents, one per node
        launcher = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"]
    command = shlex.join([*launcher, sys.argv[0], *kept, "--output-dir", str(run_dir.parent), "--run-name",
                          run_dir.name, "--resume", "latest"])
    where = " (on every node, with its rendezvous flags)" if nodes > 1 else ""
    return f"Last checkpoint: {checkpoint}. Go on from it with: {command}{where}"


def _decided_on_rank_0(fn, rank: int, *args):
    """fn(*args) on rank 0, its result (or its usage error, raised) on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn(*args)
        except UsageError as stop:
            error = str(stop)
    if dist.is_initialized():
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error:
        raise UsageError(error)
    return result


def _find_run_dir(run_info: dict) -> tuple[Path, Path | None]:
    config = run_info["config"]
    resume, run_name, output = config["resume"], config["run_name"], Path(config["output_dir"])
    run_dir = output / (run_name or f"{Path(run_info['algorithm']).stem}__{config['seed']}__{int(time.time())}")
    checkpoint = None
    if resume == "latest":
        if run_name is None:
            raise UsageError("--resume latest continues the run named by --run-name: pass it.")
        checkpoint = latest_checkpoint(run_dir, strict=True)
        if checkpoint is None:
            again = ("Run it again without --resume: it starts over in that folder (what it logged is kept aside)."
                     if _is_run_dir(run_dir) and not _has_checkpoints(run_dir) else
                     "Pass the --run-name of the run to continue (its checkpoints are written every --save-every "
                     "steps), or a checkpoint folder.")
            raise UsageError(f"--resume latest: no checkpoint under {run_dir}. {again}")
    elif resume:
        checkpoint = Path(resume)
        if not _read_checkpoint_info(checkpoint).get("resumable"):
            raise UsageError(f"--resume {resume}: not a resumable checkpoint (no {CHECKPOINT_INFO} of a step "
                             f"checkpoint). Pass a <run>/step_N folder written by --save-every, or 'latest' with "
                             "--run-name.")
        if run_name is None and _continues(checkpoint.parent, checkpoint):
            run_dir = checkpoint.parent
    if checkpoint is not None:
        _check_same_run(checkpoint, run_info)
        _metrics_lines(checkpoint.parent)  # a damaged line stops here, before anything is loaded
    _refuse_links(run_dir)
    if not _continues(run_dir, checkpoint):
        _can_start_in(run_dir)
    return run_dir, checkpoint


def _continues(run_dir: Path, checkpoint: Path | None) -> bool:
    """Whether a resume from `checkpoint` goes on in run_dir: the newest checkpoint of that run folder."""
    newest = latest_checkpoint(run_dir) if checkpoint is not None and _is_run_dir(run_dir) else None
    return newest is not None and newest.resolve() == Path(checkpoint).resolve()


def _can_start_in(run_dir: Path) -> None:
    """Stop unless a new run may write into run_dir: a new or empty folder, or one of this project's runs
    (it holds the run lock) with no checkpoint and no final/ (a start that failed, or a run killed before
    its first checkpoint)."""
    if not os.path.lexists(run_dir):
        return
    if not run_dir.is_dir():
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} is a file, not a run folder. Choose another --run-name "
                         "or --output-dir.")
    names = sorted(p.name for p in run_dir.iterdir())
    if names and not _is_run_dir(run_dir):
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} holds files that are not a run's of this project "
                         f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}). Choose another --run-name or "
                         "--output-dir.")
    if _has_checkpoints(run_dir):
        go_on = "Continue it with --resume latest, or choose" if latest_checkpoint(run_dir) else "Choose"
        raise UsageError(f"--run-name {run_dir.name}: {run_dir} already holds a run. {go_on} another --run-name or "
                         "--output-dir.")


def _is_run_dir(path: Path) -> bool:
    return os.path.lexists(path / RUN_LOCK)


def _has_checkpoints(run_dir: Path) -> bool:
    return bool(_step_folders(run_dir)) or os.path.lexists(run_dir / "final")


def _refuse_links(run_dir: Path) -> None:
    """Stop when run_dir holds a symbolic link: a write through it would land wherever it points."""
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path.is_symlink():
            raise UsageError(f"{path} is a symbolic link: a run folder holds none (a write through it would land "
                             "elsewhere). Remove it, or choose another --run-name.")


def _claim_run_dir(run_dir: Path, checkpoint: Path | None) -> None:
    continues = _continues(run_dir, checkpoint)
    if not continues:
        _can_start_in(run_dir)  # before the lock is created in it: a folder of someone else's stays as it was
    _lock(run_dir)
    _refuse_links(run_dir)  # checked again under the lock: another run may have written since start-up
    if not continues:
        _can_start_in(run_dir)
    step = _read_checkpoint_info(checkpoint)["step"] if checkpoint else 0
    kept = "".join(line for n, line in _metrics_lines(checkpoint.parent) if n < step) if checkpoint else ""
    metrics = run_dir / "metrics.jsonl"
    if (metrics.read_bytes() if metrics.is_file() else b"") != kept.encode():  # a FIFO there would block a read
        try:
            aside = replace_file(metrics, kept, keep_old=True)
        except OSError as error:
            raise UsageError(f"{metrics}: cannot write the lines before step {step} ({error.strerror}: "
                             f"{error.filename}). Nothing was changed: free some space and run again.") from None
        if aside:
            print(f"{run_dir}: this run logs from step {step}; the metrics that were there are kept in {aside}",
                  flush=True)


def _lock(run_dir: Path) -> None:
    """Hold run_dir's lock for the rest of this process (released by the OS when it ends, even killed)."""
    key = str(run_dir.resolve())
    if key in _HELD_LOCKS:
        return
    try:  # another run may create or lock it at the same time: whichever locks first goes on
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            _refuse_links(run_dir)
        raise UsageError(f"--output-dir {run_dir.parent}: cannot create the run folder {run_dir}: "
                         f"{error.strerror or error}. Choose a writable --output-dir.") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if isinstance(error, (BlockingIOError, PermissionError)):
            raise UsageError(f"--run-name {run_dir.name}: {run_dir} is in use by another run that is still going (it "
                             "holds the folder's lock). Wait for it to end, or choose another --run-name.") from None
        raise UsageError(f"--output-dir {run_dir.parent}: cannot lock {run_dir / RUN_LOCK} ({error.strerror}), so two "
                         "runs could write into one folder. Use an --output-dir on a file system with locks.") from None
    _HELD_LOCKS[key] = fd


def open_to_append(path: Path):
    """A file of the run folder opened to append, never through a link: the path must be a plain file of its
    own (not a symbolic link, a FIFO or a device, nor a hard link that another name shares) or not exist yet."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        status = os.fstat(fd)
        if stat.S_ISREG(status.st_mode) and status.st_nlink == 1:
            return os.fdopen(fd, "a", encoding="utf-8")
        os.close(fd)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENXIO):  # a symbolic link; a FIFO that nothing reads
            raise
    raise UsageError(f"{path} is not a plain file of its own (a link, or a device): a run folder holds none. "
                     "Remove it, or choose another --run-name.")


def replace_file(path: Path, text: str, keep_old: bool = False) -> Path | None:
    """Write `text` to a new file beside `path` and rename it to `path`: what was there (even a link) is
    replaced, never written through, and a failed write (a full disk) leaves it as it was. With `keep_old`
    a non-empty file that was there is renamed to `<path>.old` first; returns where it went."""
    tmp, aside = path.with_name(f".{path.name}.tmp-{os.getpid()}"), None
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w",
                       encoding="utf-8") as file:
            file.write(text)
        if keep_old and path.is_file() and path.stat().st_size:
            aside = _move_aside(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return aside


def _move_aside(path: Path) -> Path:
    """Rename `path` to the first of `<path>.old`, `<path>.old.2`, ... that does not exist yet."""
    k, aside = 1, path.with_name(f"{path.name}.old")
    while os.path.lexists(aside):
        k, aside = k + 1, path.with_name(f"{path.name}.old.{k + 1}")
    path.rename(aside)
    return aside


def recorded(config: dict) -> dict:
    """The flags as config.json and checkpoint.json record them: a --model inside this repository (the default,
    tiny_model/) by its path relative to the repository, so that a copied or moved repository resumes its runs."""
    model = Path(config.get("model", "")).expanduser()
    if model.is_absolute() and model.resolve().is_relative_to(ROOT):
        return {**config, "model": str(model.resolve().relative_to(ROOT))}
    return config


def _read_checkpoint_info(path: Path, strict: bool = True) -> dict:
    """The checkpoint.json of a checkpoint folder ({} when there is none); a damaged one stops the run naming
    what is wrong with it, or without `strict` reads as {}."""
    path, fields = Path(path), {"algorithm": str, "step": int, "world_size": int, "resumable": bool, "config": dict}
    file = path / CHECKPOINT_INFO
    if not file.is_file():
        return {}
    try:
        info = json.loads(file.read_bytes().decode())
    except (OSError, ValueError, RecursionError):
        info = None
    if not isinstance(info, dict):
        problem = "not a JSON object"
    else:
        problem = next((f"{key!r} missing, or not a {kind.__name__}" for key, kind in fields.items()
                        if not isinstance(info.get(key), kind) or (kind is int and isinstance(info[key], bool))), None)
        if problem is None and not isinstance(info["config"].get("model"), str):
            problem = "its config has no 'model'"
        elif problem is None and re.fullmatch(r"step_\d+", path.name) and path.name != f"step_{info['step']}":
            problem = f"step {info['step']} in the folder {path.name}"
    if problem and strict:
        raise UsageError(f"{file} is damaged ({problem}). Resume from another checkpoint (--resume <run>/step_N), "
                         f"or move {path.name} out of the run folder.")
    return {} if problem else info


def latest_checkpoint(run_dir: Path, strict: bool = False) -> Path | None:
    """The resumable checkpoint of the highest step in run_dir (never a half-written `step_N.tmp`). A damaged
    checkpoint.json is passed over, or with `strict` (what --resume latest reads) stops the run naming it."""
    found = [p for p in _step_folders(run_dir) if _read_checkpoint_info(p, strict).get("resumable")]
    return found[-1] if found else None


def _step_folders(run_dir: Path) -> list[Path]:
    """run_dir's step_N folders (never step_N.tmp), by step."""
    found = [p for p in Path(run_dir).glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _metrics_lines(run_dir: Path) -> list[tuple[int, str]]:
    """(step, line) for each complete line of run_dir's metrics.jsonl (a last line cut short by a crash is left
    out), or a stop naming a line that this project does not write."""
    path, lines = run_dir / "metrics.jsonl", []
    for number, raw in enumerate(path.read_bytes().split(b"\n")[:-1] if path.is_file() else [], 1):
        try:
            record = json.loads(raw.decode())
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            record = None
        if isinstance(record, dict) and type(record.get("step")) is int and record["step"] >= 0:
            lines.append((record["step"], raw.decode() + "\n"))
            continue
        raise UsageError(f"{path}:{number}: not a line this project writes (a JSON object with an integer 'step'). "
                         f"Delete the line, or move {path.name} out of the folder (the checkpoints do not need it).")
    return lines


def _check_same_run(checkpoint: Path, run_info: dict) -> None:
    """Stop when the checkpoint was written by another algorithm file, model or number of ranks; print the
    other flags that changed (escaped: the values come from a file)."""
    saved, config = _read_checkpoint_info(checkpoint), recorded(run_info["config"])
    saved_config, shown = recorded(saved["config"]), lambda text: text if text.isprintable() else repr(text)
    if saved["algorithm"] != run_info["algorithm"]:
        raise UsageError(f"--resume {checkpoint}: written by {shown(saved['algorithm'])}, resumed by "
                         f"{run_info['algorithm']}. Resume it with {shown(saved['algorithm'])}, or start "
                         f"{run_info['algorithm']} from its weights with --model {checkpoint}.")
    if saved_config["model"] != config["model"]:
        trained = saved_config["model"]  # as recorded: one inside this repository relative to it
        trained = str(ROOT / trained) if (ROOT / trained).exists() else shown(trained)
        raise UsageError(f"--resume {checkpoint}: trained from --model {trained}, resumed with --model "
                         f"{run_info['config']['model']}. Resume with --model {trained}.")
    if saved["world_size"] != config["world_size"]:
        raise UsageError(f"--resume {checkpoint}: written by {saved['world_size']} rank(s), resumed on "
                         f"{config['world_size']}. Resume with --nproc_per_node={saved['world_size']} (each rank's "
                         f"sampling stream and algorithm state are its own), or start a new run from its weights "
                         f"with --model {checkpoint}.")
    changed = [f"--{key.replace('_', '-')} {saved_config[key]!r} -> {value!r}" for key, value in config.items()
               if key not in NOT_COMPARED and key in saved_config and saved_config[key] != value]
    if changed:
        print(f"--resume {checkpoint}: flags changed since the checkpoint: {', '.join(changed)}", flush=True)


# ---------------------------------------------------------------------------------------------
# 9. Checkpoints
# ---------------------------------------------------------------------------------------------


def save_checkpoint(path: Path, modules: dict[str, torch.nn.Module], tokenizer, rank: int, run_info: dict,
                    optimizer=None, step: int = 0, extra: dict | None = None, keep: int = 0) -> None:
    """Write a checkpoint folder; call on every rank. It holds:

    - the policy (modules["policy"]) and tokenizer in `save_pretrained` format, so it loads anywhere with
      `from_pretrained` (under FSDP the weights are gathered to rank 0's CPU memory for this);
    - checkpoint.json: the algorithm file, the step, the number of ranks and every flag (run_info);
    - with an optimizer, the resumable state: every module's weights and the optimizer state in
      training_state/, written by torch.distributed.checkpoint as safetensors (each rank writes only its
      own shards), and rank_<r>.safetensors with each rank's RNG states and algorithm state `extra`.

    Everything is written into `<path>.tmp`, fsync'd, and renamed to `path` when every rank has written its
    part, so a crash never leaves a partial folder under `path`. A failed write (disk full, permissions) or a
    Ctrl-C removes the .tmp folder; earlier checkpoints are untouched. A folder already at `path` is moved
    aside, never deleted. With `keep` > 0, only the newest `keep` step checkpoints are kept."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write_checkpoint(path, tmp, modules, tokenizer, rank, run_info, optimizer, step, extra)
    except KeyboardInterrupt:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0 and keep > 0:
        for old in [p for p in _step_folders(path.parent) if _read_checkpoint_info(p, strict=False)][:-keep]:
            try:
                shutil.rmtree(old)
            except OSError as error:  # rank 0 alone: a warning, never a stop that would leave the others waiting
                print(f"warning: --keep-checkpoints {keep}: could not remove {old} ({error.strerror})", flush=True)


def _write_checkpoint(path: Path, tmp: Path, modules: dict[str, torch.nn.Module], tokenizer, rank: int,
                      run_info: dict, optimizer, step: int, extra: dict | None) -> None:
    policy, distributed, error = modules["policy"], dist.is_initialized(), None
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
                state = _training_state(modules, optimizer)
                # A weight and its optimizer state in a file of their own: safetensors builds a whole file in
                # memory before writing it, so a save needs twice the largest weight's state, not the rank's.
                number = {name: i for i, name in enumerate(state["model"], 1)}  # each weight's file
                for name in state["optimizer"]:
                    number.setdefault(name, len(number) + 1)
                files = {f"model.{name}": number[name] for name in state["model"]}
                files |= {f"optimizer.{name}.{key}": number[name] for name, values in state["optimizer"].items()
                          for key in values}
                writer = HuggingFaceStorageWriter(str(tmp / TRAINING_STATE), files, save_distributed=distributed)
                dcp.save(state, storage_writer=writer, no_dist=not distributed)
            cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
            tensors, own = {}, {"rng": torch.get_rng_state(), "cuda_rng": cuda_rng, "python_rng": random.getstate(),
                                "extra": extra or {}}
            plain = json.dumps(_flatten(own, tensors, "own"))  # the tensors go into `tensors`, the rest stays
            (tmp / f"rank_{rank}.safetensors").write_bytes(safetensors_bytes(tensors, {"state": plain}))
    except (Exception, dcp.CheckpointException) as exc:  # reported with its path below, on every rank
        error = exc
    weights = None
    if isinstance(unwrap(policy), FSDPModule):  # collective: every rank takes part, rank 0 receives the weights
        weights = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0 and error is None:
        try:
            with transformers_quiet():
                hf_model = unwrap(policy)
                if is_lora(policy):  # the adapters, for PeftModel.from_pretrained; in final/ the merged model too
                    hf_model.save_pretrained(tmp / "adapter", state_dict=weights)
                if not is_lora(policy):
                    hf_model.save_pretrained(tmp, state_dict=weights)
                elif optimizer is None:
                    hf_model.get_base_model().save_pretrained(tmp, state_dict=dict(plain_weights(policy, weights)))
            tokenizer.save_pretrained(tmp)
            info = {"algorithm": run_info["algorithm"], "step": step, "resumable": optimizer is not None,
                    "world_size": dist.get_world_size() if distributed else 1, "config": recorded(run_info["config"])}
            (tmp / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2, default=str))
            for file in [*tmp.rglob("*"), tmp]:  # flushed to disk, so that the rename that publishes it is durable
                fd = os.open(file, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        except Exception as exc:
            error = exc
    del weights
    _stop_if_any_failed(error, path, tmp, rank)  # every rank has written its part
    if rank == 0:
        try:
            if path.exists():
                print(f"moved the earlier {path} aside to {_move_aside(path)}", flush=True)
            tmp.rename(path)
        except OSError as exc:
            error = exc
    _stop_if_any_failed(error, path, tmp, rank)


def _stop_if_any_failed(error: BaseException | None, path: Path, tmp: Path, rank: int) -> None:
    """Collective: when a rank's write failed, every rank stops with the path and each failed rank's cause,
    and rank 0 removes the .tmp folder. A Ctrl-C that the writer wrapped (DCP in a CheckpointException,
    a zip writer in the error it raises as it closes) is raised as the KeyboardInterrupt it is."""
    if error is not None and any(isinstance(e, KeyboardInterrupt) for e in _chain(error)):
        raise KeyboardInterrupt from error
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
    raise UsageError(f"could not write the checkpoint {path} ({where}). Removed {tmp.name}; {kept}.")


def _chain(error: BaseException):
    """The failure (inside a CheckpointException: DCP gathers each rank's), then its causes and contexts."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _write_error(error: BaseException) -> str:
    """The cause of a failed write in one line: the OS error and file when there is one, anywhere in the chain."""
    for seen in _chain(error):
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror}: {seen.filename}" if seen.filename else seen.strerror
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def _training_state(modules: dict[str, torch.nn.Module], optimizer) -> dict:
    """The resumable state as DCP writes it, tensors only: every module's trained weights (with LoRA the
    adapters: the frozen rest is --model's), each rank's own (FSDP: its shards, as DTensors), a weight tied
    to another (an LM head tied to the embeddings) once; and the optimizer's per-parameter state (its
    hyper-parameters are the flags')."""
    model = torch.nn.ModuleDict(modules)  # names the tensors "policy.<...>", "critic.<...>"

    def where(tensor: torch.Tensor) -> tuple | None:  # None for an empty shard
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) if local.numel() \
            else None

    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    weights, seen = {}, {where(p) for p in model.parameters() if not p.requires_grad} - {None}
    for name, tensor in get_model_state_dict(model).items():  # a tied or frozen weight under another name too
        if name not in frozen and (where(tensor) is None or where(tensor) not in seen):
            weights[name] = tensor
        seen.add(where(tensor))
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)["state"]}


def _flatten(value, tensors: dict, key: str):
    """`value` (numbers, text, tensors, Rollouts, in lists and dicts) as JSON, each tensor replaced by
    {"tensor": its key in `tensors`}; `_unflatten` reverses it."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().cpu().clone()
        return {"tensor": key}
    if isinstance(value, Rollout):
        return {"rollout": _flatten(dict(vars(value)), tensors, key)}
    if isinstance(value, dict):
        return {"dict": {k: _flatten(v, tensors, f"{key}.{k}") for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, tensors, f"{key}.{i}") for i, v in enumerate(value)]
    return value


def _unflatten(value, tensors: dict):
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "tensor":
        return tensors[inner]
    if kind == "rollout":
        return Rollout(**_unflatten(inner, tensors))
    return {k: _unflatten(v, tensors) for k, v in inner.items()}


def _read_header(file: Path, where: str) -> dict:
    """The metadata in a safetensors file's header, or a ValueError naming the file and what is wrong."""
    if file.is_symlink() or not file.is_file():
        raise ValueError(f"{where}/{file.name}: a link, or not a plain file")
    try:
        with safe_open(file, "pt") as opened:
            return opened.metadata() or {}
    except Exception as error:  # safetensors' own error type: a 0-byte, truncated or other file
        raise ValueError(f"{where}/{file.name}: not a complete safetensors file ({error})") from None


def load_checkpoint(path: Path | None, modules: dict[str, torch.nn.Module], optimizer, rank: int
                    ) -> tuple[int, dict]:
    """Restore what `save_checkpoint` wrote: every module's weights and the optimizer state in place (each
    rank reads only its own shards), and this rank's RNG state. Returns (the step to continue from, this
    rank's algorithm state); (0, {}) when `path` is None, a run that starts afresh. Nothing in the folder is
    unpickled. The number of ranks must be the one that saved: DCP could reshard the weights and optimizer
    state, but each rank's sampling stream and algorithm state (GVPO's replayed groups) have no
    counterpart on another count, and a resumed run is meant to be the run that stopped, bitwise. To go on
    with other hardware, start a new run with `--model <run>/step_N`."""
    if path is None:
        return 0, {}
    model, state, folder = torch.nn.ModuleDict(modules), _training_state(modules, optimizer), path / TRAINING_STATE
    device = current_device()
    try:
        if (folder / ".metadata").exists():
            raise ValueError("it was written in torch.distributed.checkpoint's pickled format, which these files no "
                             "longer read. Start a new run from its weights with --model <that checkpoint>.")
        for file in sorted(folder.iterdir()):  # also DCP's index, which is JSON: a link or not a file stops
            if file.suffix == ".safetensors" or file.is_symlink() or not file.is_file():
                _read_header(file, folder.name)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # strict: tied weights
        groups = get_optimizer_state_dict(model, optimizer)["param_groups"]  # the flags' learning rate, ...
        set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": groups})
        file = path / f"rank_{rank}.safetensors"
        plain = json.loads(_read_header(file, path.name).get("state", "null"))
        with safe_open(file, "pt") as opened:  # the algorithm's tensors back on the device, the RNG states on CPU
            tensors = {key: opened.get_tensor(key).to(device if key.startswith("own.extra.") else "cpu")
                       for key in opened.keys()}
        own = _unflatten(plain, tensors)
        if not isinstance(own, dict) or not {"rng", "cuda_rng", "python_rng", "extra"} <= own.keys():
            raise ValueError(f"{file.name}: not the RNG and algorithm state this project writes")
    except (Exception, dcp.CheckpointException) as error:  # a damaged file, a shape that does not fit, ...
        error = next(_chain(error))
        text = " ".join(str(error).split()) or type(error).__name__
        raise UsageError(f"--resume {path}: cannot restore it: {text if len(text) < 400 else text[:400] + ' ...'}"
                         ) from None
    torch.set_rng_state(own["rng"])
    version, internal, gauss = own["python_rng"]
    random.setstate((version, tuple(internal), gauss))  # unused by these files, kept for code you add
    if own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"])
    return _read_checkpoint_info(path)["step"], own["extra"]
