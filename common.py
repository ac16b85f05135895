"""The plumbing every algorithm file shares, to copy beside it with harness.py (the run folder and checkpoints). Nothing
here appears in an algorithm's equations: advantages, ratios, clipping, KL and loss aggregation live in each algorithm
file.

1. Flags: `cli`, `check_flags`, `require`, `need`, `UsageError` (bad input: one line naming the flag and the fix)
2. Distributed: `setup_distributed`, `cleanup_distributed`, `print0`, `all_reduce`, `no_sync`
3. Models: `load_tokenizer`, `load_model` (any causal LM, dropout off; fp32 weights for what trains, --dtype compute),
   `add_lora`, `load_reference`, `shard_model` (FSDP2, from rank 0's weights), `plain_weights` (one tensor at a time)
4. Data: `load_task` (built-in tasks, JSONL, `datasets`; text or chat prompts that fit), `format_prompt`, `prompt_batch`
5. Rewards and evaluation: `score` (correctness, exact or by math-verify; format; a user's function), `evaluate`
6. Generation and log-probs: `Rollout`, `generate` (or vllm_engine.py's engine), `run_episodes` (--env), `micro_batches`
   (by a token budget), `get_logprobs`, `sampler_logprob_gap`, `rollout_weights` and `reweighted` (rollout correction)
7. Metrics and logging: `Logger` (stdout, metrics.jsonl, TensorBoard, W&B), `add_metrics`, `step_metrics`
"""

import bisect
import contextlib
import copy
import dataclasses
import datetime
import functools
import gzip
import importlib
import importlib.util
import itertools
import json
import math
import numbers
import os
import random
import re
import resource
import sys
import time
import warnings
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state
import torch.nn.functional as F
import transformers
import tyro
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = str(HERE / "tiny_model")  # made by make_tiny_model.py
# The built-in tasks (builtin_splits): the default --model and --max-new-tokens of each
TASKS = {"add": (DEFAULT_MODEL, 8), "chain": (str(HERE / "tiny_model_chain"), 64),
         "guess": (str(HERE / "tiny_model_guess"), 192)}
GUESS = f"{HERE / 'examples' / 'guess.py'}:Guess"  # --task guess's environment, loaded as an --env is
# The KV cache's name in forward's arguments and outputs: `cache` from transformers 5.20 (vLLM's CPU build: older)
CACHE = "cache" if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__ else \
    "past_key_values"


# 1. Flags -------------------------------------------------------------------------------------------------------
class UsageError(ValueError):
    """Bad input (a flag, a file, a dataset row), named with the fix: `__main__` prints one line, exits with 2."""


# (flag, valid, what it must be (why)): the flags every algorithm file shares, checked by `check_flags`.
FLAG_RULES = [
    ("num_steps", lambda v: v >= 1, ">= 1 (0 would save the untrained model as final/)"),
    ("prompts_per_step", lambda v: v >= 1, ">= 1"), ("group_size", lambda v: v >= 1, ">= 1"),
    ("max_new_tokens", lambda v: v >= 1, ">= 1 (each completion has at least its EOS token)"),
    ("max_turns", lambda v: v >= 1, ">= 1 (1: single-turn)"), ("learning_rate", lambda v: v > 0, "> 0"),
    ("seed", lambda v: 0 <= v < 2**63, "in [0, 2**63) (torch's seeds are 64-bit; each rank adds its rank)"),
    ("temperature", lambda v: v >= 0.01, ">= 0.01 (the log-probs divide the logits by it, and below 0.01 float32 "
     "loses the precision a ratio needs; eval/accuracy_greedy reports greedy decoding)"),
    ("dist_timeout", lambda v: v > 0, "> 0 (minutes)"), ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("updates_per_rollout", lambda v: v >= 1, ">= 1"), ("num_minibatches", lambda v: v >= 1, ">= 1"),
    ("micro_batch_size", lambda v: v is None or v >= 1, ">= 1 (or left out: the whole minibatch)"),
    ("max_tokens_per_micro_batch", lambda v: v is None or v >= 1, ">= 1 (or left out: no limit)"),
    ("max_grad_norm", lambda v: v > 0, "> 0 (inf: no clipping)"), ("eval_size", lambda v: v >= 0, ">= 0"),
    ("eval_every", lambda v: v >= 0, ">= 0 (0: never evaluate)"),
    ("save_every", lambda v: v >= 0, ">= 0 (0: only the final weights)"),
    ("keep_checkpoints", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("max_prompt_length", lambda v: v is None or v >= 1, ">= 1 (or left out: as long as the model allows)"),
    ("correction_cap", lambda v: v >= 1, ">= 1 (pi_old / pi_sampler is 1 where the two agree)"),
    ("lora_rank", lambda v: v >= 0, ">= 0 (0: full fine-tuning)"),
    ("lora_alpha", lambda v: v > 0, "> 0 (the adapters' scale is alpha / rank)"),
    ("vllm_gpu_memory", lambda v: 0 < v <= 1, "in (0, 1] (a fraction of the GPU's memory)"),
]


def cli(args_class, args: list[str] | None = None):
    """tyro.cli of an Args of flag groups (its bases): by group in --help (nested), flat after parsing (args.seed)."""
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
    """The shared flags, before anything is loaded or written, and the per-rank batch sizes (args.world_size, ...)."""
    if args.task is not None and args.dataset is not None:
        raise UsageError(f"--task {args.task} is a built-in dataset: pass --task or --dataset, not both.")
    model, max_new_tokens = TASKS[args.task or "add"]  # the defaults that follow the task
    args.model = model if args.model is None else args.model
    args.max_new_tokens = max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    args.max_turns = (7 if args.task == "guess" else 1) if args.max_turns is None else args.max_turns
    args.env = args.env or (GUESS if args.task == "guess" else None)  # the game's environment, as an --env
    for name, valid, must in FLAG_RULES:
        require(valid(value := getattr(args, name)), f"--{name.replace('_', '-')}", value, must)
    if args.max_turns > 1 and args.env is None:
        raise UsageError(f"--max-turns {args.max_turns}: turns after the first answer an environment's observation. "
                         "Pass --env file.py:Class (docs/environments.md), or --task guess.")
    if args.eval_every and args.eval_size == 0 and args.eval_dataset is None and args.eval_split is None:
        raise UsageError(f"--eval-size 0 leaves nothing to evaluate every --eval-every {args.eval_every} steps: pass "
                         "--eval-every 0, a positive --eval-size, or --eval-dataset.")
    if args.run_name is not None and (args.run_name in ("", ".", "..") or "/" in args.run_name):
        raise UsageError(f"--run-name {args.run_name!r}: must be a folder name under --output-dir, without '/' "
                         "(pass --output-dir for another place).")
    if args.rollout_correction == "auto":  # another engine's numerics differ from the trainer's
        args.rollout_correction = "tis" if args.vllm else "none"
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))  # as setup_distributed reads it
    if args.fsdp and args.world_size < 2:
        raise UsageError("--fsdp shards the model over ranks: launch with torchrun --nproc_per_node=2 or more.")
    args.local_prompts_per_step = exact_div(
        args.prompts_per_step, args.world_size, "--prompts-per-step must be divisible by the number of ranks")
    args.local_batch_size = args.local_prompts_per_step * args.group_size
    args.minibatch_size = exact_div(args.local_batch_size, args.num_minibatches, "--num-minibatches must divide the "
                                    "sequences per rank (--prompts-per-step / ranks * --group-size)")
    args.micro_batch_size = args.micro_batch_size or args.minibatch_size
    exact_div(args.minibatch_size, args.micro_batch_size,
              "--micro-batch-size must divide the sequences per rank and minibatch")


def exact_div(numerator: int, denominator: int, message: str) -> int:
    """`numerator // denominator`, failing at start-up with `message` when it does not divide."""
    if denominator <= 0 or numerator % denominator != 0:
        raise UsageError(f"{message} (got {numerator} and {denominator})")
    return numerator // denominator


def need(package: str, flag: str):
    """`import package`, optional but for the feature of `flag`: else a stop with the command that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise UsageError(f"{flag} needs {package}: pip install {package}") from None


# 2. Distributed -------------------------------------------------------------------------------------------------
def setup_distributed(timeout_minutes: float = 60) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment (`python x.py`: rank 0 of 1); collectives time out."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # current_device() from here on
    if world_size > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=current_device() if cuda else None,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if rank > 0:  # transformers' progress bars (loading, saving): rank 0's alone, as for every other line
        transformers.utils.logging.disable_progress_bar()
    return rank, world_size, current_device()


def cleanup_distributed() -> None:
    """The last call of a distributed run: every rank waits, then the group goes; on CPU the process ends at once
    (gloo's threads, held by DTensor's caches after FSDP, would abort interpreter teardown with -6)."""
    if dist.is_initialized():
        on_cpu = dist.get_backend() == "gloo"
        dist.barrier()
        dist.destroy_process_group()
        if on_cpu:
            sys.stdout.flush(), sys.stderr.flush()
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


def all_reduce_mean(metrics: dict[str, float | torch.Tensor | tuple]) -> dict[str, float]:
    """Scalar metrics over ranks, in one all-reduce: a (sum, count) pair as its sums over its counts, a value's mean."""
    pairs = torch.stack([torch.stack([torch.as_tensor(x, dtype=torch.float64, device=current_device()).detach()
                                      for x in (v if isinstance(v, tuple) else (v, 1))]) for v in metrics.values()])
    sums, counts = all_reduce(pairs).unbind(-1)
    return dict(zip(metrics, torch.where(counts > 0, sums / counts, 0).tolist()))


def add_metrics(totals: dict[str, tuple], metrics: dict[str, float | torch.Tensor | tuple]) -> None:
    """`metrics` (a micro-batch's) added into `totals`: (sum, count) pairs, a plain value counted once. Logged as sum /
    count over the step and ranks, a mean weighted by what it averages: the same however the rows are cut."""
    totals.update({key: tuple(a + b for a, b in zip(totals.get(key, (0, 0)), v if isinstance(v, tuple) else (v, 1)))
                   for key, v in metrics.items()})


