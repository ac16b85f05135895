"""Seconds of the update's heavy parts at a Qwen3-0.6B-like shape (vocabulary 151,936, hidden 1,024), each
with and without what common.get_logprobs and the files' optimizer line do to make it cheaper:

- the log-prob head, forward + backward: the logits kept for the backward and computed in one product
  (get_logprobs' choice when B x T x V <= 2^27) against kept in chunks of 2^25 logits, and against
  those chunks recomputed in the backward (`recompute_above=0`, its choice above that size);
- a no-grad pass (the old and reference log-probs): without the entropy, which those passes do not read,
  against with it;
- one AdamW step over the model's parameters: fused=True against torch's default.

    python -m benchmarks.update_parts                  # from the repo root: 1 layer, 16 x 32 response tokens
    python -m benchmarks.update_parts --layers 4 --repeats 7

The two variants of each part run in turns (A B A B ...) in one process, so that a shared machine's swings
hit both; printed: the median and the range of each, and their ratio. Not a test: timings depend on the
machine and on whatever else runs on it.
"""

import inspect
import statistics
import time
from dataclasses import dataclass

import torch
import tyro

from common import get_logprobs


@dataclass
class Args:
    layers: int = 1
    """decoder layers (the head's cost does not depend on depth; AdamW's does)"""
    vocab: int = 151936
    hidden: int = 1024
    batch: int = 16
    prompt: int = 16
    """prompt tokens per sequence"""
    response: int = 32
    """response tokens per sequence"""
    repeats: int = 5
    """timed turns of each variant, after one warm-up turn"""
    seed: int = 1


def in_turns(variants: dict[str, callable], repeats: int) -> dict[str, list[float]]:
    """Seconds of each variant, run in turns after one untimed warm-up turn."""
    times = {name: [] for name in variants}
    for turn in range(repeats + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            if turn:
                times[name].append(time.perf_counter() - start)
    return times


def report(part: str, times: dict[str, list[float]]) -> None:
    """The median and range of each variant, and the first one's median over each other's."""
    (a, ta), *others = times.items()
    print(f"{part}: " + ", ".join(f"{name} {statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f})"
                                  for name, t in times.items())
          + "; " + ", ".join(f"{a} / {b} = {statistics.median(ta) / statistics.median(tb):.2f}" for b, tb in others),
          flush=True)


def main(args: Args) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=args.hidden // 16, max_position_embeddings=args.prompt + args.response,
                         tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    ids = torch.randint(0, args.vocab, (args.batch, args.prompt + args.response))
    mask = torch.ones_like(ids)
    logits = args.batch * args.response * args.vocab
    kept = logits <= inspect.signature(get_logprobs).parameters["recompute_above"].default  # get_logprobs' choice
    print(f"{args.layers} layer(s), vocabulary {args.vocab}, hidden {args.hidden}, {args.batch} x {args.response} "
          f"response tokens: {logits:,} logits ({'kept' if kept else 'recomputed'} by default); "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; {torch.get_num_threads()} threads")

    def head(recompute_above: int, chunk_size=None):
        logprobs, _ = get_logprobs(model, ids, mask, args.prompt, 1.0, chunk_size, recompute_above=recompute_above)
        logprobs.sum().backward()

    chunk = 2**25 // args.vocab
    report("log-prob head, forward + backward", in_turns({
        "kept, one product": lambda: head(2**62), "kept in chunks": lambda: head(2**62, chunk),
        "chunks recomputed": lambda: head(0)}, args.repeats))

    def no_grad_pass(entropy: bool):
        with torch.no_grad():
            get_logprobs(model, ids, mask, args.prompt, 1.0, entropy=entropy)

    report("no-grad pass", in_turns({"without entropy": lambda: no_grad_pass(False),
                                     "with entropy": lambda: no_grad_pass(True)}, args.repeats))

    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)
                  for name, fused in (("fused", True), ("default", False))}
    report("AdamW step", in_turns({name: opt.step for name, opt in optimizers.items()}, args.repeats))


if __name__ == "__main__":
    main(tyro.cli(Args))
