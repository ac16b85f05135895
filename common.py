"""Shared plumbing of the algorithm files: start-up checks, distributed set-up, metrics, generation and
log-probs. Nothing here appears in an algorithm's equations: advantages, ratios, clipping, KL and loss
aggregation live in each algorithm file. The rest of the plumbing: models.py (loading and sharding),
data.py (datasets and prompts), rewards.py (rewards and evaluation), runs.py (the run folder: metrics
log and checkpoints)."""

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, GenerationConfig, LogitsProcessor
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


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
]
INFINITE_ALLOWED = {"max_grad_norm"}  # float flags where inf means something (no clipping); any other must be finite


def cli(args_class, args: list[str] | None = None):
    """tyro.cli for an Args made of flag groups (its dataclass bases): `--help` shows each group under its
    name ("Model & data options"), and the flags and Args stay flat (--seed, args.seed)."""
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
    longest = os.pathconf(existing, "PC_NAME_MAX") - 15  # the run folder is first created as .<name>.claim-<pid>
    if args.run_name is not None and len(args.run_name.encode()) > longest:
        raise UsageError(f"--run-name: {len(args.run_name.encode())} bytes, longer than the {longest} that a folder "
                         "name may have here. Choose a shorter one.")
    if not existing.is_dir():
        raise UsageError(f"--output-dir {args.output_dir}: {existing} is a file, not a folder. Pass a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {args.output_dir}: {existing} is not writable by this user. Pass a folder you "
                         "can write to.")
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
# Distributed
# ---------------------------------------------------------------------------------------------


def setup_distributed(timeout_minutes: float = 60) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment; a plain `python x.py` is rank 0 of 1.
    A collective that waits longer than `timeout_minutes` for another rank (one that died, or one still
    generating or scoring) fails; the message then names --dist-timeout."""
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
    """The last call of a distributed run, once main has returned (its DDP wrappers and sharded models
    freed): wait for every rank, since rank 0 may still be writing the checkpoint, then tear the process
    group down. On CPU the process then ends at once, without Python's interpreter teardown: gloo's
    worker threads outlive destroy_process_group when anything still holds the group (after FSDP,
    torch's DTensor caches hold its device mesh), and one still releasing the last collective's tensors
    needs the GIL; during teardown that aborts the process ('terminate called without an active
    exception', exit code -6: about one two-rank run of benchmarks/checkpoint_memory.py in six on a busy
    2-core machine)."""
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


def all_reduce_mean(metrics: dict[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Scalar metrics (floats or 0-dim tensors) averaged over ranks, so that what rank 0 logs describes the
    whole step: one all-reduce and one device-to-host copy for all of them."""
    if not metrics:
        return {}
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach() for v in metrics.values()])
    if dist.is_initialized():
        values = all_reduce_sum(values) / dist.get_world_size()
    return dict(zip(metrics, values.tolist()))


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def mean_metrics(dicts: list[dict[str, float | torch.Tensor]]) -> dict[str, float | torch.Tensor]:
    """Average each key over the dicts that have it (e.g. per-micro-batch metrics of a step)."""
    keys = dict.fromkeys(key for d in dicts for key in d)
    return {key: sum(d[key] for d in dicts if key in d) / sum(key in d for d in dicts) for key in keys}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the positions where mask is 1 (0 when there are none), without gradient."""
    return ((x * mask).sum() / mask.sum().clamp(min=1)).detach()


def rollout_metrics(rewards: torch.Tensor, components: dict[str, torch.Tensor], rollout) -> dict[str, torch.Tensor]:
    """reward/mean, /std and each component's mean, and response/length_mean and /truncated_frac, of this
    rank's completions, as tensors (`all_reduce_mean` averages them over ranks)."""
    lengths = rollout.response_mask.sum(-1)
    return {"reward/mean": rewards.mean(), "reward/std": rewards.std(),
            **{f"reward/{name}": value.mean() for name, value in components.items()},
            "response/length_mean": lengths.mean(), "response/truncated_frac": rollout.truncated.float().mean()}


def perf_metrics(times: dict[str, float], step_start: float, rollout, device: torch.device
                 ) -> dict[str, float | torch.Tensor]:
    """perf/step_s (since `step_start`), perf/<name>_s for each timed section, perf/tokens_per_s (this rank's
    response tokens: all_reduce_mean's average times the ranks is the whole step's) and perf/peak_mem_gb."""
    step_s = time.perf_counter() - step_start
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return {"perf/step_s": step_s, **{f"perf/{name}_s": seconds for name, seconds in times.items()},
            "perf/tokens_per_s": rollout.response_mask.sum() * world_size / step_s,
            "perf/peak_mem_gb": peak_memory_gb(device)}


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or this process's peak resident memory on CPU."""
    return (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) / 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident memory: /proc's VmHWM where there is one, since Linux carries
    `ru_maxrss` over fork and exec, so that a process started by a larger one reports the other's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS: rough


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return getattr(model, "module", model)


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