def no_sync(models, last: bool) -> contextlib.ExitStack:
    """Inside, backward() accumulates DDP modules' gradients without all-reduce, except on the `last` micro-batch."""
    stack = contextlib.ExitStack()
    for model in [] if last else [m for m in models if isinstance(m, DistributedDataParallel)]:
        stack.enter_context(model.no_sync())
    return stack


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (collective: every rank calls it), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return getattr(model, "module", model)


def on_every_rank(model, flag: bool, device: torch.device) -> bool:
    """`flag` where every rank has it, when the forward is collective (DDP broadcasts buffers, FSDP gathers weights)."""
    collective = isinstance(model, DistributedDataParallel) or isinstance(unwrap(model), FSDPModule)
    return bool(all_reduce(torch.tensor(int(flag), device=device), "min")) if dist.is_initialized() and collective \
        else flag


# 3. Models ------------------------------------------------------------------------------------------------------
def load_tokenizer(name: str, flag: str = "--model"):
    """The tokenizer of a model name or folder (a mistyped --model stops here), padding on the left. Its vocabulary
    never changes: it pads with EOS where it has no pad token (masks, not ids, say where text ends). No code runs."""
    if (Path(name) / "adapter").is_dir() and not (Path(name) / "config.json").exists():
        raise UsageError(f"{flag} {name}: a step checkpoint of a LoRA run holds its adapters (adapter/), not a "
                         "model. Go on with --resume, or start from the run's final/ (the merged model).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag} {name!r}: cannot load it ({str(e).strip().splitlines()[0]}). Pass a local folder "
                         "or a Hugging Face model name reachable from this machine.") from None
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype as a torch dtype: auto is bfloat16 on a GPU, float32 on the CPU."""
    return getattr(torch, ("bfloat16" if device.type == "cuda" else "float32") if dtype == "auto" else dtype)


def load_model(name: str, dtype: str, device: torch.device, tokenizer, auto_class=AutoModelForCausalLM,
               gradient_checkpointing: bool = False, trained: bool = True, sharded: bool = False,
               lm_head_fp32: bool = False):
    """Any causal LM (or its backbone: AutoModel) computing in `dtype` (auto: bf16 on GPU, fp32 on CPU), dropout off
    (log-probs must be a function of the weights, also in train mode); ready for gradient checkpointing. What the
    optimizer will train (`trained`) is held in fp32 whatever `dtype`: Adam's step is about the learning rate, 1e-6,
    and bf16 values near 0.02 are 1.2e-4 apart, so bf16 weights round such updates away; frozen weights (the
    reference, a LoRA base) are held in `dtype`. `sharded` (--fsdp): rank 0 reads the weights into host memory, the
    other ranks build the model on the meta device, and `shard_model` gives each GPU its shards of rank 0's."""
    compute = compute_dtype(dtype, device)
    config = AutoConfig.from_pretrained(name, trust_remote_code=False)
    for sub in [config, *(v for v in vars(config).values() if isinstance(v, transformers.PretrainedConfig))]:
        for key in [k for k, v in vars(sub).items() if "drop" in k and isinstance(v, float)]:
            setattr(sub, key, 0.0)  # attention_dropout, resid_pdrop, layerdrop, ...
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = ("meta" if rank > 0 else "cpu") if sharded else device  # sharded: only rank 0 reads the weights
    model = auto_class.from_pretrained(name, config=config, dtype=torch.float32 if trained else compute,
                                       device_map=where, trust_remote_code=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    for dropout in [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]:
        dropout.p = 0.0  # also the modules built with a rate of their own, not the config's
    head = model.get_output_embeddings()
    model.compute_dtype = compute  # (read by sample_hf, and by peft's wrapper through its attributes)
    if compute != torch.float32:  # fp32 (or frozen) weights, the matmuls in `dtype`: as accelerate's mixed precision
        model.forward = autocast(model.forward, device, compute)
        if head is not None:  # also where get_logprobs calls it, after the forward
            head.forward = fp32_linear(head) if lm_head_fp32 else autocast(head.forward, device, compute)
    if head is not None and not sharded:  # (sharded: `shard_model` checks it, once the weights are in)
        check_output_logits(model)
    if gradient_checkpointing:  # transformers recomputes in train mode only; dropout is off: nothing else changes
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)({"use_reentrant": False})
        model.train()
    return model


def autocast(forward, device: torch.device, dtype: torch.dtype):
    """`forward` under torch.autocast(dtype): weights as held (fp32 for what trains), each matmul's inputs cast to
    `dtype` and its output in `dtype`; what autocast keeps in fp32 (softmax, norms' statistics) stays so."""
    @functools.wraps(forward)  # (its signature too: generate reads which arguments forward takes)
    def forward_in_dtype(*args, **kwargs):
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)
    return forward_in_dtype


def fp32_linear(head: torch.nn.Linear):
    """The LM head's forward as an fp32 matmul (--lm-head-fp32): its logits are not rounded to bf16 before the
    log-softmax (a logit of 10 to within 0.03), for the log-probs and for sampling alike; a bf16 weight (a frozen
    model's, or FSDP's gathered copy) is upcast at each call."""
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            return F.linear(hidden.float(), head.weight.float(), bias)
    return forward


@torch.no_grad()
def check_output_logits(model) -> None:
    """Stop unless `output_logits` (get_logprobs' head) gives the model's logits (1e-4 of the largest; bf16's: 2e-2)."""
    ids = torch.arange(8, device=model.device)[None] % model.config.get_text_config().vocab_size
    out, hidden = forward_last_hidden(model, input_ids=ids, use_cache=False)
    theirs, ours = out.logits.float(), output_logits(model, hidden).float()
    difference = (ours - theirs).abs().max()
    if not difference <= (1e-4 if out.logits.dtype == torch.float32 else 2e-2) * theirs.abs().max().clamp(min=1):
        raise UsageError(f"--model {model.config.name_or_path!r}: its forward changes the LM head's logits, unlike "
                         f"get_logprobs (largest difference {difference.item():.3g}). Supported: a plain LM head, "
                         "final_logit_softcapping, logit_scale, logits_scaling; add its transform to "
                         "common.output_logits.")


def shard_model(model: torch.nn.Module, device: torch.device, dtype: str = "auto") -> torch.nn.Module:
    """FSDP2 in place: each decoder layer (`_no_split_modules`), then the rest; the shards as held (fp32 for what
    trains), gathered in `dtype` for the compute (bf16 on GPU: half the bytes of fp32 shards), gradients reduced in
    fp32. Each GPU gets only its shards: rank 0's weights (from host memory, `load_model(sharded=True)`) are sent one
    tensor at a time into every rank's shards, the other ranks' meta tensors given memory first."""
    compute = compute_dtype(dtype, device)
    mp = MixedPrecisionPolicy(param_dtype=None if compute == torch.float32 else compute, reduce_dtype=torch.float32)
    full = model.state_dict() if dist.get_rank() == 0 else {}  # rank 0's weights, where they were loaded
    layer_classes = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    for module in [m for m in model.modules() if type(m).__name__ in layer_classes]:
        fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if dist.get_rank() > 0:
        model.to_empty(device=device)  # memory for its shards and buffers, filled in below
    options = dcp_state.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dcp_state.set_model_state_dict(model, full, options=options)
    for buffer in model.buffers():  # what the state dict leaves out (rotary frequencies)
        dist.broadcast(buffer, src=0)
    if getattr(model, "get_output_embeddings", lambda: None)() is not None:  # (not ppo's critic)
        check_output_logits(model)
        model.reshard()  # the root's shards registered again (a forward leaves them gathered), for the optimizer
    return model


def add_lora(model, rank: int, alpha: float, targets: str):
    """`model` with LoRA adapters (peft) of `rank` on `targets`, the only weights trained (rank 0: `model` as it is)."""
    if not rank:
        return model
    peft = need("peft", "--lora-rank")
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


def load_reference(args, policy, tokenizer, device: torch.device):
    """The frozen reference: with LoRA the policy with its adapters off (no second copy; a function, not a Module:
    `.eval()` never reaches the policy through it); else --model loaded with its seed, sharded like the policy."""
    if is_lora(policy):
        def adapters_off(*args, **kwargs):
            with adapters_off.module.disable_adapter():
                return adapters_off.module(*args, **kwargs)
        adapters_off.module = unwrap(policy)  # what `unwrap` returns
        return adapters_off
    torch.manual_seed(args.seed)
    reference = load_model(args.model, args.dtype, device, tokenizer, trained=False, sharded=args.fsdp,
                           lm_head_fp32=args.lm_head_fp32).eval().requires_grad_(False)
    return shard_model(reference, device, args.dtype) if args.fsdp else reference


def plain_weights(model, dtype: torch.dtype | None = None, device: torch.device | str | None = None):
    """(name, tensor) of the weights as transformers names them, one at a time, in `dtype` on `device` (left out: as
    held); under FSDP each gathered whole in turn (collective: every rank iterates), LoRA's merged (W + scale B A)."""
    peft_model = unwrap(model)
    state = peft_model.state_dict()
    for key in [key for key in state if ".lora_" not in key]:  # the adapters go into their base weights
        value, layer = whole(state[key]), key.rsplit(".base_layer.", 1)[0]
        if key.endswith(".base_layer.weight") and f"{layer}.lora_A.default.weight" in state:
            a, b = (whole(state[f"{layer}.lora_{x}.default.weight"]) for x in "AB")
            value = value + peft_model.get_submodule(layer).scaling["default"] * b @ a
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        yield name, value.to(device=device or value.device, dtype=dtype or value.dtype)


def checkpoint_dtype(name: str) -> torch.dtype:
    """The dtype `name`'s checkpoint holds its weights in (its config's; fp32 where it names none): final/'s."""
    dtype = AutoConfig.from_pretrained(name, trust_remote_code=False).dtype
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


def model_positions(name: str) -> int | None:
    """How many positions (prompt and completion together) the model takes, from its config (None: no limit)."""
    config = AutoConfig.from_pretrained(name, trust_remote_code=False).get_text_config()
    keys = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    return next((getattr(config, key) for key in keys if isinstance(getattr(config, key, None), int)), None)


