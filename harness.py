"""The run around an algorithm's loop, beside common.py: what a user who copies an algorithm file replaces with their
own infrastructure. Nothing here is in the loop's data flow (common.py is), and nothing in an algorithm's equations.

1. Flags: `cli`, `check_flags`, `require`, `need` (bad input: common.UsageError, one line naming the flag and the fix)
2. Distributed set-up: `setup_distributed`, `cleanup_distributed`
3. Models: `load_tokenizer`, `load_model` (any causal LM, dropout off; fp32 weights for what trains, --dtype compute),
   `add_lora`, `load_reference`, `shard_model` (FSDP2, from rank 0's weights), `plain_weights` (one tensor at a time)
4. Data: `load_task` (a `Task`: built-in tasks, JSONL, `datasets`; text or chat prompts that fit; --reward-fn, --env)
5. The sampler: `load_vllm` (vllm_engine.py, imported only with --vllm), `companion`
6. Run folder: `prepare_run_dir`, `claim_run_dir`, `resume_hint` (the rules: docs/checkpoints.md)
7. Checkpoints: `save_checkpoint`, `load_checkpoint` (torch.distributed.checkpoint, safetensors only)
8. A step that cannot be taken: `clip_grad_norm` (a gradient that is not finite stops the run, saying how to go on)
9. Logging: `Logger` (stdout, metrics.jsonl, TensorBoard, W&B)
"""

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import gzip
import importlib
import importlib.util
import json
import math
import os
import random
import re
import shlex
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dcp_state
import torch.nn.functional as F
import transformers
import tyro
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common import (
    Rollout,
    UsageError,
    all_reduce_mean,
    call_reward_fn,
    current_device,
    format_prompt,
    forward_last_hidden,
    is_lora,
    is_message,
    output_logits,
    print0,
    unwrap,
)

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = str(HERE / "tiny_model")  # made by make_tiny_model.py
# The built-in tasks (builtin_splits): the default --model and --max-new-tokens of each
TASKS = {
    "add": (DEFAULT_MODEL, 8),
    "chain": (str(HERE / "tiny_model_chain"), 64),
    "guess": (str(HERE / "tiny_model_guess"), 192),
}
GUESS = f"{HERE / 'examples' / 'guess.py'}:Guess"  # --task guess's environment, loaded as an --env is


# 1. Flags -----------------------------------------------------------------------------------------------------------


# (flag, valid, what it must be (why)): the flags every algorithm file shares, checked by `check_flags`.
FLAG_RULES = [
    ("num_steps", lambda v: v >= 1, ">= 1 (0 would save the untrained model as final/)"),
    ("prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("group_size", lambda v: v >= 1, ">= 1"),
    ("max_new_tokens", lambda v: v >= 1, ">= 1 (each completion has at least its EOS token)"),
    ("max_turns", lambda v: v >= 1, ">= 1 (1: single-turn)"),
    ("learning_rate", lambda v: v > 0, "> 0"),
    ("seed", lambda v: 0 <= v < 2**63, "in [0, 2**63) (torch's seeds are 64-bit; each rank adds its rank)"),
    (
        "temperature",
        lambda v: v >= 0.01,
        ">= 0.01 (the log-probs divide the logits by it, and below 0.01 float32 "
        "loses the precision a ratio needs; eval/accuracy_greedy reports greedy decoding)",
    ),
    ("dist_timeout", lambda v: v > 0, "> 0 (minutes)"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("updates_per_rollout", lambda v: v >= 1, ">= 1"),
    ("num_minibatches", lambda v: v >= 1, ">= 1"),
    ("micro_batch_size", lambda v: v is None or v >= 1, ">= 1 (or left out: the whole minibatch)"),
    ("max_tokens_per_micro_batch", lambda v: v is None or v >= 1, ">= 1 (or left out: no limit)"),
    ("max_grad_norm", lambda v: v > 0, "> 0 (inf: no clipping)"),
    ("eval_size", lambda v: v >= 0, ">= 0"),
    ("eval_every", lambda v: v >= 0, ">= 0 (0: never evaluate)"),
    ("save_every", lambda v: v >= 0, ">= 0 (0: only the final weights)"),
    ("keep_checkpoints", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("max_prompt_length", lambda v: v is None or v >= 1, ">= 1 (or left out: as long as the model allows)"),
    ("correction_cap", lambda v: v >= 1, ">= 1 (pi_old / pi_sampler is 1 where the two agree)"),
    ("off_policy_steps", lambda v: v >= 0, ">= 0 (0: each rollout sampled by the policy as it is)"),
    ("lora_rank", lambda v: v >= 0, ">= 0 (0: full fine-tuning)"),
    ("lora_alpha", lambda v: v > 0, "> 0 (the adapters' scale is alpha / rank)"),
    ("vllm_gpu_memory", lambda v: 0 < v <= 1, "in (0, 1] (a fraction of the GPU's memory)"),
]


def cli(args_class, args: list[str] | None = None):
    """tyro.cli of an Args of flag groups (its bases): by group in --help (nested), flat after parsing (args.seed)."""
    groups = [c for c in reversed(args_class.__mro__[1:]) if dataclasses.is_dataclass(c)]  # ExperimentFlags first
    fields = []
    for group in groups:
        words = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", group.__name__.removesuffix("Flags"))  # "Model And Data"
        title = words.capitalize().replace(" and ", " & ")  # "Model & data"
        fields.append(
            (group.__name__, Annotated[group, tyro.conf.arg(name=title)], dataclasses.field(default_factory=group))
        )
    grouped = dataclasses.make_dataclass(args_class.__name__, fields)
    parsed = vars(tyro.cli(grouped, args=args, config=(tyro.conf.OmitArgPrefixes,)))
    return args_class(**{key: value for group in parsed.values() for key, value in vars(group).items()})


def require(valid: bool, flag: str, value, must: str) -> None:
    """Stop at start-up unless `valid`: `require(args.beta >= 0, "--beta", args.beta, ">= 0")`."""
    if not valid:
        raise UsageError(f"{flag} {value}: must be {must}.")


def check_flags(args) -> None:
    """The shared flags, before anything is loaded or written, and the per-rank batch sizes (args.world_size, ...)."""
    for field in dataclasses.fields(args):  # every float flag, the algorithm's too: nan passes any comparison
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value) and (field.name, value) != ("max_grad_norm", math.inf):
            raise UsageError(f"--{field.name.replace('_', '-')} {value}: must be a finite number.")
    if args.task is not None and args.dataset is not None:
        raise UsageError(f"--task {args.task} is a built-in dataset: pass --task or --dataset, not both.")
    model, max_new_tokens = TASKS[args.task or "add"]  # the defaults that follow the task
    if args.model is None:
        args.model = model
    if args.max_new_tokens is None:
        args.max_new_tokens = max_new_tokens
    if args.task == "guess":  # the game's environment, as an --env
        args.env = args.env or GUESS
    if args.max_turns is None:
        args.max_turns = 7 if args.task == "guess" else 1
    for name, valid, must in FLAG_RULES:
        value = getattr(args, name)
        require(valid(value), f"--{name.replace('_', '-')}", value, must)
    if args.max_turns > 1 and args.env is None:
        raise UsageError(
            f"--max-turns {args.max_turns}: turns after the first answer an environment's observation. "
            "Pass --env file.py:Class (docs/environments.md), or --task guess."
        )
    if args.eval_every and args.eval_size == 0 and args.eval_dataset is None and args.eval_split is None:
        raise UsageError(
            f"--eval-size 0 leaves nothing to evaluate every --eval-every {args.eval_every} steps: pass "
            "--eval-every 0, a positive --eval-size, or --eval-dataset."
        )
    if args.run_name is not None and (args.run_name in ("", ".", "..") or "/" in args.run_name):
        raise UsageError(
            f"--run-name {args.run_name!r}: must be a folder name under --output-dir, without '/' "
            "(pass --output-dir for another place)."
        )
    if args.rollout_correction == "auto":  # another engine's numerics differ from the trainer's
        args.rollout_correction = "tis" if args.vllm and args.anchor == "recompute" else "none"
    if args.anchor == "behaviour" and args.rollout_correction != "none":
        raise UsageError(
            f"--rollout-correction {args.rollout_correction} weighs each token by pi_old / pi_sampler, which is 1 with "
            "--anchor behaviour (pi_old is the sampler's): pass --anchor recompute for the correction (AReaL's "
            "decoupled loss), or --rollout-correction none."
        )
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))  # as setup_distributed reads it
    if args.fsdp and args.world_size < 2:
        raise UsageError("--fsdp shards the model over ranks: launch with torchrun --nproc_per_node=2 or more.")
    args.local_prompts_per_step = exact_div(
        args.prompts_per_step, args.world_size, "--prompts-per-step must be divisible by the number of ranks"
    )
    args.local_batch_size = args.local_prompts_per_step * args.group_size
    args.minibatch_size = exact_div(
        args.local_batch_size,
        args.num_minibatches,
        "--num-minibatches must divide the sequences per rank (--prompts-per-step / ranks * --group-size)",
    )
    args.micro_batch_size = args.micro_batch_size or args.minibatch_size
    exact_div(
        args.minibatch_size,
        args.micro_batch_size,
        "--micro-batch-size must divide the sequences per rank and minibatch",
    )


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