class Sampler(LogitsProcessor):
    """Sampling's only logits processor, run in transformers' greedy loop: it draws each row's token from
    softmax(logits / T) (torch.multinomial), keeps the token's log-probability under that distribution, and
    returns scores that are 0 at the drawn token and -inf elsewhere, which the greedy step then takes. So
    the recorded log-prob is that of the distribution the token was drawn from, whatever else transformers
    does around the processor."""

    def __init__(self, temperature: float):
        self.temperature, self.logprobs = temperature, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = (scores / self.temperature).log_softmax(-1)  # (B, V)
        tokens = torch.multinomial(logprobs.exp(), 1)  # (B, 1)
        self.logprobs.append(logprobs.gather(-1, tokens).squeeze(-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, tokens, 0.0)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], group_size: int, max_new_tokens: int, temperature: float,
             greedy: bool = False) -> Rollout:
    """Sample `group_size` completions for each prompt text (already formatted) with `model.generate`.

    Sampling is plain softmax(logits / T), the distribution that every loss here assumes (greedy:
    argmax), whatever the checkpoint's generation_config.json holds: the generation configuration is
    built here in full, taking only the EOS, pad and BOS ids from the checkpoint. transformers would
    otherwise merge each field left unset (repetition_penalty, min_p, top_k 50, no_repeat_ngram_size,
    min_new_tokens, suppress_tokens, ...) from `model.generation_config`, so that one is swapped out for
    the call (and kept for saving). The tokens are drawn by `Sampler`, which records the log-prob of each
    under the distribution it drew from, so that the gap to the trainer's can be logged."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    prompt_ids = enc.input_ids.repeat_interleave(group_size, dim=0)
    prompt_mask = enc.attention_mask.repeat_interleave(group_size, dim=0)
    eos_ids = eos_token_ids(model, tokenizer)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=model.generation_config.bos_token_id, do_sample=False)  # Sampler draws
    sampler = Sampler(temperature)
    # Under FSDP every forward is collective: a rank whose completions all ended keeps stepping with
    # the others (synced_gpus) instead of leaving them waiting for its shards.
    synced = dist.is_initialized() and isinstance(unwrap(model), FSDPModule)
    checkpoint_config, model.generation_config = model.generation_config, config
    try:
        cache = shared_prompt_cache(model, enc.input_ids, enc.attention_mask, group_size)
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                             logits_processor=None if greedy else [sampler], synced_gpus=synced, cache=cache)
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
    return Rollout(
        input_ids=torch.cat([prompt_ids, response], 1),
        attention_mask=torch.cat([prompt_mask, response_mask], 1),
        response_mask=response_mask.float(),
        prompt_length=P,
        texts=texts,
        truncated=~has_eos,
        sampler_logprobs=sampler_logprobs.masked_fill(response_mask == 0, 0.0),
    )


def shared_prompt_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int):
    """The KV cache of each prompt's tokens but its last, computed once per prompt and repeated for its
    `group_size` rows, for `model.generate` to go on from: it runs the last prompt token of every row
    against it, then samples. None where there is nothing to share (one row per prompt, one-token
    prompts; for an FSDP model: on some rank) or the model's cache is not plain keys and values: generate
    then runs every row's prompt."""
    if not on_every_rank(model, group_size > 1 and prompt_ids.shape[1] > 1, prompt_ids.device):
        return None
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
    cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True,
                  logits_to_keep=1).cache
    if not plain_cache(cache, ids.shape[1]):
        return None
    cache.batch_repeat_interleave(group_size)
    return cache


def on_every_rank(model, flag: bool, device: torch.device) -> bool:
    """`flag` where every rank has it, for a model whose forward is collective (DDP broadcasts its buffers,
    FSDP all-gathers its weights): the ranks must run the same forwards, or they would pair mismatched
    collectives. `flag` itself for any other model."""
    collective = isinstance(model, DistributedDataParallel) or isinstance(unwrap(model), FSDPModule)
    if not (dist.is_initialized() and collective):
        return flag
    return bool(all_reduce_min(torch.tensor(int(flag), device=device)))


def plain_cache(cache, length: int) -> bool:
    """Whether `cache` holds plain keys and values (of full or sliding-window attention) for `length`
    tokens: what can be indexed by row and extended, as sampling extends it. Not so for the states of
    linear-attention or state-space layers, nor under gradient checkpointing, where transformers drops
    the cache in each layer."""
    return (isinstance(cache, DynamicCache) and cache.get_seq_length() == length
            and all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers))


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