# 4. Data --------------------------------------------------------------------------------------------------------
def builtin_splits(task: str = "add", eval_size: int = 500) -> tuple[list[dict], list[dict]]:
    """(train, held-out) of a built-in task (seeded; the first `eval_size` held out): add, all 10,000 `a+b`; chain,
    20,000 sums of 2-6 numbers, '####', `demo` worked (`12+7=19 19+30=49 #### 49`); guess, 10,000 secrets (`GUESS`)."""
    rng = random.Random(1234)
    if task == "guess":
        examples = [{"prompt": "guess a number from 0 to 99", "answer": str(rng.randrange(100))} for _ in range(10_000)]
    elif task == "add":  # the i-th sum: a = i // 100, b = i % 100
        order = torch.randperm(10_000, generator=torch.Generator().manual_seed(1234)).tolist()
        examples = [{"prompt": f"{i // 100}+{i % 100}", "answer": str(i // 100 + i % 100)} for i in order]
    else:
        chains = {}
        while len(chains) < 20_000:
            numbers = [rng.randrange(100) for _ in range(rng.randint(2, 6))]
            steps = [f"{sum(numbers[:i])}+{numbers[i]}={sum(numbers[:i + 1])}" for i in range(1, len(numbers))]
            chains.setdefault("+".join(map(str, numbers)), {"prompt": "+".join(map(str, numbers)), "answer": str(
                sum(numbers)), "demo": " ".join(steps) + f" #### {sum(numbers)}"})
        examples = list(chains.values())
    return examples[eval_size:], examples[:eval_size]


def load_rows(source: str, flag: str = "--dataset", config: str | None = None, split: str | None = "train",
              prompt_field: str = "prompt", answer_field: str = "answer", no_chat: str = "") -> list[dict]:
    """Rows of a JSONL file or of what `datasets` reads (Hub, JSON/Parquet/CSV, folders) at `config` and `split` (None:
    'test' or its only one), fields by name or dotted path: "answer" as text, "prompt" as text or a list of chat
    messages (refused with `no_chat`: why no template renders them); a missing, null or wholly empty one stops."""
    jsonl = is_jsonl(source, config)
    records = _jsonl_records(source, flag) if jsonl else _dataset_records(source, flag, config, split)
    rows = []
    for where, record in records:
        values = []  # the prompt's, then the answer's
        for path, field_flag, kinds in ((prompt_field, "--prompt-field", (str, int, float, list)),
                                        (answer_field, "--answer-field", (str, int, float))):
            value, keys = record, [path] if isinstance(record, dict) and path in record else path.split(".")
            for i, key in enumerate(keys):
                if not isinstance(value, dict) or key not in value:
                    raise UsageError(f"{where}: missing field {path} ({'.'.join(keys[:i]) or 'the row'} has "
                                     f"{', '.join(value) if isinstance(value, dict) else 'no fields'}). Name the "
                                     f"field with {field_flag}.")
                value = value[key]
            if not isinstance(value, kinds) or isinstance(value, bool):
                kind = "null" if value is None else f"a {type(value).__name__}"
                raise UsageError(f"{where}: field {path} is {kind}; every row needs a {path}: text or a number"
                                 f"{' or chat messages' if list in kinds else ''}.")
            values.append(value)
        prompt, answer = values
        if isinstance(prompt, list):  # chat messages (TRL's and verl's prompts), rendered by the chat template
            bad = next((f"message {i} must be {{'role': text, 'content': text}}, got {m!r:.200}. Fix the row, or name "
                        "another field with --prompt-field" for i, m in enumerate(prompt, 1) if not is_message(m)),
                       no_chat and f"chat messages, which need a chat template; {no_chat}, or give them as text")
            bad = bad or (not prompt and "no messages (an empty list). Fix the row, or name another field with "
                          "--prompt-field")
            if bad:
                raise UsageError(f"{where}: field {prompt_field}: {bad}.")
        rows.append({**record, "prompt": prompt if isinstance(prompt, list) else str(prompt), "answer": str(answer)})
    if not rows:
        raise UsageError(f"{flag} {source!r}: the dataset has no examples.")
    for what, key, option in (("prompt", prompt_field, "--prompt-field"), ("answer", answer_field, "--answer-field")):
        if not any(str(row[what]).strip() for row in rows):
            raise UsageError(f"{flag} {source!r}: every {key} is empty. Name the field that holds the {what}s with "
                             f"{option}.")
    return rows


def is_jsonl(source: str, config: str | None = None) -> bool:
    """Whether `source` is read as a JSONL file (also gzip'd, as many datasets ship): one row a line, no splits."""
    return source.endswith((".jsonl", ".jsonl.gz")) and config is None


def is_message(m) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(key), str) for key in ("role", "content"))


def _jsonl_records(source: str, flag: str):
    """(file:line, object) for each non-empty line of a JSONL file."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise UsageError(f"{flag} {str(path)!r}: no such file. Pass a JSONL file with one "
                         '{"prompt": ..., "answer": ...} object a line, or leave it out for the built-in task.')
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                if raw.strip():
                    yield f"{path}:{line_no}", json.loads(raw.decode("utf-8-sig" if line_no == 1 else "utf-8"))
            except UnicodeDecodeError as e:
                raise UsageError(f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start}). Save it as UTF-8.") \
                    from None
            except ValueError as e:
                raise UsageError(f"{path}:{line_no}: not valid JSON ({e}). Each line must be one object.") from None


def _dataset_records(source: str, flag: str, config: str | None, split: str | None):
    """('<source> [split] row i', row) for each row of what `datasets` reads from `source`."""
    datasets, path = need("datasets", f"{flag} {source!r} (not JSONL)"), Path(source).expanduser()
    try:
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            data = datasets.load_from_disk(str(path))  # written by save_to_disk
        elif path.is_file():  # the builder by the file's suffix: json, parquet, csv (compressed: by the one before)
            kind = re.sub(r"\.(gz|bz2|xz|zst)$", "", path.name).rsplit(".", 1)[-1]
            data = datasets.load_dataset(kind.replace("jsonl", "json"), data_files=str(path))
        else:
            data = datasets.load_dataset(source, config)
    except Exception as e:  # also a folder with a loading script, which datasets refuses to run
        raise UsageError(f"{flag} {source!r}: cannot load it ({type(e).__name__}: {str(e).strip().splitlines()[0]}). "
                         "Pass a JSONL, JSON, Parquet or CSV file, a dataset folder, or a Hugging Face dataset name "
                         "reachable from this machine.") from None
    if isinstance(data, datasets.DatasetDict):
        split = split or ("test" if "test" in data or len(data) != 1 else next(iter(data)))
        if split not in data:
            raise UsageError(f"{flag} {source!r}: no split {split!r}; it has {list(data)}. Choose one with "
                             f"{'--split' if flag == '--dataset' else '--eval-split'}.")
        data = data[split]
    for i, row in enumerate(data):
        yield f"{source} [{split or 'train'}] row {i}", row


def load_data(dataset: str | None, eval_dataset: str | None, eval_size: int, dataset_config: str | None = None,
              split: str = "train", eval_split: str | None = None, task: str = "add", **fields) -> tuple[list, list]:
    """(train, eval): the built-in `task`, or --dataset and --eval-dataset, its --eval-split, or its last rows."""
    if dataset is None:
        train, held_out = builtin_splits(task, eval_size)
        if not train:
            raise UsageError(f"--eval-size {eval_size}: the built-in task has {len(held_out)} prompts, so none "
                             "would be left to train on. Hold out fewer (the default is 500).")
        return train, held_out
    if split != "train" and is_jsonl(dataset, dataset_config):
        raise UsageError(f"--split {split}: {dataset!r} is a JSONL file, which has no splits. Leave --split out, or "
                         "pass a dataset that has them.")
    if eval_split is not None and is_jsonl(eval_dataset or dataset, None if eval_dataset else dataset_config):
        why = ": the held-out rows would be the training rows. Pass --eval-dataset with a file of held-out rows, or " \
            "leave --eval-split out to hold out the last --eval-size rows."
        why = ". Leave --eval-split out." if eval_dataset else why
        raise UsageError(f"--eval-split {eval_split}: {eval_dataset or dataset!r} is a JSONL file, which has no "
                         f"splits{why}")
    train = load_rows(dataset, "--dataset", dataset_config, split, **fields)
    if eval_dataset is not None or eval_split is not None:
        held_out = load_rows(eval_dataset or dataset, "--eval-dataset" if eval_dataset else "--dataset",
                             None if eval_dataset else dataset_config, eval_split, **fields)
        if held_out == train:  # the same file, or the split trained on, given again: accuracy on the training rows
            named = f"--eval-dataset {eval_dataset!r}" if eval_dataset else \
                f"--eval-split {eval_split}: the split {eval_split!r} of {dataset!r} is the one trained on"
            raise UsageError(f"{named}: the held-out rows would be the training rows. Pass --eval-dataset with other "
                             "rows, another --eval-split, or neither (the last --eval-size rows are held out).")
        return train, held_out
    if len(train) <= eval_size:
        raise UsageError(f"--dataset {dataset!r} has {len(train)} rows, too few to hold out --eval-size {eval_size}. "
                         "Pass --eval-dataset or --eval-split, or a smaller --eval-size.")
    return train[:len(train) - eval_size], train[len(train) - eval_size:]  # eval_size 0: all rows train


def load_task(args) -> tuple:
    """(tokenizer, train, held_out, exact, reward_fn, env) before any model loads: the examples that fit the model
    (`fit_prompts`); `exact`: answers compared as text (built-in tasks); --reward-fn, tried; --env (`MultiTurn`)."""
    tokenizer, system = load_tokenizer(args.model), {"role": "system", "content": args.system_prompt}
    no_chat = "--no-chat-template turns it off. Leave --no-chat-template out" if not args.chat_template else "" if \
        tokenizer.chat_template else f"--model {args.model} has none. Pass a --model that has one"
    if args.system_prompt is not None and no_chat:
        raise UsageError(f"--system-prompt {args.system_prompt!r}: a system message needs the chat template; "
                         f"{no_chat}, or leave --system-prompt out.")
    if args.system_prompt is not None:  # a template may refuse a system role (Gemma 2's): one line, not a traceback
        try:
            format_prompt(tokenizer, [system, {"role": "user", "content": "1"}], True)
        except Exception as error:
            raise UsageError(f"--system-prompt {args.system_prompt!r}: the chat template of --model {args.model} "
                             f"refuses it: {str(error).rstrip('.')}.") from None
    train, held_out = load_data(args.dataset, args.eval_dataset, args.eval_size, args.dataset_config, args.split,
                                args.eval_split, args.task or "add", prompt_field=args.prompt_field,
                                answer_field=args.answer_field, no_chat=no_chat)
    for row in train + held_out if args.system_prompt is not None else ():  # before each prompt that has none
        messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
        row["prompt"] = messages if messages[0]["role"] == "system" else [system, *messages]
    reward_fn = load_object(args.reward_fn, "--reward-fn", "function") if args.reward_fn else None
    if reward_fn:  # fn(prompts, completions, answers) -> a float each: tried now, two rows' answers as completions
        call_reward_fn(reward_fn, args.reward_fn, *([e[k] for e in train[:2]] for k in ("prompt", "answer", "answer")))
    train, held_out, limit, longest = fit_prompts(train, held_out, tokenizer, args)
    first = limit[0] if args.env else longest  # an episode's first message is any that fits
    args.max_sequence_length = int(first + args.max_new_tokens) if math.isfinite(first) else 0  # 0: the model's
    env = MultiTurn(load_object(args.env, "--env", "class"), args.env, args.max_turns, args.chat_template, limit) \
        if args.env else None
    if env and isinstance(env.env_class, type):  # a function's environments: checked as it makes them
        env_output(env, "class", lambda: env.env_class)
    random.seed(seed := args.seed + int(os.environ.get("RANK", 0))), np.random.seed(seed % 2**32)  # an env's, per rank
    return tokenizer, train, held_out, args.dataset is None, reward_fn, env


def fit_prompts(train: list[dict], held_out: list[dict], tokenizer, args) -> tuple[list, list, tuple, int]:
    """The examples whose formatted prompt is not empty, has at most --max-prompt-length tokens and leaves room for
    --max-new-tokens in the model's positions (else a crash, or untrained positions), that limit (tokens, why) and the
    longest prompt kept (tokens)."""
    positions = model_positions(args.model)
    limit = min(args.max_prompt_length or math.inf, positions - args.max_new_tokens if positions else math.inf)
    if limit < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                         f"{positions} positions. Lower --max-new-tokens.")
    why = f"longer than --max-prompt-length {limit} tokens" if limit == args.max_prompt_length else \
        f"longer than {limit} tokens (the model takes {positions} positions, --max-new-tokens of them)"
    fitted, longest = [], 0
    # Where a row is, for a message: its source and number there (--dataset's held-out rows are its last ones)
    source = f"--dataset {args.dataset}" if args.dataset else "the built-in task"
    held_source = f"--eval-dataset {args.eval_dataset}" if args.eval_dataset else source
    held_first = 1 if args.eval_dataset or args.eval_split else len(train) + 1
    for examples, what, where, first in ((train, "training data", source, 1),
                                         (held_out, "held-out data", held_source, held_first)):
        texts = []
        for i, e in enumerate(examples, first):
            try:
                texts.append(format_prompt(tokenizer, e["prompt"], args.chat_template))
            except Exception as error:  # the template's own refusal (jinja2's raise_exception): its message
                raise UsageError(f"{where}: row {i}: the chat template of --model {args.model} refuses its prompt: "
                                 f"{str(error).rstrip('.')}.") from None
        once = list(dict.fromkeys(texts))  # each text tokenized once: DAPO-Math-17k repeats each of its problems
        try:
            lengths = dict(zip(once, map(len, tokenizer(once, add_special_tokens=False).input_ids))) if once else {}
        except Exception as e:  # the default tiny model's tokenizer knows only the built-in tasks' characters
            raise UsageError(f"--model {args.model}: its tokenizer cannot encode the {what} ({e}). Pass a --model "
                             "whose tokenizer covers your data.") from None
        fits = [0 < lengths[text] <= limit and not is_blank(e["prompt"]) for e, text in zip(examples, texts)]
        fitted.append([e for e, fit in zip(examples, fits) if fit])
        longest = max([longest, *(n for n in lengths.values() if n <= limit)])
        if examples and not fitted[-1]:
            raise UsageError(f"{what}: all {len(examples)} prompts are empty or {why}. Raise --max-prompt-length, "
                             "or lower --max-new-tokens.")
        if len(fitted[-1]) < len(examples):
            print0(f"{what}: dropped {len(examples) - len(fitted[-1])} of {len(examples)} prompts that are empty or "
                   f"{why}")
        prefills = sum(isinstance(e["prompt"], list) and e["prompt"][-1]["role"] == "assistant" for e in fitted[-1])
        if prefills:  # continued, not answered: SFT data's `messages` end with the gold answer (docs/data.md)
            print0(f"{what}: {prefills} of {len(fitted[-1])} prompts end with the assistant's message, continued (a "
                   "prefill: where it is a gold answer, as in SFT data's messages, name the prompt's field instead)")
    return fitted[0], fitted[1], (limit, why), longest


def format_prompt(tokenizer, prompt: str | list[dict], chat_template: bool) -> str:
    """The text a model continues: its chat template's rendering (text: a user message) and the assistant's header, or
    where the last message is the assistant's, that message left open to be continued (a prefill, as TRL's
    continue_final_message); without the template, the text after BOS."""
    if chat_template and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prefill = messages[-1]["role"] == "assistant"
        return tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill,
                                             continue_final_message=prefill, tokenize=False)
    return (tokenizer.bos_token or "") + prompt


def is_blank(prompt: str | list[dict]) -> bool:
    """A prompt with no question: blank text, or messages whose every content but the system's is blank."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt if m["role"] != "system"]
    return not any(text.strip() for text in texts)


