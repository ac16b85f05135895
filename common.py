"""The reading path: what an algorithm file's loop calls for its data flow, from a step's prompts to its metrics. A
reader who copies an algorithm file reads this module, and only this, to follow the loop. Nothing here appears in an
algorithm's equations: advantages, ratios, clipping, KL and loss aggregation live in each algorithm file. The run
around the loop (flags, data files, models, the run folder, checkpoints, the logger) is harness.py; multi-turn
episodes are episodes.py and the vLLM engine vllm_engine.py, objects this module is given and calls, never imports.

1. Distributed: `print0`, `all_reduce`, `all_reduce_mean`, `add_metrics`, `no_sync`, `unwrap`
2. Prompts: `format_prompt` (the chat template, a prefill continued), `prompt_batch` (this rank's share of a step)
3. Generation: `Rollout`, `generate` (`sample_hf`, or the engine or environment given), `cat_rollouts`, `select_rows`;
   `SamplerWeights` (the weights that sample, K steps behind with --off-policy-steps)
4. Rewards and evaluation: `score` (correctness as text or by `math_reward`; format; a user's function), `evaluate`
5. Log-probs and micro-batches: `get_logprobs`, `rollout_logprobs`, `micro_batches` (by a token budget)
6. Rollout correction: `rollout_weights`, `reweighted`, `sampler_logprob_gap`
7. Metrics: `step_metrics`, `timed`, `peak_memory_gb`; `UsageError` (bad input: one line naming the flag and the fix)
"""

import contextlib
import dataclasses
import functools
import itertools
import math
import random
import re
import resource
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers import GenerationConfig, LogitsProcessor

# The KV cache's name in forward's arguments and outputs: `cache` from transformers 5.20 (vLLM's CPU build: older)
CACHE = "past_key_values"
if "cache" in transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__:
    CACHE = "cache"


class UsageError(ValueError):
    """Bad input (a flag, a file, a dataset row), named with the fix: `__main__` prints one line, exits with 2."""


# 1. Distributed -----------------------------------------------------------------------------------------------------


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
    rows = []
    for value in metrics.values():
        pair = value if isinstance(value, tuple) else (value, 1)  # a plain value: counted once
        rows.append(
            torch.stack([torch.as_tensor(x, dtype=torch.float64, device=current_device()).detach() for x in pair])
        )
    pairs = torch.stack(rows)  # (number of metrics, 2)
    sums, counts = all_reduce(pairs).unbind(-1)
    return dict(zip(metrics, torch.where(counts > 0, sums / counts, 0).tolist()))


def add_metrics(totals: dict[str, tuple], metrics: dict[str, float | torch.Tensor | tuple]) -> None:
    """`metrics` (a micro-batch's) added into `totals`: (sum, count) pairs, a plain value counted once. Logged as sum /
    count over the step and ranks, a mean weighted by what it averages: the same however the rows are cut."""
    for key, value in metrics.items():
        total, count = value if isinstance(value, tuple) else (value, 1)
        old_total, old_count = totals.get(key, (0, 0))
        totals[key] = (old_total + total, old_count + count)


def no_sync(models, last: bool) -> contextlib.ExitStack:
    """Inside, backward() accumulates DDP modules' gradients without all-reduce, except on the `last` micro-batch."""
    stack = contextlib.ExitStack()
    for model in [] if last else [m for m in models if isinstance(m, DistributedDataParallel)]:
        stack.enter_context(model.no_sync())
    return stack


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return getattr(model, "module", model)


def is_lora(model) -> bool:
    return getattr(unwrap(model), "peft_config", None) is not None


def on_every_rank(model, flag: bool, device: torch.device) -> bool:
    """`flag` where every rank has it, when the forward is collective (DDP broadcasts buffers, FSDP gathers weights)."""
    collective = isinstance(model, DistributedDataParallel) or isinstance(unwrap(model), FSDPModule)
    if not (dist.is_initialized() and collective):
        return flag
    return bool(all_reduce(torch.tensor(int(flag), device=device), "min"))


# 2. Prompts ---------------------------------------------------------------------------------------------------------


def format_prompt(tokenizer, prompt: str | list[dict], chat_template: bool) -> str:
    """The text a model continues: its chat template's rendering (text: a user message) and the assistant's header, or
    where the last message is the assistant's, that message left open to be continued (a prefill, as TRL's
    continue_final_message); without the template, the text after BOS."""
    if chat_template and tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        prefill = messages[-1]["role"] == "assistant"
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=not prefill, continue_final_message=prefill, tokenize=False
        )
    return (tokenizer.bos_token or "") + prompt


def is_message(m) -> bool:
    return isinstance(m, dict) and all(isinstance(m.get(key), str) for key in ("role", "content"))