def response_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                           **forward_kwargs) -> torch.Tensor:
    """The last hidden states (after the final norm) that score the response tokens: (B, P+L) ids and mask
    -> (B, L, H), from columns P-1 .. P+L-2 (the state at column t predicts token t+1).

    Rows with the same prompt (a group's G completions, wherever they sit in the batch) share its forward:
    each distinct prompt runs once with the KV cache, then every row's response tokens run against its
    prompt's cached keys and values, as in sampling. Attention is causal, so a prompt's states never see
    the response: the values are those of one forward of the whole rows, and each weight's gradient is
    the same sum over the rows. With G completions of P prompt and L response tokens per prompt, a
    forward and backward process P + G L positions instead of G (P + L). The rows run whole when no prompt
    repeats (for a DDP or FSDP model: on some rank, `on_every_rank`), under gradient checkpointing in
    train mode (transformers drops the cache there), and for a model whose cache is not plain keys and
    values (linear-attention or state-space layers)."""
    P, hf_model = prompt_length, unwrap(model)
    prompts, row_prompt = torch.unique(torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                       return_inverse=True)  # (N, 2P) distinct prompts; (B,) each row's
    checkpointed = torch.is_grad_enabled() and hf_model.training and hf_model.is_activation_checkpointing
    if on_every_rank(model, len(prompts) < len(input_ids) and not checkpointed, input_ids.device):
        prompt_ids, prompt_mask = prompts[:, :P], prompts[:, P:]
        first = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids(prompt_mask),
                      use_cache=True, output_hidden_states=True, **forward_kwargs)
        cache = first.cache
        if plain_cache(cache, P):
            cache.batch_select_indices(row_prompt)  # each row's prompt keys and values; gradients add up over rows
            rest = model(input_ids=input_ids[:, P:], attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask)[:, P:], cache=cache, use_cache=True,
                         output_hidden_states=True, **forward_kwargs)
            return torch.cat([first.hidden_states[-1][row_prompt, -1:], rest.hidden_states[-1][:, :-1]], 1)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=False, output_hidden_states=True, **forward_kwargs)
    return out.hidden_states[-1][:, P - 1 : -1]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions from the mask: with left padding, each row's real tokens start at 0 (padding gets 0 too)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


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
    """Per-token log-probs of the response tokens under `model` (DDP-wrapped or not), and their entropy.

    (B, P+L) ids and mask -> logprobs (B, L) in fp32, entropy (B, L) without gradient (None unless
    `entropy`); both are 0 after EOS.
    The hidden states come from `response_hidden_states` (a prompt that rows share runs once). With
    gradients and B x L x V up to `recompute_above` logits (512 MB in fp32), the logits are kept for the
    backward pass and computed in one product: all of them are in memory anyway, and one product, with
    one LM-head weight gradient, is faster than one per chunk (benchmarks/update_parts.py). Otherwise the
    vocabulary projection runs in chunks of `chunk_size` positions, so the full (B, L, V) log-softmax
    never exists at once, and with gradients each chunk is recomputed in the backward pass; by default a
    chunk holds 2^25 logits (128 MB in fp32: 220 positions of a 151,936-token vocabulary)."""
    hidden = response_hidden_states(model, input_ids, attention_mask, prompt_length, logits_to_keep=1)  # (B, L, H)
    targets = input_ids[:, prompt_length:]  # (B, L)
    B, L, H = hidden.shape
    hidden, targets = hidden.reshape(B * L, H), targets.reshape(B * L)
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


def sampler_logprob_gap(sampler_logprobs: torch.Tensor, logprobs: torch.Tensor, response_mask: torch.Tensor
                        ) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs (B, L) of the sampled tokens are from the sampler's (B, L), over the
    response tokens of every rank: `policy/sampler_logprob_gap` (mean |difference|) and `_max`, as tensors
    (already the same on every rank). Both are ~1e-6 when the two compute the same distribution in fp32;
    a large value means the completions were not drawn from the distribution that the loss assumes."""
    mask = response_mask.bool()
    difference = torch.where(mask, (sampler_logprobs - logprobs).abs(), 0.0).double()  # (B, L)
    total = all_reduce_sum(torch.stack([difference.sum(), mask.sum().double()]))
    largest = all_reduce_max(difference.max() if difference.numel() else difference.new_zeros(()))
    return {"policy/sampler_logprob_gap": total[0] / total[1].clamp(min=1), "policy/sampler_logprob_gap_max": largest}


def no_sync(models, last: bool) -> contextlib.ExitStack:
    """Inside, backward() accumulates gradients without DDP's all-reduce for each DDP-wrapped module of
    `models`, unless this is the `last` micro-batch of the optimizer step, whose backward syncs them."""
    stack = contextlib.ExitStack()
    for model in () if last else models:
        if isinstance(model, DistributedDataParallel):
            stack.enter_context(model.no_sync())
    return stack


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str):
    """`with timed(times, "gen"): ...` adds the section's wall time to times["gen"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