def prompt_batch(examples: list[dict], step: int, batch_size: int, rank: int, world_size: int, seed: int) -> list[dict]:
    """This rank's slice of step `step`'s global batch, in an order (a permutation per epoch, seeded by seed + epoch)
    that depends only on (seed, step): a resume is exact, and the global batch the same on any number of ranks."""
    local, start = batch_size // world_size, step * batch_size + rank * (batch_size // world_size)
    return [examples[_epoch_order(len(examples), seed + pos // len(examples))[pos % len(examples)]]
            for pos in range(start, start + local)]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int) -> list[int]:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()


# 5. Rewards and evaluation --------------------------------------------------------------------------------------
def final_answer(text: str) -> str | None:
    """A completion's final answer: its last \\boxed{...}, else the number after its last '####' (else the line); '' for
    an unfinished one (cut off: no answer, never an earlier number); None for neither."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
        return ""  # unclosed brace
    if "####" not in text:
        return None
    line = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    number = re.match(r"\\?\$?\s*(" + NUMBER + ")", line)
    return number[1] if number else line.strip()


# A plain number; at most 9 digits of exponent, kept exact and cheap by Decimal (a Fraction of 1e99999999 took minutes)
NUMBER = (r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # digits (commas between groups of three), decimals, then
          r"(?:[eE][-+]?\d{1,9}|\s*\\(?:times|cdot)\s*10\^(?:\{[-+]?\d{1,9}\}|\d)|/\d+)?")  # 1e3, \times 10^{3} or /4


def _to_number(text: str) -> Fraction | Decimal | None:
    """A plain number ('1,234,567', '-3.5', '3/4', '\\frac{3}{4}', '1.5e3', '6.02 \\times 10^{23}'), exactly, as MATH
    and GSM8K write them ('\\$18', '32,\\!348', '50\\%'), or None: '0,1' (two answers), '12 13', '10001_2' are not."""
    text = re.sub(r"\\[!,;: ]|\\?\$|\\?%", "", text.strip().rstrip(".")).replace("{,}", ",")
    text = re.sub(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$", r"\1\2/\3", text.strip())
    if len(text) > 200 or not re.fullmatch(NUMBER, text):
        return None
    text, _, over = re.sub(r"\s*\\(times|cdot)\s*10\^\{?([-+]?\d+)\}?", r"e\2", text.replace(",", "")).partition("/")
    return Fraction(text) / int(over) if over else Decimal(text)  # over: a fraction's denominator


def math_reward(completion: str, answer: str) -> bool:
    """Is `completion` right for a gold `answer` ('72', '\\frac{1}{2}', '(1, 3]', 'reasoning #### 72')? Its final answer
    (or all of it): numbers exactly, a base ('10001_2') as text, else by math-verify. The rules: docs/data.md."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold, stated = answer.rsplit("####", 1)[-1].strip(), final_answer(completion)
    given = completion if stated is None else stated
    if stated == "":  # cut off inside its final answer
        return False
    if re.fullmatch(r"\w+_\{?\d+\}?", gold):  # a number in base b: its digits and the base, as text
        return re.sub(r"[{}\s]", "", given) == re.sub(r"[{}\s]", "", gold)
    numbers = _to_number(gold), _to_number(given)
    if None not in numbers:
        _, digits, exponent = numbers[0].as_tuple() if isinstance(numbers[0], Decimal) else (0, (), 0)
        if exponent < 0 and len(digits) >= 16 and Decimal(repr(float(numbers[0]))) == numbers[0]:  # a float's repr
            return float(numbers[0]) == float(numbers[1])  # (JSON): its exact value was lost, so a float's precision
        return numbers[0] == numbers[1]
    if isinstance(numbers[0], Decimal):  # as exact LaTeX for math-verify ('1.5e3' would be 1.5 times a symbol e)
        sign, digits, exponent = numbers[0].as_tuple()
        gold = f"{'-' * sign}{''.join(map(str, digits))} \\times 10^{{{exponent}}}"
    extraction = [LatexExtractionConfig(), ExprExtractionConfig()]
    return verify(parse(gold if "\\boxed" in gold or re.search(r"(?<!\\)\$", gold) else f"${gold}$", extraction),
                  parse(completion if stated is None else f"\\boxed{{{stated}}}", extraction))


def correctness_reward(completions: list[str], answers: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the completion is right: its text after the last '####' is the answer (`exact`), or `math_reward`."""
    right = [c.rsplit("####", 1)[-1].strip() == a.strip() if exact else math_reward(c, a)
             for c, a in zip(completions, answers)]
    return torch.tensor(right, dtype=torch.float32)


def format_reward(completions: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the answer has the expected form: a bare number after '####' (`exact`), or \\boxed{} / #### (data)."""
    return torch.tensor([re.fullmatch(r"\s*-?\d+\s*", c.rsplit("####", 1)[-1]) is not None if exact else
                         "\\boxed{" in c or "####" in c for c in completions], dtype=torch.float32)


def load_object(spec: str, flag: str, kind: str):
    """What `spec` names: `module:name`, imported from the working directory, or `path/to/file.py:name`."""
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise UsageError(f"{flag} {spec!r}: expected 'module:{kind}' or 'file.py:{kind}'.")
    sys.path.insert(0, os.getcwd())  # for this import only: found from the working directory first
    try:
        if module_name.endswith(".py"):
            loader = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:
        raise UsageError(f"{flag} {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}).") from None
    finally:
        sys.path.remove(os.getcwd())
    if not callable(fn := getattr(module, fn_name, None)):
        raise UsageError(f"{flag} {spec!r}: {module_name!r} has no {kind} {fn_name!r}.")
    return fn


def call_reward_fn(fn, spec: str, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
    """A user reward function's values (B,), a finite float per completion, or a stop that says what it gave (its own
    calls need their own timeouts: it runs in this process)."""
    try:
        values = fn(list(prompts), list(completions), list(answers))
    except SystemExit as e:  # would end the run with its status (0 for sys.exit()), and no final/
        raise UsageError(f"--reward-fn {spec!r} called sys.exit({e.code}). A reward function must return its "
                         "values; to stop the run, raise an exception.") from None
    except Exception as e:
        raise UsageError(f"--reward-fn {spec!r} raised {type(e).__name__}: {e}") from None
    try:
        out = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):  # None, a dict, text: not numbers
        out = None
    if out is None or out.shape != (len(completions),) or not out.isfinite().all():
        raise UsageError(f"--reward-fn {spec!r} must return a list of one finite float per completion "
                         f"({len(completions)}), got {repr(values)[:200]}.")
    return out


def score(examples: list[dict], completions: list[str], group_size: int, exact: bool, format_weight: float = 0.0,
          reward_fn=None, reward_fn_spec: str = "", env_return: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total reward (B,) = correct + format_weight * format + user reward, and each component (B,), of `group_size`
    completions of each example, stored contiguously; with an environment, `correct` is the episodes' return."""
    prompts, answers = ([e[key] for e in examples for _ in range(group_size)] for key in ("prompt", "answer"))
    components = {"correct": correctness_reward(completions, answers, exact) if env_return is None else
                  env_return.cpu()}
    if format_weight:
        components["format"] = format_reward(completions, exact)
    if reward_fn is not None:
        components["user"] = call_reward_fn(reward_fn, reward_fn_spec, prompts, completions, answers)
    rewards = components["correct"] + format_weight * components.get("format", 0.0) + components.get("user", 0.0)
    return rewards, components


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], chat_template: bool, exact: bool, max_new_tokens: int, seed: int,
             batch_size: int = 256, vllm=None, env: "MultiTurn | None" = None) -> dict[str, float]:
    """Held-out accuracy of a sample at T=1 and of greedy decoding (with `env`: an episode's mean return), each rank
    on a strided shard, its sampling seeded and forked: training's random state neither read nor changed."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    start, shard = time.perf_counter(), examples[rank::world_size]
    right = torch.zeros(2, dtype=torch.float64, device=model.device)
    states = random.getstate(), np.random.get_state()  # an environment's draws: seeded, restored after
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed + rank), random.seed(seed + rank), np.random.seed((seed + rank) % 2**32)
        for i in range(0, -(-len(examples) // world_size), batch_size):  # as many batches on every rank (FSDP)
            batch, counted = shard[i : i + batch_size] or examples[:1], bool(shard[i : i + batch_size])
            prompts = [format_prompt(tokenizer, e["prompt"], chat_template) for e in batch]
            for j, greedy in enumerate((False, True)):
                rollout = generate(model, tokenizer, prompts, 1, max_new_tokens, 1.0, greedy, vllm, env, batch)
                correct = score(batch, rollout.texts, 1, exact, env_return=rollout.env_return)[1]["correct"]
                right[j] += correct.sum().item() * counted
    right = all_reduce(right) / len(examples)
    random.setstate(states[0]), np.random.set_state(states[1])
    return {"eval/accuracy": right[0].item(), "eval/accuracy_greedy": right[1].item(),
            "perf/eval_s": time.perf_counter() - start}


# 6. Generation and log-probs ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Rollout:
    """G completions per prompt, stored contiguously (group j is rows j*G .. j*G+G-1). input_ids, attention_mask:
    (B, P+L) the left-padded prompt, then the response, padded after EOS; response_mask: (B, L) 1 on response tokens,
    EOS included; texts: the B decoded responses; truncated: (B,) True where one hit --max-new-tokens without EOS;
    sampler_logprobs: (B, L) each token's log-prob under its sampler (0 greedy). An episode (`MultiTurn`): the
    policy's turns (response_mask 1; texts: them alone) and observations (0, log-prob 0); env_return, turns: (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    texts: list[str]
    truncated: torch.Tensor
    sampler_logprobs: torch.Tensor
    env_return: torch.Tensor | None = None
    turns: torch.Tensor | None = None


def cat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rollouts stacked in order (groups stay contiguous), re-padded to the widest prompt and longest response."""
    P, L = max(r.prompt_length for r in rollouts), max(r.response_mask.shape[1] for r in rollouts)

    def pad(r: Rollout, x: torch.Tensor, value, left: bool = True) -> torch.Tensor:  # to (B, P+L), or (B, L)
        return F.pad(x, (P - r.prompt_length if left else 0, L - r.response_mask.shape[1]), value=value)

    return Rollout(torch.cat([pad(r, r.input_ids, pad_token_id) for r in rollouts]),
                   torch.cat([pad(r, r.attention_mask, 0) for r in rollouts]),
                   torch.cat([pad(r, r.response_mask, 0, left=False) for r in rollouts]), P,
                   [t for r in rollouts for t in r.texts], torch.cat([r.truncated for r in rollouts]),
                   torch.cat([pad(r, r.sampler_logprobs, 0, left=False) for r in rollouts]),
                   *(None if rollouts[0].turns is None else torch.cat([getattr(r, key) for r in rollouts])
                     for key in ("env_return", "turns")))


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout restricted to `rows` (indices or a boolean mask over the B rows)."""
    rows = (rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows).to(rollout.input_ids.device)
    return Rollout(**{key: value[rows] if torch.is_tensor(value) else [value[i] for i in rows.tolist()]
                      if isinstance(value, list) else value for key, value in vars(rollout).items()})


class Sampler(LogitsProcessor):
    """Sampling's only logits processor, in transformers' greedy loop: it draws each row's token from softmax(logits /
    T), keeps its log-prob and leaves the greedy step nothing else to take (scores -inf but at the drawn token)."""

    def __init__(self, temperature: float):
        self.temperature, self.logprobs = temperature, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = (scores / self.temperature).log_softmax(-1)  # (B, V)
        tokens = torch.multinomial(logprobs.exp(), 1)  # (B, 1)
        self.logprobs.append(logprobs.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str] | list[list[int]], group_size: int, max_new_tokens: int,
             temperature: float, greedy: bool = False, vllm=None, env: "MultiTurn | None" = None,
             rows: list[dict] | None = None) -> Rollout:
    """`group_size` completions of each prompt (text, formatted, or ids) from plain softmax(logits / T), as every loss
    here assumes (greedy: argmax), by `sample_hf` or `vllm`'s engine; with `env`, `rows`' episodes (`run_episodes`)."""
    if env is not None:
        return run_episodes(model, tokenizer, rows, group_size, max_new_tokens, temperature, greedy, vllm, env)
    ids = tokenizer(prompts, add_special_tokens=False).input_ids if isinstance(prompts[0], str) else prompts
    sample = vllm.generate if vllm is not None else sample_hf  # the responses (EOS in) and their log-probs
    responses, logprobs = sample(model, tokenizer, ids, group_size, max_new_tokens, temperature, greedy)
    eos_ids = stop_ids(model, tokenizer)
    truncated = [response[-1] not in eos_ids for response in responses]
    texts = tokenizer.batch_decode([response[: len(response) - (not cut)] for response, cut in
                                    zip(responses, truncated)], skip_special_tokens=True)
    return pack(tokenizer, [x for x in ids for _ in range(group_size)], responses, [[1] * len(r) for r in responses],
                logprobs, texts, truncated)