def prompt_batch(examples: list[dict], step: int, batch_size: int, rank: int, world_size: int, seed: int) -> list[dict]:
    """This rank's slice of step `step`'s global batch, in an order (a permutation per epoch, seeded by seed + epoch)
    that depends only on (seed, step): a resume is exact, and the global batch the same on any number of ranks."""
    local = batch_size // world_size
    start = step * batch_size + rank * local
    return [
        examples[_epoch_order(len(examples), seed + pos // len(examples))[pos % len(examples)]]
        for pos in range(start, start + local)
    ]


@functools.lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int) -> list[int]:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()


# 3. Generation ------------------------------------------------------------------------------------------------------


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

    return Rollout(
        torch.cat([pad(r, r.input_ids, pad_token_id) for r in rollouts]),
        torch.cat([pad(r, r.attention_mask, 0) for r in rollouts]),
        torch.cat([pad(r, r.response_mask, 0, left=False) for r in rollouts]),
        P,
        [t for r in rollouts for t in r.texts],
        torch.cat([r.truncated for r in rollouts]),
        torch.cat([pad(r, r.sampler_logprobs, 0, left=False) for r in rollouts]),
        env_return=None if rollouts[0].env_return is None else torch.cat([r.env_return for r in rollouts]),
        turns=None if rollouts[0].turns is None else torch.cat([r.turns for r in rollouts]),
    )


def select_rows(rollout: Rollout, rows: torch.Tensor) -> Rollout:
    """The rollout restricted to `rows` (indices or a boolean mask over the B rows)."""
    rows = (rows.nonzero().squeeze(-1) if rows.dtype == torch.bool else rows).to(rollout.input_ids.device)
    selected = {}
    for key, value in vars(rollout).items():
        if torch.is_tensor(value):
            value = value[rows]
        elif isinstance(value, list):  # texts
            value = [value[i] for i in rows.tolist()]
        selected[key] = value  # prompt_length, and None
    return Rollout(**selected)


class SamplerWeights:
    """The weights that sample step t's rollout with --off-policy-steps K: the policy's after step t-K, the initial ones
    for t <= K, as an asynchronous trainer's sampler runs K optimizer steps behind (K = 0: the policy as it is, nothing
    kept or copied). The trained tensors of the latest K versions stay on the host in their own dtype (float32: 4
    bytes a parameter; FSDP: each rank its shards; LoRA: the adapters), in `state`, so checkpoints carry them;
    `behind(step)` puts the due version into `model` for its block (FSDP: resharded, so that no gathered copy of
    the other weights is used; vLLM's engine: pushed at its next call), then the current one back. A sampler on
    other devices would take its weights from these versions; nothing after generation changes."""

    def __init__(self, model, steps: int, state: dict, vllm=None):
        self.model, self.steps, self.vllm = model, steps, vllm
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.versions = state.setdefault("sampler_weights", []) if steps else []  # oldest first
        self.step, self.due, self.steps_behind = None, None, 0

    @staticmethod
    def local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p  # FSDP: this rank's shard

    def load(self, version: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, saved in zip(self.trained, version):
                self.local(p).copy_(saved)
        for module in self.model.modules():  # FSDP keeps the root's gathered weights after a forward without backward
            if isinstance(module, FSDPModule):
                module.reshard()
        if self.vllm is not None:
            self.vllm.stale = True

    @contextlib.contextmanager
    def behind(self, step: int):
        if self.steps and self.step != step:  # once a step (DAPO samples in rounds): the weights now, after step t-1
            del self.versions[: max(len(self.versions) - self.steps, 0)]  # (resumed with a smaller K: the newest K)
            self.versions.append([self.local(p).detach().to("cpu", copy=True) for p in self.trained])
            self.due, self.steps_behind, self.step = self.versions[0], len(self.versions) - 1, step
            if len(self.versions) > self.steps:  # the next step's are the newest K
                self.versions.pop(0)
        if self.steps_behind == 0:
            yield
            return
        self.load(self.due)
        try:
            yield
        finally:
            self.load(self.versions[-1])


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
def generate(
    model,
    tokenizer,
    prompts: list[str] | list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    greedy: bool = False,
    vllm=None,
    env=None,
    rows: list[dict] | None = None,
) -> Rollout:
    """`group_size` completions of each prompt (text, formatted, or ids) from plain softmax(logits / T), as every loss
    here assumes (greedy: argmax), by `sample_hf` or `vllm`'s engine; with `env` (episodes.py's `MultiTurn`), `rows`'
    episodes, each prompt the first message of `group_size` of them."""
    if env is not None:
        return env.run(model, tokenizer, rows, group_size, max_new_tokens, temperature, greedy, vllm)
    ids = tokenizer(prompts, add_special_tokens=False).input_ids if isinstance(prompts[0], str) else prompts
    sample = vllm.generate if vllm is not None else sample_hf  # the responses (EOS in) and their log-probs
    responses, logprobs = sample(model, tokenizer, ids, group_size, max_new_tokens, temperature, greedy)
    eos_ids = stop_ids(model, tokenizer)
    truncated = [response[-1] not in eos_ids for response in responses]
    without_eos = [response if cut_off else response[:-1] for response, cut_off in zip(responses, truncated)]
    texts = tokenizer.batch_decode(without_eos, skip_special_tokens=True)
    return pack(
        tokenizer,
        [x for x in ids for _ in range(group_size)],
        responses,
        [[1] * len(r) for r in responses],
        logprobs,
        texts,
        truncated,
    )


def sample_hf(
    model,
    tokenizer,
    ids: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    stop: list[str] = (),
) -> tuple[list[list[int]], list[list[float]]]:
    """`model.generate`'s `group_size` responses of each prompt (up to EOS, or padded after a `stop` string) and their
    log-probs; its generation config has EOS, pad, BOS ids only (else transformers merges top_k, ... into sampling)."""
    enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(model.device)
    prompt_ids, prompt_mask = (x.repeat_interleave(group_size, dim=0) for x in (enc.input_ids, enc.attention_mask))
    eos_ids = stop_ids(model, tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=model.generation_config.bos_token_id,
        do_sample=False,  # Sampler draws
        stop_strings=list(stop) or None,
    )
    sampler = Sampler(temperature)
    synced = dist.is_initialized() and isinstance(unwrap(model), FSDPModule)  # FSDP: a rank done keeps stepping
    saved_config = model.generation_config  # the checkpoint's, restored after
    model.generation_config = config
    # One autocast region around the whole generation: fp32 weights are cast to bf16 once, not again at each token's
    # forward (autocast keeps its casts until its outermost region ends)
    dtype = getattr(unwrap(model), "compute_dtype", torch.float32)
    try:
        with torch.autocast(model.device.type, dtype=dtype, enabled=dtype != torch.float32):
            cache = None  # each prompt's keys and values but its last token's, computed once for its group's rows
            if on_every_rank(model, group_size > 1 and enc.input_ids.shape[1] > 1, model.device):
                prefix, mask = enc.input_ids[:, :-1], enc.attention_mask[:, :-1]
                out = model(
                    input_ids=prefix,
                    attention_mask=mask,
                    position_ids=position_ids(mask),
                    use_cache=True,
                    logits_to_keep=1,
                )
                kv = getattr(out, CACHE)
                if plain_cache(kv, prefix.shape[1]):  # else each row runs its prompt (linear attention, checkpointing)
                    kv.batch_repeat_interleave(group_size)
                    cache = kv
            elif synced and is_lora(model):  # peft's generate skips its root's FSDP hooks: a root forward
                model(input_ids=prompt_ids[:1, :1])  # gathers it first
            out = model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=config,
                logits_processor=None if greedy else [sampler],
                synced_gpus=synced,
                tokenizer=tokenizer if stop else None,
                **{CACHE: cache},
            )
    finally:
        model.generation_config = saved_config
    responses = out[:, prompt_ids.shape[1] :].tolist()  # (B, L), padded after EOS
    lengths = [next((t + 1 for t, token in enumerate(r) if token in eos_ids), len(r)) for r in responses]  # EOS in
    logprobs = [[0.0] * len(r) for r in responses] if greedy else torch.stack(sampler.logprobs, 1).tolist()
    return [r[:n] for r, n in zip(responses, lengths)], [lp[:n] for lp, n in zip(logprobs, lengths)]


def stop_ids(model, tokenizer) -> list[int]:
    """The tokens that end a completion: the checkpoint's EOS ids (generation_config.json) and the tokenizer's."""
    eos_ids = unwrap(model).generation_config.eos_token_id  # an id, a list of them, or None
    if isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    return sorted(set(eos_ids or []) | ({tokenizer.eos_token_id} - {None}))


def pack(
    tokenizer,
    prompts: list[list[int]],
    responses: list[list[int]],
    masks: list[list[int]],
    logprobs: list[list[float]],
    texts: list[str],
    truncated: list[bool],
    device: torch.device | None = None,
    **episodes,
):
    """A Rollout of token lists, prompts left- and responses right-padded, on `device`; `episodes`: env_return, turns"""
    P, L = max(map(len, prompts)), max(map(len, responses))  # the widest prompt, the longest response
    device = device or current_device()
    input_ids = torch.full((len(prompts), P + L), tokenizer.pad_token_id)
    attention_mask = torch.zeros_like(input_ids)
    response_mask, sampler_logprobs = torch.zeros(2, len(prompts), L)
    for i, (ids, response) in enumerate(zip(prompts, responses)):
        input_ids[i, P - len(ids) : P + len(response)] = torch.tensor(ids + response)
        attention_mask[i, P - len(ids) : P + len(response)] = 1
        response_mask[i, : len(response)] = torch.tensor(masks[i], dtype=torch.float32)
        sampler_logprobs[i, : len(response)] = torch.tensor(logprobs[i], dtype=torch.float32)
    return Rollout(
        input_ids.to(device),
        attention_mask.to(device),
        response_mask.to(device),
        P,
        texts,
        torch.tensor(truncated, device=device),
        sampler_logprobs.to(device),
        **{key: torch.tensor(value, dtype=torch.float32, device=device) for key, value in episodes.items()},
    )


def plain_cache(cache, length: int) -> bool:
    """Whether `cache` holds plain keys and values of `length` tokens, to index by row (not under checkpointing)."""
    return (
        isinstance(cache, transformers.DynamicCache)
        and cache.get_seq_length() == length
        and all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer") for layer in cache.layers)
    )


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions from the mask: with left padding, each row's real tokens start at 0 (padding gets 0 too)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


# 4. Rewards and evaluation ------------------------------------------------------------------------------------------


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
NUMBER = (
    r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # digits (commas between groups of three), decimals, then
    r"(?:[eE][-+]?\d{1,9}|\s*\\(?:times|cdot)\s*10\^(?:\{[-+]?\d{1,9}\}|\d)|/\d+)?"  # 1e3, \times 10^{3} or /4
)


def _to_number(text: str) -> Fraction | Decimal | None:
    """A plain number ('1,234,567', '-3.5', '3/4', '\\frac{3}{4}', '1.5e3', '6.02 \\times 10^{23}'), exactly, as MATH
    and GSM8K write them ('\\$18', '32,\\!348', '50\\%'), or None: '0,1' (two answers), '12 13', '10001_2' are not."""
    text = re.sub(r"\\[!,;: ]|\\?\$|\\?%", "", text.strip().rstrip(".")).replace("{,}", ",")
    text = re.sub(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$", r"\1\2/\3", text.strip())
    if len(text) > 200 or not re.fullmatch(NUMBER, text):
        return None
    text = re.sub(r"\s*\\(times|cdot)\s*10\^\{?([-+]?\d+)\}?", r"e\2", text.replace(",", ""))  # 6.02e23
    text, _, over = text.partition("/")
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
    return verify(
        parse(gold if "\\boxed" in gold or re.search(r"(?<!\\)\$", gold) else f"${gold}$", extraction),
        parse(completion if stated is None else f"\\boxed{{{stated}}}", extraction),
    )


def correctness_reward(completions: list[str], answers: list[str], exact_match: bool) -> torch.Tensor:
    """1.0 where the completion is right: its text after the last '####' is the answer (`exact_match`), else by
    `math_reward`."""
    if exact_match:
        right = [c.rsplit("####", 1)[-1].strip() == a.strip() for c, a in zip(completions, answers)]
    else:
        right = [math_reward(c, a) for c, a in zip(completions, answers)]
    return torch.tensor(right, dtype=torch.float32)


def format_reward(completions: list[str], exact_match: bool) -> torch.Tensor:
    """1.0 where the answer has the expected form: a bare number after '####' (`exact_match`), else \\boxed{} or ####
    (data)."""
    if exact_match:
        formed = [re.fullmatch(r"\s*-?\d+\s*", c.rsplit("####", 1)[-1]) is not None for c in completions]
    else:
        formed = ["\\boxed{" in c or "####" in c for c in completions]
    return torch.tensor(formed, dtype=torch.float32)


def call_reward_fn(fn, spec: str, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
    """A user reward function's values (B,), a finite float per completion, or a stop that says what it gave (its own
    calls need their own timeouts: it runs in this process)."""
    try:
        values = fn(list(prompts), list(completions), list(answers))
    except SystemExit as e:  # would end the run with its status (0 for sys.exit()), and no final/
        raise UsageError(
            f"--reward-fn {spec!r} called sys.exit({e.code}). A reward function must return its "
            "values; to stop the run, raise an exception."
        ) from None
    except Exception as e:
        raise UsageError(f"--reward-fn {spec!r} raised {type(e).__name__}: {e}") from None
    try:
        out = torch.as_tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):  # None, a dict, text: not numbers
        out = None
    if out is None or out.shape != (len(completions),) or not out.isfinite().all():
        raise UsageError(
            f"--reward-fn {spec!r} must return a list of one finite float per completion "
            f"({len(completions)}), got {repr(values)[:200]}."
        )
    return out


def score(
    examples: list[dict],
    completions: list[str],
    group_size: int,
    exact_match: bool,
    format_weight: float = 0.0,
    reward_fn=None,
    reward_fn_spec: str = "",
    env_return: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total reward (B,) = correct + format_weight * format + user reward, and each component (B,), of `group_size`
    completions of each example, stored contiguously; with an environment, `correct` is the episodes' return."""
    prompts = [e["prompt"] for e in examples for _ in range(group_size)]  # (B,) each completion's
    answers = [e["answer"] for e in examples for _ in range(group_size)]
    if env_return is None:
        components = {"correct": correctness_reward(completions, answers, exact_match)}
    else:
        components = {"correct": env_return.cpu()}
    if format_weight:
        components["format"] = format_reward(completions, exact_match)
    if reward_fn is not None:
        components["user"] = call_reward_fn(reward_fn, reward_fn_spec, prompts, completions, answers)
    rewards = components["correct"] + format_weight * components.get("format", 0.0) + components.get("user", 0.0)
    return rewards, components


@torch.no_grad()
def evaluate(
    model, task, chat_template: bool, max_new_tokens: int, seed: int, batch_size: int = 256, vllm=None
) -> dict[str, float]:
    """Accuracy on `task`'s held-out rows (harness.Task: its tokenizer, rows, exact_match and env) of a sample at T=1
    and of greedy decoding (with an env: an episode's mean return), each rank on a strided shard, its sampling seeded
    and forked: training's random state neither read nor changed."""
    tokenizer, examples, env = task.tokenizer, task.held_out, task.env
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    start, shard = time.perf_counter(), examples[rank::world_size]
    right = torch.zeros(2, dtype=torch.float64, device=model.device)
    states = random.getstate(), np.random.get_state()  # an environment's draws: seeded, restored after
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed + rank)
        random.seed(seed + rank)
        np.random.seed((seed + rank) % 2**32)
        for i in range(0, -(-len(examples) // world_size), batch_size):  # as many batches on every rank (FSDP)
            batch = shard[i : i + batch_size]
            counted = bool(batch)  # a rank whose shard has run out runs a batch too (collective forwards), uncounted
            batch = batch or examples[:1]
            prompts = [format_prompt(tokenizer, e["prompt"], chat_template) for e in batch]
            for j, greedy in enumerate((False, True)):
                rollout = generate(model, tokenizer, prompts, 1, max_new_tokens, 1.0, greedy, vllm, env, batch)
                correct = score(batch, rollout.texts, 1, task.exact_match, env_return=rollout.env_return)[1]["correct"]
                right[j] += correct.sum().item() * counted
    right = all_reduce(right) / len(examples)
    random.setstate(states[0])
    np.random.set_state(states[1])
    return {
        "eval/accuracy": right[0].item(),
        "eval/accuracy_greedy": right[1].item(),
        "perf/eval_s": time.perf_counter() - start,
    }


# 5. Log-probs and micro-batches -------------------------------------------------------------------------------------


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits `model`'s forward returns, from its last hidden states (N, H) -> (N, V), in at least fp32."""
    config = unwrap(model).config
    logits = unwrap(model).get_output_embeddings()(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if getattr(config, "logit_scale", None):  # Cohere
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2 and 3: cap * tanh(z / cap)
        logits = config.final_logit_softcapping * torch.tanh(logits / config.final_logit_softcapping)
    return logits


def response_hidden_states(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, **forward_kwargs
) -> torch.Tensor:
    """The last hidden states that score the response tokens: (B, P+L) ids, mask -> (B, L, H) of columns P-1 .. P+L-2,
    0 after the longest response; the forward runs on the columns the rows use (positions from the mask). Rows of one
    prompt (a group) share its forward: each distinct prompt runs once, then each response against its keys and values
    (causal: the whole rows' values and gradients, for P + G L positions, not G (P + L)); not where no prompt repeats
    (on some rank, for DDP or FSDP), under gradient checkpointing in train mode, or where the cache is not plain."""
    used = attention_mask.any(0).nonzero().squeeze(-1)  # the columns some row uses
    start, end = min(int(used[0]), prompt_length - 1), max(int(used[-1]) + 1, prompt_length + 1)
    removed_right = (0, 0, 0, input_ids.shape[1] - end)  # F.pad's: the columns after `end` back, as 0
    P, hf_model = prompt_length - start, unwrap(model)
    input_ids, attention_mask = input_ids[:, start:end], attention_mask[:, start:end]
    prompt_columns = torch.cat([input_ids[:, :P], attention_mask[:, :P]], 1)  # (B, 2P) each row's prompt, its mask
    prompts, row_prompt = torch.unique(prompt_columns, dim=0, return_inverse=True)  # (N, 2P) distinct; (B,) whose
    checkpointed = False  # gradient checkpointing (in train mode) recomputes each layer: no cache to share then
    if torch.is_grad_enabled() and hf_model.training:
        if hasattr(hf_model, "is_activation_checkpointing"):
            checkpointed = hf_model.is_activation_checkpointing
        else:  # transformers < 5.20
            checkpointed = hf_model.is_gradient_checkpointing
    if on_every_rank(model, len(prompts) < len(input_ids) and not checkpointed, input_ids.device):
        prompt_ids, prompt_mask = prompts[:, :P], prompts[:, P:]
        first, first_hidden = forward_last_hidden(
            model,
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            position_ids=position_ids(prompt_mask),
            use_cache=True,
            **forward_kwargs,
        )
        cache = getattr(first, CACHE)
        if plain_cache(cache, P):
            cache.batch_select_indices(row_prompt)  # each row's prompt keys and values; gradients add up over rows
            _, rest_hidden = forward_last_hidden(
                model,
                input_ids=input_ids[:, P:],
                attention_mask=attention_mask,
                position_ids=position_ids(attention_mask)[:, P:],
                use_cache=True,
                **{CACHE: cache},
                **forward_kwargs,
            )
            return F.pad(torch.cat([first_hidden[row_prompt, -1:], rest_hidden[:, :-1]], 1), removed_right)
    _, hidden = forward_last_hidden(
        model,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
        **forward_kwargs,
    )
    return F.pad(hidden[:, P - 1 : -1], removed_right)


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


def _token_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, model, temperature: float, entropy: bool
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


def get_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    temperature: float,
    chunk_size: int | None = None,
    entropy: bool = True,
    recompute_above: int = 2**27,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (B, L) in fp32 of the response tokens, and their entropy (no gradient), 0 after EOS; the LM
    head on real tokens only. With gradients and up to `recompute_above` logits (512 MB) the logits are kept for the
    backward; else chunks of `chunk_size` positions (2^25 logits), recomputed: the whole (N, V) never at once."""
    hidden = response_hidden_states(model, input_ids, attention_mask, prompt_length, logits_to_keep=1)  # (B, L, H)
    real = attention_mask[:, prompt_length:].bool()  # (B, L) 0 after EOS: those positions are set to 0
    hidden, targets = hidden[real], input_ids[:, prompt_length:][real]  # (N, H), (N,)
    N = len(targets)
    vocab_size = unwrap(model).get_output_embeddings().weight.shape[0]
    recompute = torch.is_grad_enabled() and N * vocab_size > recompute_above
    if not chunk_size:
        if torch.is_grad_enabled() and not recompute:
            chunk_size = max(1, N)  # one chunk, its logits kept for the backward
        else:
            chunk_size = max(1, 2**25 // vocab_size)
    chunk = _token_logprobs
    if recompute:  # each chunk's logits recomputed in the backward instead of kept
        chunk = functools.partial(checkpoint, _token_logprobs, use_reentrant=False)
    chunks = [
        chunk(hidden[i : i + chunk_size], targets[i : i + chunk_size], model, temperature, entropy)
        for i in range(0, max(N, 1), chunk_size)
    ]  # each chunk's log-probs (n,) and entropies (n,) or None
    logprobs = torch.cat([chunk_logprobs for chunk_logprobs, _ in chunks])  # (N,)
    zeros = logprobs.new_zeros(real.shape)  # (B, L), the real positions filled in as they were taken, row by row
    if not entropy:
        return zeros.masked_scatter(real, logprobs), None
    entropies = torch.cat([chunk_entropies for _, chunk_entropies in chunks])  # (N,)
    return zeros.masked_scatter(real, logprobs), zeros.masked_scatter(real, entropies)


def micro_batches(
    rows: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    micro_batch_size: int,
    max_tokens: int | None = None,
    group_size: int = 1,
    whole_groups: bool = False,
) -> list[torch.Tensor]:
    """`rows` (indices, ascending) in micro-batches of at most `micro_batch_size` rows: in their order, or with
    `max_tokens` longest first, each filled up to `max_tokens` positions (rows x (widest prompt + longest response); a
    longer row alone). Rows go one by one, or by group (rows j G .. j G + G - 1 share a prompt, which a forward runs
    once), whichever computes fewer positions: groups for long prompts, rows for long, uneven responses; groups always
    with `whole_groups` (a loss per group). Every rank gets as many micro-batches (forwards and gradient syncs are
    collective): a rank with fewer halves its largest until it has as many."""
    if max_tokens is None or not len(rows):
        return [idx for idx in rows.split(micro_batch_size) if len(idx)]
    ids = rows.tolist()
    prompt_lengths = attention_mask[rows, :prompt_length].sum(-1).tolist()  # indexed by position in `ids`
    response_lengths = attention_mask[rows, prompt_length:].sum(-1).tolist()

    def widths(batch: list[list[int]]) -> tuple[int, int]:
        """(widest prompt, longest response) of a micro-batch: a list of units, each a list of positions in `ids`."""
        members = [i for unit in batch for i in unit]
        return max(prompt_lengths[i] for i in members), max(response_lengths[i] for i in members)

    def fill(unit_size: int) -> list[list[list[int]]]:
        """Micro-batches of units (one row each, or a group's rows), longest unit first, each filled to the limits."""
        units = [list(unit) for _, unit in itertools.groupby(range(len(ids)), lambda i: ids[i] // unit_size)]
        batches = []
        for unit in sorted(units, key=lambda unit: -sum(widths([unit]))):
            fits = False  # in the last micro-batch
            if batches:
                num_rows = sum(map(len, batches[-1])) + len(unit)
                fits = num_rows <= micro_batch_size and num_rows * sum(widths(batches[-1] + [unit])) <= max_tokens
            if not fits:
                batches.append([])
            batches[-1].append(unit)
        return batches

    def positions(batches: list[list[list[int]]]) -> int:
        """What the forwards compute: each group's prompt once (a shared forward), each row's response."""
        total = 0
        for batch in batches:
            prompt_width, response_width = widths(batch)
            num_prompts = len({ids[unit[0]] // group_size for unit in batch})
            total += num_prompts * prompt_width + sum(map(len, batch)) * response_width
        return total

    by_group = fill(group_size)
    batches = by_group if whole_groups else min(by_group, fill(1), key=positions)
    most = int(all_reduce(torch.tensor(len(batches), device=current_device()), "max"))
    while len(batches) < most:  # as many as the rank with the most: halve the one with the most rows
        largest = max(range(len(batches)), key=lambda k: sum(map(len, batches[k])))
        batch = batches.pop(largest)
        if len(batch) == 1 and not whole_groups:  # one group's rows: split into rows
            batch = [[i] for i in batch[0]]
        batches += [batch[: len(batch) // 2], batch[len(batch) // 2 :]]
    return [rows[sorted(i for unit in batch for i in unit)] for batch in batches]


@torch.no_grad()
def rollout_logprobs(
    model,
    rollout: Rollout,
    temperature: float,
    micro_batch_size: int,
    max_tokens: int | None = None,
    group_size: int = 1,
) -> torch.Tensor:
    """Log-probs (B, L), no entropy, of a rollout's responses, by `micro_batches`."""
    ids, mask, P = rollout.input_ids, rollout.attention_mask, rollout.prompt_length
    logprobs = torch.zeros_like(rollout.response_mask, dtype=torch.float32)
    all_rows = torch.arange(len(ids), device=ids.device)
    for idx in micro_batches(all_rows, mask, P, micro_batch_size, max_tokens, group_size):
        logprobs[idx] = get_logprobs(model, ids[idx], mask[idx], P, temperature, entropy=False)[0]
    return logprobs


# 6. Rollout correction ----------------------------------------------------------------------------------------------


def sampler_logprob_gap(
    sampler_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    correction: str = "none",
    cap: float = 2.0,
) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs (B, L) are from the sampler's over every rank: mean |difference| (~1e-6 in fp32),
    max, and the effective sample size of the token ratios w_t = pi_old / pi_sampler (1 when all are equal; a share of
    the tokens: ESS = (sum w)^2 / (n sum w^2)); with a `correction` its weights' mean and ESS, and the shares of tokens
    and completions it truncated or masked."""
    mask = response_mask.bool()
    difference = torch.where(mask, (sampler_logprobs - logprobs).abs(), 0.0).double()  # (B, L)
    ratio = rollout_weights(logprobs, sampler_logprobs, response_mask, "tis", math.inf).double() * mask  # (B, L) w_t
    sums = [difference.sum(), mask.sum().double(), ratio.sum(), (ratio**2).sum()]
    weights = rollout_weights(logprobs, sampler_logprobs, response_mask, correction, cap)
    if weights is not None:
        changed = (weights < rollout_weights(logprobs, sampler_logprobs, response_mask, correction, math.inf)) & mask
        weights = weights.double() * mask
        sums += [weights.sum(), (weights**2).sum(), changed.sum(), changed.any(-1).sum(), mask.any(-1).sum()]
    total = all_reduce(torch.stack([x.double() for x in sums]))
    largest = all_reduce(difference.max() if difference.numel() else difference.new_zeros(()), "max")
    tokens = total[1].clamp(min=1)

    def ess(weight_sum: torch.Tensor, square_sum: torch.Tensor) -> torch.Tensor:  # (sum w)^2 / (n sum w^2), in (0, 1]
        return weight_sum**2 / (tokens * square_sum).clamp(min=1e-300)

    metrics = {
        "policy/sampler_logprob_gap": total[0] / tokens,
        "policy/sampler_logprob_gap_max": largest,
        "policy/sampler_ratio_ess": ess(total[2], total[3]),  # of w_t = pi_old / pi_sampler, before any correction
    }
    if weights is not None:
        changed = "truncated" if correction.endswith("tis") else "masked"
        metrics |= {
            "policy/correction_weight_mean": total[4] / tokens,
            "policy/correction_ess": ess(total[4], total[5]),
            f"policy/correction_{changed}_frac": total[6] / tokens,
            f"policy/correction_{changed}_seq_frac": total[7] / total[8].clamp(min=1),
        }
    return metrics


def rollout_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, response_mask: torch.Tensor, correction: str, cap: float
) -> torch.Tensor | None:
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
    if correction.endswith("tis"):  # truncated
        return ratio.clamp(max=cap)
    return ((ratio >= 1 / cap) & (ratio <= cap)).to(ratio.dtype)  # masked


def reweighted(logprobs: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`logprobs` (B, L), the same values, each token's gradient times its weight (every term; not the normaliser)."""
    return logprobs if weights is None else logprobs.detach() + weights * (logprobs - logprobs.detach())


# 7. Metrics ---------------------------------------------------------------------------------------------------------


def step_metrics(
    rewards: torch.Tensor,
    components: dict[str, torch.Tensor],
    rollout: Rollout,
    times: dict[str, float],
    step_start: float,
) -> dict[str, float | torch.Tensor]:
    """What a step sampled over every rank (rewards, lengths of right and wrong completions, the share that write 'wait'
    and how often those are right: NaN when none) and cost (seconds; tokens/s: this rank's times the ranks)."""
    lengths = rollout.response_mask.sum(-1).double()  # (B,) the policy's tokens
    step_s = time.perf_counter() - step_start
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    right = (components["correct"] > 0).to(lengths.device).double()  # (B,) 1 where right, whatever a return's scale
    r = rewards.to(lengths.device).double()
    wait = torch.tensor(
        [re.search(r"\bwait\b", t, re.IGNORECASE) is not None for t in rollout.texts],
        dtype=torch.float64,
        device=lengths.device,
    )
    sums = [lengths @ right, right.sum(), lengths @ (1 - right), (1 - right).sum(), wait.sum(), wait @ right]
    sums += [lengths.new_tensor(len(wait)), r.sum(), r @ r]
    totals = all_reduce(torch.stack(sums))  # every sum over the ranks, in one all-reduce
    length_right, num_right, length_wrong, num_wrong, num_wait, wait_right, num, reward_sum, reward_squares = totals
    metrics = {
        "reward/mean": (rewards.sum(), len(rewards)),  # a (sum, count) pair: `add_metrics`
        "reward/std": ((reward_squares - reward_sum**2 / num) / (num - 1)).clamp(min=0).sqrt(),  # unbiased
        **{f"reward/{name}": (value.sum(), len(value)) for name, value in components.items()},
        "response/length_mean": (lengths.sum(), len(lengths)),
        "response/truncated_frac": (rollout.truncated.sum(), len(lengths)),
        "response/length_correct": length_right / num_right,
        "response/length_wrong": length_wrong / num_wrong,
        "task/self_correction_frac": num_wait / num,
        "task/self_correction_accuracy": wait_right / num_wait,
        "perf/step_s": step_s,
        **{f"perf/{name}_s": seconds for name, seconds in times.items()},
        "perf/tokens_per_s": lengths.sum() * world_size / step_s,
        "perf/peak_mem_gb": peak_memory_gb(r.device),
    }
    if rollout.turns is not None:  # episodes: the policy's turns, and the environment's tokens between them
        observation_tokens = rollout.attention_mask[:, rollout.prompt_length :].sum() - lengths.sum()
        metrics["env/turns"] = (rollout.turns.sum(), len(lengths))
        metrics["env/observation_tokens"] = (observation_tokens, len(lengths))
    return metrics


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or on CPU this process's peak resident memory: /proc's VmHWM (Linux carries
    `ru_maxrss` over fork and exec: a process started by a larger one would report that one's), else ru_maxrss."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if not status.exists():  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30  # (bytes on macOS)
    return next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:")) / 2**20


@contextlib.contextmanager
def timed(seconds: dict[str, float], name: str):
    """`with timed(times, "gen"): ...` adds the section's wall time to times["gen"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
