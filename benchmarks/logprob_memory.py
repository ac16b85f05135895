"""Peak extra memory of the per-token log-prob path (common.get_logprobs, forward + backward) against a
naive full fp32 log-softmax, for a vocabulary of 151,936 (Qwen's) at B x T = 8 x 2048.

The model is a 1-layer Qwen3 with a small hidden size: what this measures is the vocabulary projection,
which does not depend on depth. Each measurement runs in its own process; on CPU the figure is the growth
of peak resident memory (VmHWM) over the process's baseline, on GPU torch's max_memory_allocated.

    python -m benchmarks.logprob_memory                   # from the repo root: chunked at 8 x 2048, naive at 1 x 2048
    python -m benchmarks.logprob_memory --naive-batch 8   # the naive path at full size (~20 GB on CPU)

The naive path is measured at --naive-batch rows and scaled linearly to B (its memory is B x T x V floats
per live tensor), so the comparison runs on a 24 GB machine.
"""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent


def peak_bytes(device: torch.device) -> int:
    from common import peak_rss_bytes

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def measure(mode: str, batch: int, seq: int, vocab: int, hidden: int, device: torch.device) -> float:
    """GB of peak memory added by one forward + backward of the log-prob path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from common import get_logprobs

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=seq + 1, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).to(device)
    ids = torch.randint(0, vocab, (batch, seq + 1), device=device)  # 1 prompt token, `seq` response tokens
    mask = torch.ones_like(ids)
    if mode == "chunked":  # warm up once at a small size, so one-off allocations are in the baseline
        get_logprobs(model, ids[:1, :16], mask[:1, :16], 1, 1.0)[0].sum().backward()
    for p in model.parameters():  # gradient buffers allocated: part of any training step, not of the path
        p.grad = torch.zeros_like(p)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    base = peak_bytes(device)
    if mode == "chunked":
        logprobs, _ = get_logprobs(model, ids, mask, 1, 1.0)
    else:  # the textbook way: full logits, full fp32 log-softmax, gather
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()  # (B, T, V)
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logprobs.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (peak_bytes(device) - base) / 1e9


@dataclass
class Args:
    batch: int = 8
    seq: int = 2048
    vocab: int = 151936
    hidden: int = 64
    naive_batch: int = 1
    """rows for the naive measurement (scaled to --batch)"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    one: Optional[tuple[Literal["chunked", "naive"], int]] = None
    """internal: MODE BATCH, one measurement, in the child process this script starts"""


def main(args: Args) -> None:
    device = torch.device(args.device)
    if args.one:
        gb = measure(args.one[0], args.one[1], args.seq, args.vocab, args.hidden, device)
        print(json.dumps({"gb": gb}))
        return

    def child(mode: str, batch: int) -> float:
        cmd = [sys.executable, "-m", "benchmarks.logprob_memory", "--one", mode, str(batch), "--seq", str(args.seq),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--device", args.device]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])["gb"]

    logits_gb = args.batch * args.seq * args.vocab * 4 / 1e9
    print(f"vocab {args.vocab}, B x T = {args.batch} x {args.seq}, hidden {args.hidden}, {args.device}; "
          f"one fp32 (B, T, V) tensor is {logits_gb:.2f} GB")
    chunked = child("chunked", args.batch)
    print(f"chunked get_logprobs, forward + backward:  {chunked:6.2f} GB extra (target <= 1.5)")
    naive = child("naive", args.naive_batch)
    scaled = naive * args.batch / args.naive_batch
    print(f"naive fp32 log-softmax, forward + backward: {scaled:6.2f} GB extra"
          + (f" ({naive:.2f} GB measured at B = {args.naive_batch}, scaled x{args.batch / args.naive_batch:g})"
             if args.naive_batch != args.batch else ""))


if __name__ == "__main__":
    main(tyro.cli(Args))