def sample_hf(model, tokenizer, ids: list[list[int]], group_size: int, max_new_tokens: int, temperature: float,
              greedy: bool, stop: list[str] = ()) -> tuple[list[list[int]], list[list[float]]]:
    """`model.generate`'s `group_size` responses of each prompt (up to EOS, or padded after a `stop` string) and their
    log-probs; its generation config has EOS, pad, BOS ids only (else transformers merges top_k, ... into sampling)."""
    enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(model.device)
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0) for x in (enc.input_ids, enc.attention_mask))
    eos_ids = stop_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=model.generation_config.bos_token_id, do_sample=False,  # Sampler draws
                              stop_strings=list(stop) or None)
    sampler = Sampler(temperature)
    synced = dist.is_initialized() and isinstance(unwrap(model), FSDPModule)  # FSDP: a rank done keeps stepping
    checkpoint_config, model.generation_config = model.generation_config, config
    # One autocast region around the whole generation: fp32 weights are cast to bf16 once, not again at each token's
    # forward (autocast keeps its casts until its outermost region ends)
    dtype = getattr(unwrap(model), "compute_dtype", torch.float32)
    try:
        with torch.autocast(model.device.type, dtype=dtype, enabled=dtype != torch.float32):
            cache = None  # each prompt's keys and values but its last token's, computed once for its group's rows
            if on_every_rank(model, group_size > 1 and enc.input_ids.shape[1] > 1, model.device):
                prefix, mask = enc.input_ids[:, :-1], enc.attention_mask[:, :-1]
                kv = getattr(model(input_ids=prefix, attention_mask=mask, position_ids=position_ids(mask),
                                   use_cache=True, logits_to_keep=1), CACHE)
                if plain_cache(kv, prefix.shape[1]):  # else each row runs its prompt (linear attention, checkpointing)
                    kv.batch_repeat_interleave(group_size)
                    cache = kv
            elif synced and is_lora(model):  # peft's generate skips its root's FSDP hooks: a root forward
                model(input_ids=prompt_ids[:1, :1])  # gathers it first
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                                 logits_processor=None if greedy else [sampler], synced_gpus=synced,
                                 tokenizer=tokenizer if stop else None, **{CACHE: cache})
    finally:
        model.generation_config = checkpoint_config
    responses = out[:, prompt_ids.shape[1]:].tolist()  # (B, L), padded after EOS
    lengths = [next((t + 1 for t, token in enumerate(r) if token in eos_ids), len(r)) for r in responses]  # EOS in
    logprobs = [[0.0] * len(r) for r in responses] if greedy else torch.stack(sampler.logprobs, 1).tolist()
    return [r[:n] for r, n in zip(responses, lengths)], [lp[:n] for lp, n in zip(logprobs, lengths)]