# 2. Distributed set-up ----------------------------------------------------------------------------------------------


def setup_distributed(timeout_minutes: float = 60) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment (`python x.py`: rank 0 of 1); collectives time out."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # current_device() from here on
    if world_size > 1:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            device_id=current_device() if cuda else None,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
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
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # every file is closed by now (main has returned); the OS frees the rest


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (collective: every rank calls it), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# 3. Models ----------------------------------------------------------------------------------------------------------


def load_tokenizer(name: str, flag: str = "--model"):
    """The tokenizer of a model name or folder (a mistyped --model stops here), padding on the left. Its vocabulary
    never changes: it pads with EOS where it has no pad token (masks, not ids, say where text ends). No code runs."""
    if (Path(name) / "adapter").is_dir() and not (Path(name) / "config.json").exists():
        raise UsageError(
            f"{flag} {name}: a step checkpoint of a LoRA run holds its adapters (adapter/), not a "
            "model. Go on with --resume, or start from the run's final/ (the merged model)."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"{flag} {name!r}: cannot load it ({str(e).strip().splitlines()[0]}). Pass a local folder "
            "or a Hugging Face model name reachable from this machine."
        ) from None
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.pad_token or tokenizer.eos_token
    return tokenizer


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """--dtype as a torch dtype: auto is bfloat16 on a GPU, float32 on the CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_model(
    name: str,
    dtype: str,
    device: torch.device,
    tokenizer,
    auto_class=AutoModelForCausalLM,
    gradient_checkpointing: bool = False,
    trained: bool = True,
    sharded: bool = False,
    lm_head_fp32: bool = False,
):
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
    where = device
    if sharded:  # only rank 0 reads the weights, into host memory; the others build the model without memory
        where = "cpu" if rank == 0 else "meta"
    model = auto_class.from_pretrained(
        name, config=config, dtype=torch.float32 if trained else compute, device_map=where, trust_remote_code=False
    )
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
        raise UsageError(
            f"--model {model.config.name_or_path!r}: its forward changes the LM head's logits, unlike "
            f"get_logprobs (largest difference {difference.item():.3g}). Supported: a plain LM head, "
            "final_logit_softcapping, logit_scale, logits_scaling; add its transform to "
            "common.output_logits."
        )


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
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=targets if targets == "all-linear" else targets.split(","),
    )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # peft on transformers' renamed attributes
            return peft.get_peft_model(model, config).train(model.training)  # in the mode the model was
    except (ValueError, TypeError) as e:  # no module matched, or one of a type peft does not adapt
        raise UsageError(
            f"--lora-targets {targets}: {str(e).splitlines()[0]} Name modules of the model's "
            "transformer blocks (e.g. q_proj,v_proj), or leave it at all-linear."
        ) from None


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
    reference = (
        load_model(
            args.model, args.dtype, device, tokenizer, trained=False, sharded=args.fsdp, lm_head_fp32=args.lm_head_fp32
        )
        .eval()
        .requires_grad_(False)
    )
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


# 4. Data ------------------------------------------------------------------------------------------------------------


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
            steps = [f"{sum(numbers[:i])}+{numbers[i]}={sum(numbers[: i + 1])}" for i in range(1, len(numbers))]
            chains.setdefault(
                "+".join(map(str, numbers)),
                {
                    "prompt": "+".join(map(str, numbers)),
                    "answer": str(sum(numbers)),
                    "demo": " ".join(steps) + f" #### {sum(numbers)}",
                },
            )
        examples = list(chains.values())
    return examples[eval_size:], examples[:eval_size]


def load_rows(
    source: str,
    flag: str = "--dataset",
    config: str | None = None,
    split: str | None = "train",
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    no_chat: str = "",
) -> list[dict]:
    """Rows of a JSONL file or of what `datasets` reads (Hub, JSON/Parquet/CSV, folders) at `config` and `split` (None:
    'test' or its only one), fields by name or dotted path: "answer" as text, "prompt" as text or a list of chat
    messages (refused with `no_chat`: why no template renders them); a missing, null or wholly empty one stops."""
    jsonl = is_jsonl(source, config)
    records = _jsonl_records(source, flag) if jsonl else _dataset_records(source, flag, config, split)
    rows = []
    for where, record in records:
        prompt = _field(record, prompt_field, where, "--prompt-field", (str, int, float, list))
        answer = _field(record, answer_field, where, "--answer-field", (str, int, float))
        if isinstance(prompt, list):  # chat messages (TRL's and verl's prompts), rendered by the chat template
            problem = _chat_problem(prompt, no_chat)
            if problem:
                raise UsageError(f"{where}: field {prompt_field}: {problem}.")
        rows.append({**record, "prompt": prompt if isinstance(prompt, list) else str(prompt), "answer": str(answer)})
    if not rows:
        raise UsageError(f"{flag} {source!r}: the dataset has no examples.")
    for what, key, option in (("prompt", prompt_field, "--prompt-field"), ("answer", answer_field, "--answer-field")):
        if not any(str(row[what]).strip() for row in rows):
            raise UsageError(
                f"{flag} {source!r}: every {key} is empty. Name the field that holds the {what}s with {option}."
            )
    return rows


def _field(record, path: str, where: str, field_flag: str, kinds: tuple):
    """A row's value at `path`, a key or a dotted path to a nested one, of one of `kinds`; missing, null or another
    kind: one line naming `field_flag`."""
    keys = [path] if isinstance(record, dict) and path in record else path.split(".")  # a key with a dot, as it is
    value = record
    for i, key in enumerate(keys):
        if not isinstance(value, dict) or key not in value:
            has = ", ".join(value) if isinstance(value, dict) else "no fields"
            raise UsageError(
                f"{where}: missing field {path} ({'.'.join(keys[:i]) or 'the row'} has {has}). Name the field with "
                f"{field_flag}."
            )
        value = value[key]
    if not isinstance(value, kinds) or isinstance(value, bool):
        kind = "null" if value is None else f"a {type(value).__name__}"
        messages = " or chat messages" if list in kinds else ""
        raise UsageError(f"{where}: field {path} is {kind}; every row needs a {path}: text or a number{messages}.")
    return value


def _chat_problem(messages: list, no_chat: str) -> str:
    """What makes a row's chat messages unusable ('' for nothing): a message that is not one, no chat template to
    render them (`no_chat` says why), or no message at all."""
    for i, message in enumerate(messages, 1):
        if not is_message(message):
            return (
                f"message {i} must be {{'role': text, 'content': text}}, got {message!r:.200}. Fix the row, or name "
                "another field with --prompt-field"
            )
    if no_chat:
        return f"chat messages, which need a chat template; {no_chat}, or give them as text"
    if not messages:
        return "no messages (an empty list). Fix the row, or name another field with --prompt-field"
    return ""


def is_jsonl(source: str, config: str | None = None) -> bool:
    """Whether `source` is read as a JSONL file (also gzip'd, as many datasets ship): one row a line, no splits."""
    return source.endswith((".jsonl", ".jsonl.gz")) and config is None


def _jsonl_records(source: str, flag: str):
    """(file:line, object) for each non-empty line of a JSONL file."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise UsageError(
            f"{flag} {str(path)!r}: no such file. Pass a JSONL file with one "
            '{"prompt": ..., "answer": ...} object a line, or leave it out for the built-in task.'
        )
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                if raw.strip():
                    yield f"{path}:{line_no}", json.loads(raw.decode("utf-8-sig" if line_no == 1 else "utf-8"))
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"{path}:{line_no}: not UTF-8 ({e.reason} at byte {e.start}). Save it as UTF-8."
                ) from None
            except ValueError as e:
                raise UsageError(f"{path}:{line_no}: not valid JSON ({e}). Each line must be one object.") from None


def _dataset_records(source: str, flag: str, config: str | None, split: str | None):
    """('<source> [split] row i', row) for each row of what `datasets` reads from `source`."""
    datasets = need("datasets", f"{flag} {source!r} (not JSONL)")
    path = Path(source).expanduser()
    try:
        if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            data = datasets.load_from_disk(str(path))  # written by save_to_disk
        elif path.is_file():  # the builder by the file's suffix: json, parquet, csv (compressed: by the one before)
            kind = re.sub(r"\.(gz|bz2|xz|zst)$", "", path.name).rsplit(".", 1)[-1]
            data = datasets.load_dataset(kind.replace("jsonl", "json"), data_files=str(path))
        else:
            data = datasets.load_dataset(source, config)
    except Exception as e:  # also a folder with a loading script, which datasets refuses to run
        raise UsageError(
            f"{flag} {source!r}: cannot load it ({type(e).__name__}: {str(e).strip().splitlines()[0]}). "
            "Pass a JSONL, JSON, Parquet or CSV file, a dataset folder, or a Hugging Face dataset name "
            "reachable from this machine."
        ) from None
    if isinstance(data, datasets.DatasetDict):
        split = split or ("test" if "test" in data or len(data) != 1 else next(iter(data)))
        if split not in data:
            raise UsageError(
                f"{flag} {source!r}: no split {split!r}; it has {list(data)}. Choose one with "
                f"{'--split' if flag == '--dataset' else '--eval-split'}."
            )
        data = data[split]
    for i, row in enumerate(data):
        yield f"{source} [{split or 'train'}] row {i}", row


def load_data(
    dataset: str | None,
    eval_dataset: str | None,
    eval_size: int,
    dataset_config: str | None = None,
    split: str = "train",
    eval_split: str | None = None,
    task: str = "add",
    **fields,
) -> tuple[list, list]:
    """(train, eval): the built-in `task`, or --dataset and --eval-dataset, its --eval-split, or its last rows."""
    if dataset is None:
        train, held_out = builtin_splits(task, eval_size)
        if not train:
            raise UsageError(
                f"--eval-size {eval_size}: the built-in task has {len(held_out)} prompts, so none "
                "would be left to train on. Hold out fewer (the default is 500)."
            )
        return train, held_out
    if split != "train" and is_jsonl(dataset, dataset_config):
        raise UsageError(
            f"--split {split}: {dataset!r} is a JSONL file, which has no splits. Leave --split out, or "
            "pass a dataset that has them."
        )
    if eval_split is not None and is_jsonl(eval_dataset or dataset, None if eval_dataset else dataset_config):
        if eval_dataset:
            why = ". Leave --eval-split out."
        else:
            why = (
                ": the held-out rows would be the training rows. Pass --eval-dataset with a file of held-out rows, or "
                "leave --eval-split out to hold out the last --eval-size rows."
            )
        raise UsageError(
            f"--eval-split {eval_split}: {eval_dataset or dataset!r} is a JSONL file, which has no splits{why}"
        )
    train = load_rows(dataset, "--dataset", dataset_config, split, **fields)
    if eval_dataset is not None or eval_split is not None:
        held_out = load_rows(
            eval_dataset or dataset,
            "--eval-dataset" if eval_dataset else "--dataset",
            None if eval_dataset else dataset_config,
            eval_split,
            **fields,
        )
        if held_out == train:  # the same file, or the split trained on, given again: accuracy on the training rows
            named = (
                f"--eval-dataset {eval_dataset!r}"
                if eval_dataset
                else f"--eval-split {eval_split}: the split {eval_split!r} of {dataset!r} is the one trained on"
            )
            raise UsageError(
                f"{named}: the held-out rows would be the training rows. Pass --eval-dataset with other "
                "rows, another --eval-split, or neither (the last --eval-size rows are held out)."
            )
        return train, held_out
    if len(train) <= eval_size:
        raise UsageError(
            f"--dataset {dataset!r} has {len(train)} rows, too few to hold out --eval-size {eval_size}. "
            "Pass --eval-dataset or --eval-split, or a smaller --eval-size."
        )
    return train[: len(train) - eval_size], train[len(train) - eval_size :]  # eval_size 0: all rows train


@dataclasses.dataclass
class Task:
    """What a run trains and evaluates on, and how it scores them: `load_task`'s, made before any model loads."""

    tokenizer: transformers.PreTrainedTokenizerBase
    train: list[dict]  # the training rows whose prompts fit the model (`fit_prompts`)
    held_out: list[dict]  # the rows evaluated on
    exact_match: bool  # answers compared as text after '####' (the built-in tasks), else by `math_reward`
    reward_fn: Callable | None  # --reward-fn, tried on two rows; None without it
    env: object | None  # --env's episodes (episodes.py's `MultiTurn`); None: single-turn


def load_task(args) -> Task:
    """The tokenizer, the examples that fit the model (`fit_prompts`), --reward-fn (tried) and --env, before any model
    loads: bad input stops before a minute of loading. Sets args.max_sequence_length (the vLLM engine's context)."""
    tokenizer = load_tokenizer(args.model)
    system = {"role": "system", "content": args.system_prompt}
    if not args.chat_template:
        no_chat = "--no-chat-template turns it off. Leave --no-chat-template out"
    elif not tokenizer.chat_template:
        no_chat = f"--model {args.model} has none. Pass a --model that has one"
    else:
        no_chat = ""  # the chat template renders messages
    if args.system_prompt is not None and no_chat:
        raise UsageError(
            f"--system-prompt {args.system_prompt!r}: a system message needs the chat template; "
            f"{no_chat}, or leave --system-prompt out."
        )
    if args.system_prompt is not None:  # a template may refuse a system role (Gemma 2's): one line, not a traceback
        try:
            format_prompt(tokenizer, [system, {"role": "user", "content": "1"}], True)
        except Exception as error:
            raise UsageError(
                f"--system-prompt {args.system_prompt!r}: the chat template of --model {args.model} "
                f"refuses it: {str(error).rstrip('.')}."
            ) from None
    train, held_out = load_data(
        args.dataset,
        args.eval_dataset,
        args.eval_size,
        args.dataset_config,
        args.split,
        args.eval_split,
        args.task or "add",
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        no_chat=no_chat,
    )
    if args.system_prompt is not None:  # before each prompt that has none
        for row in train + held_out:
            messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else row["prompt"]
            row["prompt"] = messages if messages[0]["role"] == "system" else [system, *messages]
    reward_fn = None
    if args.reward_fn:  # fn(prompts, completions, answers) -> a float each: tried now, two rows' answers as completions
        reward_fn = load_object(args.reward_fn, "--reward-fn", "function")
        prompts, answers = [e["prompt"] for e in train[:2]], [e["answer"] for e in train[:2]]
        call_reward_fn(reward_fn, args.reward_fn, prompts, answers, answers)
    train, held_out, limit, longest = fit_prompts(train, held_out, tokenizer, args)
    first = limit[0] if args.env else longest  # an episode's first message is any that fits
    args.max_sequence_length = int(first + args.max_new_tokens) if math.isfinite(first) else 0  # 0: the model's
    env = None
    if args.env:
        episodes = companion("episodes", "--env")
        env = episodes.MultiTurn(
            load_object(args.env, "--env", "class"), args.env, args.max_turns, args.chat_template, limit
        )
        if isinstance(env.env_class, type):  # (a function's environments: checked as it makes them)
            episodes.env_output(env, "class", lambda: env.env_class)
    seed = args.seed + int(os.environ.get("RANK", 0))
    random.seed(seed)  # an environment's draws (random, numpy): seeded per rank, as the sampling is
    np.random.seed(seed % 2**32)
    return Task(tokenizer, train, held_out, args.dataset is None, reward_fn, env)


def fit_prompts(train: list[dict], held_out: list[dict], tokenizer, args) -> tuple[list, list, tuple, int]:
    """The examples whose formatted prompt is not empty, has at most --max-prompt-length tokens and leaves room for
    --max-new-tokens in the model's positions (else a crash, or untrained positions), that limit (tokens, why) and the
    longest prompt kept (tokens)."""
    positions = model_positions(args.model)
    limit = min(args.max_prompt_length or math.inf, positions - args.max_new_tokens if positions else math.inf)
    if limit < 1:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
            f"{positions} positions. Lower --max-new-tokens."
        )
    why = (
        f"longer than --max-prompt-length {limit} tokens"
        if limit == args.max_prompt_length
        else f"longer than {limit} tokens (the model takes {positions} positions, --max-new-tokens of them)"
    )
    fitted, longest = [], 0
    # Where a row is, for a message: its source and number there (--dataset's held-out rows are its last ones)
    source = f"--dataset {args.dataset}" if args.dataset else "the built-in task"
    held_source = f"--eval-dataset {args.eval_dataset}" if args.eval_dataset else source
    held_first = 1 if args.eval_dataset or args.eval_split else len(train) + 1
    for examples, what, where, first in (
        (train, "training data", source, 1),
        (held_out, "held-out data", held_source, held_first),
    ):
        texts = []
        for i, e in enumerate(examples, first):
            try:
                texts.append(format_prompt(tokenizer, e["prompt"], args.chat_template))
            except Exception as error:  # the template's own refusal (jinja2's raise_exception): its message
                raise UsageError(
                    f"{where}: row {i}: the chat template of --model {args.model} refuses its prompt: "
                    f"{str(error).rstrip('.')}."
                ) from None
        once = list(dict.fromkeys(texts))  # each text tokenized once: DAPO-Math-17k repeats each of its problems
        try:
            lengths = dict(zip(once, map(len, tokenizer(once, add_special_tokens=False).input_ids))) if once else {}
        except Exception as e:  # the default tiny model's tokenizer knows only the built-in tasks' characters
            raise UsageError(
                f"--model {args.model}: its tokenizer cannot encode the {what} ({e}). Pass a --model "
                "whose tokenizer covers your data."
            ) from None
        fits = [0 < lengths[text] <= limit and not is_blank(e["prompt"]) for e, text in zip(examples, texts)]
        fitted.append([e for e, fit in zip(examples, fits) if fit])
        longest = max([longest, *(n for n in lengths.values() if n <= limit)])
        if examples and not fitted[-1]:
            raise UsageError(
                f"{what}: all {len(examples)} prompts are empty or {why}. Raise --max-prompt-length, "
                "or lower --max-new-tokens."
            )
        if len(fitted[-1]) < len(examples):
            print0(
                f"{what}: dropped {len(examples) - len(fitted[-1])} of {len(examples)} prompts that are empty or {why}"
            )
        prefills = sum(isinstance(e["prompt"], list) and e["prompt"][-1]["role"] == "assistant" for e in fitted[-1])
        if prefills:  # continued, not answered: SFT data's `messages` end with the gold answer (docs/data.md)
            print0(
                f"{what}: {prefills} of {len(fitted[-1])} prompts end with the assistant's message, continued (a "
                "prefill: where it is a gold answer, as in SFT data's messages, name the prompt's field instead)"
            )
    return fitted[0], fitted[1], (limit, why), longest