def stop_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the checkpoint's EOS ids (generation_config.json) and the tokenizer's."""
    eos_ids = unwrap(model).generation_config.eos_token_id
    return sorted(set([eos_ids] if isinstance(eos_ids, int) else eos_ids or []) | {tokenizer.eos_token_id} - {None})


@dataclasses.dataclass
class MultiTurn:
    """An environment (--env, `GUESS`), made by a class or function from each episode's row: `step(action) ->
    (observation, reward, done)`, optional `stop` (strings that end a turn: '</calc>') and `reset()` (`env_output`)."""

    env_class: type
    spec: str  # --env, for messages
    max_turns: int
    chat_template: bool = True
    prompt_limit: tuple = (math.inf, "")  # fit_prompts' rule (tokens, why), for the first message


def run_episodes(model, tokenizer, rows: list[dict], group_size: int, max_new_tokens: int, temperature: float,
                 greedy: bool, vllm, env: MultiTurn) -> Rollout:
    """`group_size` episodes of each row: each turn those still going sample as a batch, each text goes to its `step`,
    the observation is appended as tokens (sampled ones never decoded and encoded again), until `done`, --max-turns or
    --max-new-tokens. Every rank runs as many turns (a dummy one where its episodes ended): collective forwards."""
    rows = [copy.deepcopy(row) for row in rows for _ in range(group_size)]  # each episode's own: an env may write it
    envs = [env_output(env, "__init__", env.env_class, row) for row in rows]
    messages, prompts = map(list, zip(*[env_output(env, "reset", getattr(e, "reset", lambda: None), row=row,
                                                   tokenizer=tokenizer) for e, row in zip(envs, rows)]))
    responses, masks, logprobs, said = ([[] for _ in rows] for _ in range(4))  # after the prompt; masks: 1 = policy's
    returns, turns, ended, cut = ([0] * len(rows) for _ in range(4))
    eos_ids = stop_ids(model, tokenizer)
    stop = stop_strings(tokenizer, env_output(env, "stop", lambda: [getattr(e, "stop", []) for e in envs]))
    for turn in range(env.max_turns):
        going = [i for i in range(len(rows)) if not ended[i]]
        if not all_reduce(torch.tensor(len(going), device=current_device()), "max"):
            break
        room = [max_new_tokens - len(responses[i]) for i in going]  # each episode's tokens left
        sample = vllm.generate if vllm is not None else sample_hf  # as `generate`, without packing the turn
        new, new_logprobs = sample(model, tokenizer, [prompts[i] + responses[i] for i in going] or prompts[:1], 1,
                                   max(room, default=1), temperature, greedy, stop)  # each row up to its stop
        for k, i in enumerate(going):
            ids, at_stop = cut_at_stop(tokenizer, new[k][: room[k]], stop, prompts[i] + responses[i])
            responses[i], masks[i], turns[i] = responses[i] + ids, masks[i] + [1] * len(ids), turn + 1
            logprobs[i] += new_logprobs[k][: len(ids)]
            at_eos = ids[-1] in eos_ids
            said[i].append(tokenizer.decode(ids[:-1] if at_eos else ids, skip_special_tokens=True))  # the action
            ended[i] = cut[i] = not (at_eos or at_stop)  # cut by --max-new-tokens within the turn: no action
            if ended[i]:
                continue
            observation, reward, done = env_output(env, "step", envs[i].step, said[i][-1])
            returns[i] += reward
            last = turn == env.max_turns - 1
            ended[i], cut[i] = done or last, not done and last  # not ended by the environment: cut by --max-turns
            if ended[i]:
                continue
            messages[i] += [{"role": "assistant", "content": said[i][-1]}, observation]
            refused = f"--env {env.spec}: turn {turn + 1}: the chat template refuses the conversation with the " \
                f"environment's {observation['role']} message"
            obs = message_ids(tokenizer, messages[i], len(messages[i]) - 1, ids[-1] if at_eos else None,
                              env.chat_template, refused)
            ended[i] = cut[i] = len(responses[i]) + len(obs) >= max_new_tokens  # no room left for a turn
            if not ended[i]:
                responses[i], masks[i], logprobs[i] = responses[i] + obs, masks[i] + [0] * len(obs), \
                    logprobs[i] + [0.0] * len(obs)
    return pack(tokenizer, prompts, responses, masks, logprobs, ["\n".join(s) for s in said], cut,
                env_return=returns, turns=turns)


def env_output(env: MultiTurn, what: str, fn, *args, row: dict | None = None, tokenizer=None):
    """fn(*args), a call into the environment, and what it gave checked here and nowhere else, as run_episodes takes
    it: `what` is 'class', '__init__', 'stop', 'reset' or 'step'. An exception or a wrong value stops with one line."""
    try:
        value = fn(*args)
    except SystemExit as e:  # (a code tool running what the policy wrote: exit()) would end the run, status 0
        raise UsageError(f"--env {env.spec}: {what} called sys.exit({e.code!r}). An environment must return its "
                         "values; to stop the run, raise an exception.") from None
    except Exception as e:
        raise UsageError(f"--env {env.spec}: {what} raised {type(e).__name__}: {e}") from None
    shown, a_message = repr(value), "a message {'role': text, 'content': text}"
    if what in ("class", "__init__"):  # what makes, or is, an environment
        must, valid = "have a step(action) method", callable(getattr(value, "step", None))
    elif what == "stop":  # the episodes' stop strings: one list, as a batch's turns end at any of them
        stops = [[s] if isinstance(s, str) else list(s) if isinstance(s, (list, tuple)) else s for s in value]
        value, shown = stops[0], " and ".join(dict.fromkeys(map(repr, stops)))
        must = "be a non-empty string (one stop string) or a list of them, the same in every episode"
        valid = stops == [value] * len(stops) and isinstance(value, list) and all(isinstance(x, str) for x in value)
        valid = valid and "" not in value
    elif what == "reset":  # (the first messages, their tokens), in fit_prompts' limit; None: the row's prompt
        must = f"return the first message: text, not empty, {a_message} or a list of them (None: the row's prompt)"
        value = [value] if is_message(value) else row["prompt"] if value is None else value  # a message, or a list
        value = [{"role": "user", "content": value}] if isinstance(value, str) else value  # text: one user message
        valid = isinstance(value, list) and value != [] and all(map(is_message, value)) and value[0]["content"] != ""
        refused = f"--env {env.spec}: reset: the chat template refuses the first messages"
        ids = message_ids(tokenizer, value, 0, None, env.chat_template, refused) if valid else []
        if len(ids) > env.prompt_limit[0]:
            raise UsageError(f"--env {env.spec}: reset: the first message of row {row['prompt'][:40]!r}'s episodes is "
                             f"{len(ids)} tokens, {env.prompt_limit[1]}. Return a shorter one.")
        value = valid and (list(value), ids)
    else:  # step: the observation is read only where the episode goes on
        must = f"return (observation: text or {a_message}, reward: a finite number, done: a bool)"
        valid = isinstance(value, tuple) and len(value) == 3 and isinstance(value[1], numbers.Real) and \
            math.isfinite(value[1]) and type(value[2]).__name__ in ("bool", "bool_") and \
            (bool(value[2]) or isinstance(value[0], str) or is_message(value[0]))
        value = valid and ({"role": "user", "content": value[0]} if isinstance(value[0], str) else value[0],
                           float(value[1]), bool(value[2]))
    if not valid:
        raise UsageError(f"--env {env.spec}: {what}: must {must}, got {shown[:200]}.")
    return value


def stop_strings(tokenizer, stop: list[str]) -> list[str]:
    """The `stop` strings some token completes (transformers refuses the others: no text holds them)."""
    kept = []
    for string in stop:
        with contextlib.suppress(ValueError):  # raised where no token completes it
            transformers.StopStringCriteria(tokenizer, [string])
            kept.append(string)
    return kept


def cut_at_stop(tokenizer, ids: list[int], stop: list[str], context: list[int] = ()) -> tuple[list[int], bool]:
    """`ids` up to the first token that completes a `stop` string, and whether one did (by decoding prefixes): in the
    text after `context` (the prompt and earlier turns), as model.generate sees it, so that a stop string that begins
    before the turn (a '\n' that closes the assistant's header) ends the turn at its first token."""
    tail = list(context)[len(context) - max(map(len, stop), default=0):]  # a token is a character or more
    start = len(tokenizer.decode(tail))

    def stops_at(n: int) -> bool:  # whether ids[: n + 1] complete a stop string that ends after the context
        text = tokenizer.decode(tail + ids[: n + 1])
        return any(text.find(s, max(0, start - len(s) + 1)) >= 0 for s in stop)

    if not ids or not stops_at(len(ids) - 1):
        return ids, False
    n = bisect.bisect_left(range(len(ids)), True, key=stops_at)
    return ids[: n + 1], True


def message_ids(tokenizer, messages: list[dict], new: int, eos_id: int | None, chat_template: bool,
                refused: str = "the chat template refuses the messages") -> list[int]:
    """The tokens of messages[new:] (the first ones, or an observation) and the next header: the chat template's text
    of all less that of those before, from where the policy's turn closes (after its EOS `eos_id`, or the template's;
    no template: the contents, after BOS); first messages that end with the assistant's continue it (a prefill). A
    content is text only: an environment's '<|im_end|>' forges no turn. A template's refusal: one line, `refused`."""
    marked = messages[:new] + [{**m, "content": f"\0{k}\0"} for k, m in enumerate(messages[new:])]  # index marks
    text, start = ("" if new else tokenizer.bos_token or "") + "".join(m["content"] for m in marked[new:]), 0
    if chat_template and tokenizer.chat_template:
        try:  # (roles that must alternate, meeting a tool's message; a system role some templates refuse)
            # the first messages rendered as a dataset's prompt is (a last assistant message continued), later ones
            # with the next header
            text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False) if new else \
                format_prompt(tokenizer, marked, True)
            before = tokenizer.apply_chat_template(messages[:new], tokenize=False) if new else ""
        except Exception as error:
            raise UsageError(f"{refused}: {error}") from None
        close = tokenizer.decode([eos_id]) if eos_id is not None else tokenizer.eos_token
        start = (end := before.rfind(close)) + len(close) * (eos_id is not None) if new else 0
        if new and (end < 0 or not text.startswith(before) or not before[:end].endswith(messages[new - 1]["content"])):
            raise UsageError("--chat-template: the tokenizer's chat template renders the turns so far differently once "
                             "a message is added (e.g. it strips earlier thinking): no observation can follow the "
                             "sampled tokens. Use a template that keeps earlier turns, or --no-chat-template.")
    pieces = re.split("\0([0-9]+)\0", text[start:])  # the template's text, a mark's index, text, ...
    return [i for k, piece in enumerate(pieces) for i in tokenizer(messages[new + int(piece)]["content"] if k % 2
            else piece, add_special_tokens=False, split_special_tokens=k % 2 == 1).input_ids]


def pack(tokenizer, prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]], logprobs:
         list[list[float]], texts: list[str], truncated: list[bool], device: torch.device | None = None, **episodes):
    """A Rollout of token lists, prompts left- and responses right-padded, on `device`; `episodes`: env_return, turns"""
    P, L, device = max(map(len, prompts)), max(map(len, responses)), device or current_device()
    input_ids = torch.full((len(prompts), P + L), tokenizer.pad_token_id)
    attention_mask, response_mask, sampler_logprobs = torch.zeros_like(input_ids), *torch.zeros(2, len(prompts), L)
    for i, (ids, response) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(ids) : P + len(response)] = torch.tensor(ids + response)
        attention_mask[i, P - len(ids) : P + len(response)] = 1
        response_mask[i, : len(response)] = torch.tensor(masks[i], dtype=torch.float32)
        sampler_logprobs[i, : len(response)] = torch.tensor(logprobs[i], dtype=torch.float32)
    return Rollout(input_ids.to(device), attention_mask.to(device), response_mask.to(device), P, texts,
                   torch.tensor(truncated, device=device), sampler_logprobs.to(device),
                   **{key: torch.tensor(value, dtype=torch.float32, device=device) for key, value in episodes.items()})


def load_vllm(args, rank: int, optimizer):
    """--vllm's engine (vllm_engine.py, beside this file, imported only with the flag), seeded per rank, or None."""
    if not args.vllm:
        return None
    try:
        from vllm_engine import VllmEngine
    except ModuleNotFoundError:
        raise UsageError("--vllm needs vllm_engine.py, beside common.py: copy it too.") from None
    return VllmEngine(args.model, args.dtype, args.seed + rank, optimizer, args.vllm_gpu_memory, args.vllm_keep_weights,
                      args.max_sequence_length or None, args.lm_head_fp32)


def plain_cache(cache, length: int) -> bool:
    """Whether `cache` holds plain keys and values of `length` tokens, to index by row (not under checkpointing)."""
    return (isinstance(cache, transformers.DynamicCache) and cache.get_seq_length() == length and all(
        type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer") for layer in cache.layers))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions from the mask: with left padding, each row's real tokens start at 0 (padding gets 0 too)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `model`'s forward returns, from its last hidden states (N, H) -> (N, V), in at least fp32."""
    config, logits = unwrap(model).config, unwrap(model).get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if getattr(config, "logit_scale", None):  # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2 and 3: cap * tanh(z / cap)
        logits = config.final_logit_softcapping * torch.tanh(logits / config.final_logit_softcapping)
    return logits


def response_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                           **forward_kwargs) -> torch.Tensor:
    """The last hidden states that score the response tokens: (B, P+L) ids, mask -> (B, L, H) of columns P-1 .. P+L-2,
    0 after the longest response; the forward runs on the columns the rows use (positions from the mask). Rows of one
    prompt (a group) share its forward: each distinct prompt runs once, then each response against its keys and values
    (causal: the whole rows' values and gradients, for P + G L positions, not G (P + L)); not where no prompt repeats
    (on some rank, for DDP or FSDP), under gradient checkpointing in train mode, or where the cache is not plain."""
    used = attention_mask.any(0).nonzero().squeeze(-1)  # the columns some row uses
    start, end = min(int(used[0]), prompt_length - 1), max(int(used[-1]) + 1, prompt_length + 1)
    cut, P, hf_model = (0, 0, 0, input_ids.shape[1] - end), prompt_length - start, unwrap(model)  # F.pad's: the
    input_ids, attention_mask = input_ids[:, start:end], attention_mask[:, start:end]  # right columns back, as 0
    prompts, row_prompt = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                       return_inverse=True)  # (N, 2P) distinct prompts; (B,) each row's
    checkpointed = torch.is_grad_enabled() and hf_model.training and (hf_model.is_activation_checkpointing if hasattr(
        hf_model, "is_activation_checkpointing") else hf_model.is_gradient_checkpointing)  # transformers < 5.20
    if on_every_rank(model, len(prompts) < len(input_ids) and not checkpointed, input_ids.device):
        prompt_ids, prompt_mask = prompts[:, :P], prompts[:, P:]
        first, first_hidden = forward_last_hidden(model, input_ids=prompt_ids, attention_mask=prompt_mask,
                                                  position_ids=position_ids(prompt_mask), use_cache=True,
                                                  **forward_kwargs)
        if plain_cache(cache := getattr(first, CACHE), P):
            cache.batch_select_indices(row_prompt)  # each row's prompt keys and values; gradients add up over rows
            _, rest_hidden = forward_last_hidden(model, input_ids=input_ids[:, P:], attention_mask=attention_mask,
                                                 position_ids=position_ids(attention_mask)[:, P:], use_cache=True,
                                                 **{CACHE: cache}, **forward_kwargs)
            return F.pad(torch.cat([first_hidden[row_prompt, -1:], rest_hidden[:, :-1]], 1), cut)
    _, hidden = forward_last_hidden(model, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids(attention_mask), use_cache=False, **forward_kwargs)
    return F.pad(hidden[:, P - 1 : -1], cut)


def forward_last_hidden(model, **inputs) -> tuple:
    """model(**inputs) and its decoder's last hidden state (B, T, H), taken by a hook on the decoder: the forward runs
    as called (DDP's and FSDP's hooks included), and only that state is kept (output_hidden_states keeps every
    layer's: ~208 KB a token at 7B in bf16, also in the no-grad passes)."""
    hidden = []
    hook = unwrap(model).get_decoder().register_forward_hook(lambda module, args, out: hidden.append(out[0]))
    try:
        return model(**inputs), hidden[-1]
    finally:
        hook.remove()


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
    """Per-token log-probs (B, L) in fp32 of the response tokens, and their entropy (no gradient), 0 after EOS; the LM
    head on real tokens only. With gradients and up to `recompute_above` logits (512 MB) the logits are kept for the
    backward; else chunks of `chunk_size` positions (2^25 logits), recomputed: the whole (N, V) never at once."""
    hidden = response_hidden_states(model, input_ids, attention_mask, prompt_length, logits_to_keep=1)  # (B, L, H)
    real = attention_mask[:, prompt_length:].bool()  # (B, L) 0 after EOS: those positions are set to 0
    hidden, targets = hidden[real], input_ids[:, prompt_length:][real]  # (N, H), (N,)
    N, vocab_size = len(targets), unwrap(model).get_output_embeddings().weight.shape[0]
    recompute = torch.is_grad_enabled() and N * vocab_size > recompute_above
    chunk_size = chunk_size or (max(1, N) if torch.is_grad_enabled() and not recompute else max(1, 2**25 // vocab_size))
    chunk = functools.partial(checkpoint, _token_logprobs, use_reentrant=False) if recompute else _token_logprobs
    logprobs, entropies = zip(*[chunk(hidden[i : i + chunk_size], targets[i : i + chunk_size], model, temperature,
                                      entropy) for i in range(0, max(N, 1), chunk_size)])  # each chunk's (n,), (n,)
    logprobs = torch.cat(logprobs)
    zeros = logprobs.new_zeros(real.shape)  # (B, L), the real positions filled in as they were taken, row by row
    return zeros.masked_scatter(real, logprobs), zeros.masked_scatter(real, torch.cat(entropies)) if entropy else None


def micro_batches(rows: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, size: int,
                  max_tokens: int | None = None, group_size: int = 1, whole: bool = False) -> list[torch.Tensor]:
    """`rows` (indices, ascending) in micro-batches of at most `size` rows: in their order, or with `max_tokens` longest
    first, each filled up to `max_tokens` positions (rows x (widest prompt + longest response); a longer row alone).
    Rows go one by one, or by group (rows j G .. j G + G - 1 share a prompt, which a forward runs once), whichever
    computes fewer positions: groups for long prompts, rows for long, uneven responses; groups always with `whole` (a
    loss per group). Every rank gets as many (forwards and gradient syncs are collective): fewer, the largest halved."""
    if max_tokens is None or not len(rows):
        return [idx for idx in rows.split(size) if len(idx)]
    ids, P = rows.tolist(), prompt_length
    lengths = list(zip(attention_mask[rows, :P].sum(-1).tolist(), attention_mask[rows, P:].sum(-1).tolist()))

    def widths(batch: list[list[int]]) -> tuple[int, int]:  # widest prompt, longest response of lists of rows
        return tuple(max(lengths[i][k] for unit in batch for i in unit) for k in (0, 1))

    def pack(unit: int) -> list[list[list[int]]]:  # micro-batches of units: lists of rows (positions in `ids`)
        batches = []
        for u in sorted([list(u) for _, u in itertools.groupby(range(len(ids)), lambda i: ids[i] // unit)],
                        key=lambda u: -sum(widths([u]))):
            n = sum(map(len, batches[-1])) + len(u) if batches else 0
            if not batches or n > size or n * sum(widths(batches[-1] + [u])) > max_tokens:
                batches.append([])
            batches[-1].append(u)
        return batches

    def positions(batches: list[list[list[int]]]) -> int:  # what the forwards compute: a group's prompt once
        return sum(len({ids[u[0]] // group_size for u in b}) * widths(b)[0] + sum(map(len, b)) * widths(b)[1]
                   for b in batches)

    batches = min([pack(group_size)] + [pack(1)] * (not whole), key=positions)
    most = int(all_reduce(torch.tensor(len(batches), device=current_device()), "max"))
    while len(batches) < most:  # as many as the rank with the most: halve the one with the most rows
        batch = batches.pop(max(range(len(batches)), key=lambda k: sum(map(len, batches[k]))))
        batch = batch if len(batch) > 1 or whole else [[i] for i in batch[0]]  # (one group's rows: apart)
        batches += [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return [rows[sorted(i for u in batch for i in u)] for batch in batches]


@torch.no_grad()
def rollout_logprobs(model, rollout: Rollout, temperature: float, micro_batch_size: int,
                     max_tokens: int | None = None, group_size: int = 1) -> torch.Tensor:
    """Log-probs (B, L), no entropy, of a rollout's responses, by `micro_batches`."""
    ids, mask, P = rollout.input_ids, rollout.attention_mask, rollout.prompt_length
    logprobs = torch.zeros_like(rollout.response_mask, dtype=torch.float32)
    for idx in micro_batches(torch.arange(len(ids), device=ids.device), mask, P, micro_batch_size, max_tokens,
                             group_size):
        logprobs[idx] = get_logprobs(model, ids[idx], mask[idx], P, temperature, entropy=False)[0]
    return logprobs


def sampler_logprob_gap(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, response_mask: torch.Tensor,
                        correction: str = "none", cap: float = 2.0) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs (B, L) are from the sampler's over every rank: mean |difference| (~1e-6 in fp32)
    and max; with a `correction` its mean weight and the shares of tokens and completions it truncated or masked."""
    mask = response_mask.bool()
    difference = torch.where(mask, (sampler_logprobs - logprobs).abs(), 0.0).double()  # (B, L)
    sums = [difference.sum(), mask.sum().double()]
    weights = rollout_weights(logprobs, sampler_logprobs, response_mask, correction, cap)
    if weights is not None:
        changed = (weights < rollout_weights(logprobs, sampler_logprobs, response_mask, correction, math.inf)) & mask
        sums += [(weights * mask).sum(), changed.sum(), changed.any(-1).sum(), mask.any(-1).sum()]
    total = all_reduce(torch.stack([x.double() for x in sums]))
    largest = all_reduce(difference.max() if difference.numel() else difference.new_zeros(()), "max")
    tokens = total[1].clamp(min=1)
    metrics = {"policy/sampler_logprob_gap": total[0] / tokens, "policy/sampler_logprob_gap_max": largest}
    if weights is not None:
        changed = "truncated" if correction.endswith("tis") else "masked"
        metrics |= {"policy/correction_weight_mean": total[2] / tokens, f"policy/correction_{changed}_frac":
                    total[3] / tokens, f"policy/correction_{changed}_seq_frac": total[4] / total[5].clamp(min=1)}
    return metrics


def rollout_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, response_mask: torch.Tensor,
                    correction: str, cap: float) -> torch.Tensor | None:
    """The rollout correction's per-token weights (B, L), without gradient; None for "none". A sampler other than the
    trainer (vLLM: bf16, its own kernels) draws from pi_s, not pi_old, even at the same weights, so each token's loss
    is weighted by its ratio w_t = pi_old / pi_s, or by its completion's (in log space, within e^+-20 as verl does):
      "tis"      min(w_t, C): truncated importance sampling (Yao et al. 2025; TRL's token_truncate)
      "mis"      1 where 1/C <= w_t <= C, else 0: verl's token_k1 (IcePop, TRL's token_mask: w_t where kept)
      "seq-tis"  min(prod_t w_t, C) on every token of the completion (verl's rollout_is="sequence")
      "seq-mis"  1 where 1/C <= prod_t w_t <= C, else 0: the completion left out (verl's seq_sum_k1)
      "geo-mis"  the same for exp(mean_t log w_t), which does not grow with the length (verl's seq_mean_k1)"""
    if correction == "none":
        return None
    log_ratio = ((old_logprobs - sampler_logprobs) * response_mask).detach()  # (B, L) log w_t, 0 after EOS
    if correction != "tis" and correction != "mis":  # the completion's ratio, on each of its tokens
        log_ratio = log_ratio.sum(-1, keepdim=True)  # (B, 1) log prod_t w_t
        if correction == "geo-mis":
            log_ratio = log_ratio / response_mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(old_logprobs)
    ratio = log_ratio.clamp(-20, 20).exp()
    return ratio.clamp(max=cap) if correction.endswith("tis") else ((ratio >= 1 / cap) & (ratio <= cap)).to(ratio.dtype)


def reweighted(logprobs: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`logprobs` (B, L), the same values, each token's gradient times its weight (every term; not the normaliser)."""
    return logprobs if weights is None else logprobs.detach() + weights * (logprobs - logprobs.detach())


# 7. Metrics and logging -----------------------------------------------------------------------------------------
def step_metrics(rewards: torch.Tensor, components: dict[str, torch.Tensor], rollout: Rollout,
                 times: dict[str, float], step_start: float) -> dict[str, float | torch.Tensor]:
    """What a step sampled over every rank (rewards, lengths of right and wrong completions, the share that write 'wait'
    and how often those are right: NaN when none) and cost (seconds; tokens/s: this rank's times the ranks)."""
    lengths, step_s, world_size = rollout.response_mask.sum(-1).double(), time.perf_counter() - step_start, \
        dist.get_world_size() if dist.is_initialized() else 1
    right, r = (x.to(lengths.device).double() for x in (components["correct"] > 0, rewards))  # any return's scale
    wait = torch.tensor([re.search(r"\bwait\b", t, re.IGNORECASE) is not None for t in rollout.texts],
                        dtype=torch.float64, device=lengths.device)
    sums = all_reduce(torch.stack([lengths @ right, right.sum(), lengths @ (1 - right), (1 - right).sum(),
                                   wait.sum(), wait @ right, lengths.new_tensor(len(wait)), r.sum(), r @ r]))
    return {"reward/mean": (rewards.sum(), len(rewards)),  # a (sum, count) pair: `add_metrics`
            "reward/std": ((sums[8] - sums[7] ** 2 / sums[6]) / (sums[6] - 1)).clamp(min=0).sqrt(),  # unbiased
            **{f"reward/{name}": (value.sum(), len(value)) for name, value in components.items()},
            "response/length_mean": (lengths.sum(), len(lengths)),
            "response/truncated_frac": (rollout.truncated.sum(), len(lengths)),
            "response/length_correct": sums[0] / sums[1], "response/length_wrong": sums[2] / sums[3],
            "task/self_correction_frac": sums[4] / sums[6], "task/self_correction_accuracy": sums[5] / sums[4],
            "perf/step_s": step_s, **{f"perf/{name}_s": seconds for name, seconds in times.items()},
            "perf/tokens_per_s": lengths.sum() * world_size / step_s, "perf/peak_mem_gb": peak_memory_gb(r.device),
            **({} if rollout.turns is None else {"env/turns": (rollout.turns.sum(), len(lengths)),
                "env/observation_tokens": (rollout.attention_mask[:, rollout.prompt_length:].sum() - lengths.sum(),
                                           len(lengths))})}


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or on CPU this process's peak resident memory: /proc's VmHWM (Linux carries
    `ru_maxrss` over fork and exec: a process started by a larger one would report that one's), else ru_maxrss."""
    if device.type == "cuda" or not (status := Path("/proc/self/status")).exists():
        return (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 2**30  # (bytes on macOS)
    return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:")) / 2**20


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str):
    """`with timed(times, "gen"): ...` adds the section's wall time to times["gen"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


class Logger:
    """A step's metrics over ranks (rank 0 writes): stdout, metrics.jsonl (NaN: null), TensorBoard, W&B; config.json."""

    SHOWN = ("reward/mean", "eval/accuracy", "eval/accuracy_greedy", "loss/policy", "policy/clipfrac", "perf/step_s")

    def __init__(self, run_dir: Path, config: dict, rank: int, track: bool = False, num_steps: int | None = None):
        self.enabled, self.num_steps, self.start, self.first_step = rank == 0, num_steps, time.perf_counter(), None
        self.wandb, self.tensorboard, self.closing = None, None, contextlib.ExitStack()  # closing: what close() ends
        if not self.enabled:
            return
        if track:
            self.wandb = need("wandb", "--track").init(name=run_dir.name, config=config)
            self.closing.callback(self.wandb.finish)
        (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.file = self.closing.enter_context(open(run_dir / "metrics.jsonl", "a"))  # claim_run_dir cut it back
        with contextlib.suppress(ImportError):
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = self.closing.enter_context(SummaryWriter(str(run_dir)))

    def log(self, step: int, metrics: dict[str, float | torch.Tensor]) -> None:
        metrics = all_reduce_mean(metrics)
        if not self.enabled:
            return
        print(json.dumps({"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}),
              file=self.file, flush=True)
        shown = " | ".join(f"{k} {metrics[k]:.4g}" for k in self.SHOWN if k in metrics)
        if self.num_steps is not None:  # the ETA from the mean time of the steps this process ran
            self.first_step = step if self.first_step is None else self.first_step
            elapsed, left = time.perf_counter() - self.start, self.num_steps - step - 1
            eta = f", ETA {datetime.timedelta(seconds=round(elapsed / (step + 1 - self.first_step) * left))}"
            shown += f" | {datetime.timedelta(seconds=round(elapsed))} elapsed{eta if left > 0 else ''}"
        print(f"step {step:>4}{'' if self.num_steps is None else f'/{self.num_steps}'} | {shown}", flush=True)
        for key, value in metrics.items() if self.tensorboard else ():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.closing.close()