def is_blank(prompt: str | list[dict]) -> bool:
    """A prompt with no question: blank text, or messages whose every content but the system's is blank."""
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt if m["role"] != "system"]
    return not any(text.strip() for text in texts)


def load_object(spec: str, flag: str, kind: str):
    """What `spec` names: `module:name`, imported from the working directory, or `path/to/file.py:name`."""
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise UsageError(f"{flag} {spec!r}: expected 'module:{kind}' or 'file.py:{kind}'.")
    ours = getattr(sys.modules.get(module_name.partition(".")[0]), "__file__", None)  # e.g. this project's harness
    if not module_name.endswith(".py") and ours and Path(ours).resolve().parent == HERE:  # a user's file of that name
        raise UsageError(
            f"{flag} {spec!r}: {module_name!r} is a module of this project; pass your file as "
            f"path/to/{module_name}.py:{fn_name}, or rename it."
        )
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
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"{flag} {spec!r}: {module_name!r} has no {kind} {fn_name!r}.")
    return fn


# 5. The sampler -----------------------------------------------------------------------------------------------------


def companion(module: str, flag: str):
    """A module beside this file that only `flag` needs (episodes.py, vllm_engine.py), imported when it is given."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:  # a package it imports (vllm) is missing: its own message says which
            raise
        raise UsageError(f"{flag} needs {module}.py, beside harness.py: copy it too.") from None


def load_vllm(args, rank: int, optimizer):
    """--vllm's engine (vllm_engine.py, imported only with the flag), seeded per rank, or None. It gets the policy's
    weights one tensor at a time (`plain_weights`) in its dtype after each optimizer step."""
    if not args.vllm:
        return None
    engine = companion("vllm_engine", "--vllm").VllmEngine
    dtype = compute_dtype(args.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return engine(
        args.model,
        dtype,
        args.seed + rank,
        optimizer,
        plain_weights,
        args.vllm_gpu_memory,
        args.vllm_keep_weights,
        args.max_sequence_length or None,
        args.lm_head_fp32,
    )


# 6. Run folder ------------------------------------------------------------------------------------------------------
CHECKPOINT_INFO = "checkpoint.json"  # in every checkpoint folder: the file, step, ranks and flags that wrote it
TRAINING_STATE = "training_state"  # the resumable state: torch.distributed.checkpoint's safetensors shards
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP's, at each save on one process
RUN_LOCK = ".run.lock"  # in every run folder; locked (flock) by the process that writes into the folder
NOT_COMPARED = ("resume", "run_name", "output_dir")  # flags that differ between a run and its resumption
_held_locks = {}  # run folder -> its open lock file, held by this process until it ends


def prepare_run_dir(run_info: dict, rank: int) -> tuple[Path, Path | None]:
    """(run folder, checkpoint to resume from or None) on every rank, writing nothing; run_info: {"algorithm": the
    file, "config": asdict(args)}. <output-dir>/<run-name>, or <run> for --resume <run>/step_N, its newest, alone."""
    return _on_rank_0(_find_run_dir, rank, run_info)


def claim_run_dir(run_dir: Path, checkpoint: Path | None, rank: int) -> None:
    """Take run_dir, created and locked (flock: a second run there stops), metrics.jsonl cut to the checkpoint's step
    (the rest moved aside), seen by every rank; from here a Ctrl-C prints how to go on, not a traceback."""
    token = _on_rank_0(_claim, rank, run_dir, checkpoint)
    _every_rank_sees(run_dir, token)
    sys.excepthook = functools.partial(_explain_interrupt, sys.excepthook, run_dir, rank)


def _every_rank_sees(run_dir: Path, token: str) -> None:
    """Stop (on every rank) unless every rank reads in run_dir's lock file the `token` rank 0 wrote there: each rank
    writes its shards of a checkpoint into rank 0's run folder and reads them back on --resume, so the nodes of a
    run need one filesystem they all see there (not a disk of each node's own)."""
    if not dist.is_initialized():
        return
    deadline = time.monotonic() + 10  # a network filesystem may show a new file to another node a little late
    while not (sees := (run_dir / RUN_LOCK).is_file() and (run_dir / RUN_LOCK).read_text() == token):
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, sees)
    blind = [str(rank) for rank, sees in enumerate(seen) if not sees]
    if blind:
        raise UsageError(
            f"--output-dir {run_dir.parent}: rank{'s' * (len(blind) > 1)} {', '.join(blind)} cannot see "
            f"rank 0's run folder {token.split(' ', 2)[2]}. Checkpoints need one "
            "filesystem that every node sees there: each rank writes its shards into it and reads them "
            "back on --resume. Pass an --output-dir on a disk the nodes share."
        )


def _claim(run_dir: Path, checkpoint: Path | None) -> str:
    run_dir.mkdir(parents=True, exist_ok=True)
    if str(run_dir.resolve()) not in _held_locks:  # (else an earlier run in this process holds it)
        lock = open(run_dir / RUN_LOCK, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"--run-name {run_dir.name}: {run_dir} is in use by another run that is still going. "
                "Wait for it to end, or choose another --run-name."
            ) from None
        _held_locks[str(run_dir.resolve())] = lock
    _refuse_a_finished_run(run_dir, checkpoint)  # again under the lock: another run may have written since
    step, metrics = _read_info(checkpoint)["step"] if checkpoint else 0, run_dir / "metrics.jsonl"
    logged = checkpoint.parent / "metrics.jsonl" if checkpoint else metrics  # the checkpoint's run's, if any
    kept = [
        line
        for line in (logged.read_text().splitlines(keepends=True) if logged.exists() else [])
        if line.endswith("\n") and json.loads(line)["step"] < step
    ]
    lines = metrics.read_text().splitlines(keepends=True) if metrics.exists() else []
    if kept != lines:  # the new file first, so that a full disk leaves the old one as it was
        (tmp := metrics.with_name("metrics.jsonl.tmp")).write_text("".join(kept))
        if lines:
            print(
                f"{run_dir}: this run logs from step {step}; the metrics that were there are kept in "
                f"{_move_aside(metrics)}",
                flush=True,
            )
        tmp.rename(metrics)
    token = f"{os.getpid()} {time.time_ns()} {socket.gethostname()}:{run_dir.resolve()}"  # for `_every_rank_sees`
    lock = _held_locks[str(run_dir.resolve())]
    lock.truncate(0)
    lock.write(token)
    lock.flush()
    return token


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
    argv, replaced = sys.argv[1:], ("--resume", "--run-name", "--output-dir", "--run_name", "--output_dir")
    kept = [
        a for i, a in enumerate(argv) if a.split("=")[0] not in replaced and (i == 0 or argv[i - 1] not in replaced)
    ]
    world_size, nodes = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("GROUP_WORLD_SIZE", 1))
    launcher = (
        ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={world_size // nodes}"] if world_size > 1 else ["python"]
    )
    command = shlex.join(
        [
            *launcher,
            sys.argv[0],
            *kept,
            "--output-dir",
            str(run_dir.parent),
            "--run-name",
            run_dir.name,
            "--resume",
            "latest",
        ]
    )
    return f"Last checkpoint: {checkpoint}. Go on from it with: {command}" + (
        " (on every node, with its rendezvous flags)" if nodes > 1 else ""
    )


def _on_rank_0(fn, rank: int, *args):
    """fn(*args) on rank 0, its result (or its usage or OS error, as a UsageError) on every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn(*args)
        except (UsageError, OSError) as stop:
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
    resume, run_name = config["resume"], config["run_name"]
    output = Path(config["output_dir"])
    run_dir = output / (
        run_name  # the process id tells apart runs of a sweep started in the same second
        or f"{Path(run_info['algorithm']).stem}__{config['seed']}__{int(time.time())}__{os.getpid()}"
    )
    checkpoint = None
    if resume == "latest":
        if run_name is None:
            raise UsageError("--resume latest continues the run named by --run-name: pass it.")
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise UsageError(
                f"--resume latest: no checkpoint under {run_dir}. Pass the --run-name of a run saved with "
                "--save-every, or a checkpoint folder; or run it again without --resume."
            )
    elif resume:
        checkpoint = Path(resume)
        if not _read_info(checkpoint).get("resumable"):
            raise UsageError(
                f"--resume {resume}: not a resumable checkpoint (no {CHECKPOINT_INFO} of a step one). "
                "Pass a <run>/step_N folder written by --save-every, or 'latest' with --run-name."
            )
        if run_name is None and (checkpoint.parent / RUN_LOCK).exists() and _newest(checkpoint.parent, checkpoint):
            run_dir = checkpoint.parent  # a run folder's newest checkpoint: that run goes on
    if checkpoint is not None:
        _check_same_run(checkpoint, run_info)
    _refuse_a_finished_run(run_dir, checkpoint)
    return run_dir, checkpoint


def _newest(run_dir: Path, checkpoint: Path | None) -> bool:
    """Whether `checkpoint` is the newest checkpoint of run_dir: a resume from it goes on in run_dir."""
    newest = latest_checkpoint(run_dir) if checkpoint is not None else None
    return newest is not None and newest.resolve() == checkpoint.resolve()


def _refuse_a_finished_run(run_dir: Path, checkpoint: Path | None) -> None:
    """A run writes into a folder that holds checkpoints or final/ only to go on from its newest checkpoint."""
    if not _newest(run_dir, checkpoint) and (_step_folders(run_dir) or (run_dir / "final").exists()):
        go_on = "Continue it with --resume latest, or choose" if latest_checkpoint(run_dir) else "Choose"
        raise UsageError(
            f"--run-name {run_dir.name}: {run_dir} already holds a run. {go_on} another --run-name or --output-dir."
        )


def _move_aside(path: Path) -> Path:
    """Rename `path` to the first of `<path>.old`, `<path>.old.2`, ... that does not exist yet."""
    k, aside = 1, path.with_name(f"{path.name}.old")
    while aside.exists():
        k, aside = k + 1, path.with_name(f"{path.name}.old.{k + 1}")
    return path.rename(aside)


def _read_info(checkpoint: Path) -> dict:
    """The checkpoint.json of a checkpoint folder ({} when there is none: not a checkpoint of this project)."""
    file = Path(checkpoint) / CHECKPOINT_INFO
    return json.loads(file.read_text()) if file.is_file() else {}


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The resumable checkpoint of the highest step in run_dir (never a half-written `step_N.tmp`)."""
    return next((p for p in reversed(_step_folders(run_dir)) if _read_info(p).get("resumable")), None)


def _step_folders(run_dir: Path) -> list[Path]:
    """run_dir's step_N folders (never step_N.tmp), by step."""
    found = [p for p in Path(run_dir).glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _check_same_run(checkpoint: Path, run_info: dict) -> None:
    """Stop if another file or number of ranks wrote the checkpoint, or it is past --num-steps; print changed flags."""
    saved, config = _read_info(checkpoint), run_info["config"]
    if saved["algorithm"] != run_info["algorithm"]:
        raise UsageError(
            f"--resume {checkpoint}: written by {saved['algorithm']}, resumed by "
            f"{run_info['algorithm']}. Resume it with {saved['algorithm']}, or start "
            f"{run_info['algorithm']} from its weights with --model {checkpoint}."
        )
    if saved["world_size"] != config["world_size"]:
        raise UsageError(
            f"--resume {checkpoint}: written by {saved['world_size']} rank(s), resumed on "
            f"{config['world_size']}. Resume with --nproc_per_node={saved['world_size']} (each rank's "
            f"sampling and algorithm state are its own), or start anew with --model {checkpoint}."
        )
    if saved["step"] > config["num_steps"]:  # at --num-steps, what is left runs: the final evaluation and final/
        raise UsageError(
            f"--num-steps {config['num_steps']}: the checkpoint {checkpoint} is at step {saved['step']}. "
            f"Pass --num-steps {saved['step']} or more to go on from it."
        )
    changed = [
        f"--{key.replace('_', '-')} {saved['config'][key]!r} -> {value!r}"
        for key, value in config.items()
        if key not in NOT_COMPARED and key in saved["config"] and saved["config"][key] != value
    ]
    if changed:
        print(f"--resume {checkpoint}: flags changed since the checkpoint: {', '.join(changed)}", flush=True)


# 7. Checkpoints -----------------------------------------------------------------------------------------------------
def save_checkpoint(
    path: Path,
    modules: dict[str, torch.nn.Module],
    tokenizer,
    rank: int,
    run_info: dict,
    optimizer=None,
    step: int = 0,
    extra: dict | None = None,
    keep: int = 0,
) -> None:
    """Write a checkpoint folder (on every rank): the policy and tokenizer by `save_pretrained` (FSDP: gathered; LoRA:
    adapter/, in final/ merged too), checkpoint.json; with an optimizer the resumable state: weights and optimizer in
    training_state/ (DCP: each rank its shards), each rank's RNG and `extra` in rank_<r>.safetensors. Written into
    `<path>.tmp`, renamed once all is synced (a crash leaves no partial `path`); `keep` > 0: the newest `keep` steps."""
    path, distributed = Path(path), dist.is_initialized()
    tmp = path.with_name(path.name + ".tmp")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a .tmp folder is always this project's, left by a crash
            tmp.mkdir(parents=True)
        if distributed:
            dist.barrier()  # the folder exists before any rank writes into it
        if optimizer is not None:
            _save_training_state(tmp, modules, optimizer, rank, extra)
        policy = modules["policy"]
        hf_model, lora = unwrap(policy), is_lora(policy)
        # On rank 0's host, one tensor at a time (FSDP: each gathered, every rank taking part): a LoRA run's adapters,
        # and the model (LoRA: merged, in final/ only) in its checkpoint's dtype, not the fp32 it was trained in
        adapters = (
            {key: whole(value).cpu() for key, value in hf_model.state_dict().items() if ".lora_" in key} if lora else {}
        )
        dtype, weights = checkpoint_dtype(run_info["config"]["model"]), {}
        exported = not lora or optimizer is None  # the model: in final/, and in a step's folder but a LoRA run's
        if exported and (rank == 0 or isinstance(hf_model, FSDPModule)):  # FSDP's gathers: every rank, rank 0 keeps
            weights = {
                name: value for name, value in plain_weights(policy, dtype, "cpu" if rank == 0 else None) if rank == 0
            }
        if rank == 0:
            if lora:
                hf_model.save_pretrained(tmp / "adapter", state_dict=adapters)
            if weights:
                plain = hf_model.get_base_model() if lora else hf_model
                plain.save_pretrained(tmp, state_dict=weights)
                plain.config.dtype = dtype  # save_pretrained wrote the dtype of the weights held (fp32) in config.json
                plain.config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            info = {
                "algorithm": run_info["algorithm"],
                "step": step,
                "resumable": optimizer is not None,
                "world_size": dist.get_world_size() if distributed else 1,
                "config": run_info["config"],
            }
            (tmp / CHECKPOINT_INFO).write_text(json.dumps(info, indent=2, default=str))
            for file in [*tmp.rglob("*"), tmp]:  # on disk before the rename that publishes it
                os.fsync(fd := os.open(file, os.O_RDONLY))
                os.close(fd)
        del weights
        if distributed:
            dist.barrier()  # every rank has written its part
        if rank == 0:
            if path.exists():
                print(f"moved the earlier {path} aside to {_move_aside(path)}", flush=True)
            tmp.rename(path)
    except BaseException as error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        failures = [f for f, *_ in error.failures.values()] if isinstance(error, dcp.CheckpointException) else []
        if any(isinstance(failure, KeyboardInterrupt) for failure in failures):
            raise KeyboardInterrupt from None  # a Ctrl-C that DCP's writer caught is a Ctrl-C
        failure = (failures or [error])[0]
        if isinstance(failure, OSError) or "(os error" in str(failure):  # (safetensors' I/O errors come from Rust)
            trained = [p for m in modules.values() for p in m.parameters() if p.requires_grad] if optimizer else []
            size = sum(t.numel() * t.element_size() for t in [*modules["policy"].parameters(), *trained * 3])  # Adam: 2
            raise OSError(
                f"cannot write {path}: {failure} (a checkpoint here takes about {size / 2**20:.1f} MiB; "
                f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB are free)"
            ) from None
        raise
    if rank == 0 and keep > 0:
        for old in [p for p in _step_folders(path.parent) if _read_info(p).get("resumable")][:-keep]:
            shutil.rmtree(old)


def _save_training_state(tmp: Path, modules: dict[str, torch.nn.Module], optimizer, rank: int, extra: dict | None):
    state = _training_state(modules, optimizer)
    # A weight and its optimizer state in a file of their own: safetensors builds a whole file in memory
    # before writing it, so a save needs twice the largest weight's state, not the rank's.
    number = {name: i for i, name in enumerate(dict.fromkeys([*state["model"], *state["optimizer"]]), 1)}
    files = {f"model.{name}": number[name] for name in state["model"]}
    files |= {f"optimizer.{name}.{key}": number[name] for name, values in state["optimizer"].items() for key in values}
    writer = dcp.HuggingFaceStorageWriter(str(tmp / TRAINING_STATE), files, save_distributed=dist.is_initialized())
    dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    own = {
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "extra": extra or {},
    }
    plain = json.dumps(_flatten(own, tensors := {}, "own"))  # the tensors go into `tensors`, the rest stays
    (tmp / f"rank_{rank}.safetensors").write_bytes(safetensors_bytes(tensors, {"state": plain}))


def _training_state(modules: dict[str, torch.nn.Module], optimizer) -> dict:
    """The resumable state: trained weights (LoRA: adapters; FSDP: this rank's shards; tied ones once), optimizer's."""
    model = torch.nn.ModuleDict(modules)  # names the tensors "policy.<...>", "critic.<...>"

    def where(tensor: torch.Tensor) -> tuple | None:  # None for an empty shard
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return (
            (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) if local.numel() else None
        )

    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    weights, seen = {}, {where(p) for p in model.parameters() if not p.requires_grad} - {None}
    for name, tensor in dcp_state.get_model_state_dict(model).items():  # a tied or frozen weight under another name too
        if name not in frozen and (where(tensor) is None or where(tensor) not in seen):
            weights[name] = tensor
        seen.add(where(tensor))
    return {"model": weights, "optimizer": dcp_state.get_optimizer_state_dict(model, optimizer)["state"]}


def _flatten(value, tensors: dict, key: str):
    """`value` (lists, dicts, Rollouts) as JSON, each tensor {"tensor": its key in `tensors`}; `_unflatten`: back."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().cpu().clone()
        return {"tensor": key}
    if isinstance(value, Rollout):
        return {"rollout": _flatten(dict(vars(value)), tensors, key)}
    if isinstance(value, dict):
        return {"dict": {k: _flatten(v, tensors, f"{key}.{k}") for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, tensors, f"{key}.{i}") for i, v in enumerate(value)]
    return value.tolist() if isinstance(value, np.ndarray) else value  # NumPy's RNG key: 624 integers


def _unflatten(value, tensors: dict):
    if isinstance(value, list):
        return [_unflatten(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, inner),) = value.items()  # {"tensor": key}, {"rollout": fields} or {"dict": items}
    if kind == "tensor":
        return tensors[inner]
    if kind == "rollout":
        return Rollout(**_unflatten(inner, tensors))
    return {k: _unflatten(v, tensors) for k, v in inner.items()}


def load_checkpoint(path: Path | None, modules: dict[str, torch.nn.Module], optimizer, rank: int) -> tuple[int, dict]:
    """Restore what `save_checkpoint` wrote, in place, and this rank's RNG: (the step to go on from, its algo state);
    (0, {}) for None. Nothing is unpickled. As many ranks as saved: a rank's sampling and state are its own."""
    if path is None:
        return 0, {}
    model = torch.nn.ModuleDict(modules)
    state = _training_state(modules, optimizer)
    device = current_device()
    try:
        dcp.load(
            state,
            storage_reader=dcp.HuggingFaceStorageReader(str(path / TRAINING_STATE)),
            no_dist=not dist.is_initialized(),
        )
        options = dcp_state.StateDictOptions(strict=False)  # strict would miss the tied weights, saved once
        dcp_state.set_model_state_dict(model, state["model"], options=options)
        groups = dcp_state.get_optimizer_state_dict(model, optimizer)["param_groups"]  # the flags' learning rate, ...
        dcp_state.set_optimizer_state_dict(model, optimizer, {"state": state["optimizer"], "param_groups": groups})
        with safe_open(path / f"rank_{rank}.safetensors", "pt") as opened:
            # The algorithm's state to the device. The RNG states stay on the CPU, and so do the sampler's versions of
            # the trained weights (--off-policy-steps K): K copies at once would not fit on the GPU beside the model
            tensors = {}
            for key in opened.keys():  # ("sampler_weights": common.SamplerWeights's key in the algorithm's state)
                on_host = not key.startswith("own.extra.") or key.startswith("own.extra.sampler_weights.")
                tensors[key] = opened.get_tensor(key).to("cpu" if on_host else device)
            own = _unflatten(json.loads(opened.metadata()["state"]), tensors)
    except (Exception, dcp.CheckpointException) as error:  # a shape that does not fit, a damaged file, ...
        if isinstance(error, dcp.CheckpointException) and error.failures:  # DCP gathers each rank's failure
            error = next(iter(error.failures.values()))[0]
        text = " ".join(str(error).split()) or type(error).__name__
        raise UsageError(f"--resume {path}: cannot restore it: {text[:400]}") from None
    torch.set_rng_state(own["rng"])
    version, internal, gauss = own["python_rng"]
    random.setstate((version, tuple(internal), gauss))  # an environment's draws, and code you add
    np.random.set_state(tuple(own.get("numpy_rng", np.random.get_state())))  # (older checkpoints: as seeded)
    if own["cuda_rng"] is not None:
        torch.cuda.set_rng_state(own["cuda_rng"])
    print0(f"resumed from {path}")
    return _read_info(path)["step"], own["extra"]


# 8. A step that cannot be taken -------------------------------------------------------------------------------------
def clip_grad_norm(parameters, max_norm: float, step: int, run_dir: Path) -> torch.Tensor:
    """`clip_grad_norm_`'s total norm (FSDP: whole); not finite (on every rank), the run stops before the step."""
    norm = whole(torch.nn.utils.clip_grad_norm_(parameters, max_norm))
    if not torch.isfinite(norm):
        raise UsageError(
            f"step {step}: non-finite gradient norm ({norm.item()}); stopped before the optimizer step. "
            f"Try a lower learning rate, or check --reward-fn. {resume_hint(run_dir)}"
        )
    return norm


# 9. Logging ---------------------------------------------------------------------------------------------------------


class Logger:
    """A step's metrics over ranks (rank 0 writes): stdout, metrics.jsonl (NaN: null), TensorBoard, W&B; config.json."""

    SHOWN = ("reward/mean", "eval/accuracy", "eval/accuracy_greedy", "loss/policy", "policy/clipfrac", "perf/step_s")

    def __init__(self, run_dir: Path, config: dict, rank: int, track: bool = False, num_steps: int | None = None):
        self.enabled = rank == 0  # rank 0 writes; every rank takes part in the all-reduce
        self.num_steps = num_steps
        self.start, self.first_step = time.perf_counter(), None  # for the ETA
        self.wandb, self.tensorboard = None, None
        self.closing = contextlib.ExitStack()  # what close() ends
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
        print(
            json.dumps({"step": step, **{k: v if math.isfinite(v) else None for k, v in metrics.items()}}),
            file=self.file,
            flush=True,
        )
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
