"""What a resumable checkpoint costs each rank under --fsdp: seconds and peak resident memory growth for
the save and for the resume, on CPU with gloo. The goal is about params / ranks per rank (each rank
writes and reads only its own shards), not params.

    python -m benchmarks.checkpoint_memory                         # 2 ranks, a 101M-parameter Qwen3
    python -m benchmarks.checkpoint_memory --layers 1 --hidden 64  # tiny (the test)

The script launches itself with torchrun. Each rank builds the model from tiny_model's config with the
given sizes (random weights, nothing downloaded), shards it with `common.shard_model`, and takes one AdamW
step, so the optimizer holds its two moments. Then:
  save      `common.save_checkpoint` with the optimizer, as --save-every writes a step (on rank 0 this
            includes gathering the weights for the step's `save_pretrained` export);
  export    `common.save_checkpoint` without it, as `final/` is written: the export alone;
  resume    a fresh model and optimizer, `common.load_checkpoint`.
Peak growth is VmHWM after the call minus resident memory before it, with VmHWM reset just before
(/proc/self/clear_refs); "state" is what this rank holds of weights + moments (4 bytes each), for scale.
Not a test: timings depend on the machine.
"""

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    ranks: int = 2
    """processes (torchrun --nproc_per_node)"""
    layers: int = 6
    """decoder layers"""
    hidden: int = 1024
    """hidden size (heads of 64)"""
    intermediate: int = 4096
    """MLP width"""
    vocab: int = 8192
    """vocabulary size (the embeddings and the LM head, untied)"""


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def measured(fn):
    """(seconds, peak resident growth in bytes) of fn(), with the high-water mark reset first."""
    import gc

    import torch.distributed as dist

    from common import peak_rss_bytes

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before, start = rss_bytes(), time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, peak_rss_bytes() - before


def build(args: Args, device):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import DEFAULT_MODEL, shard_model

    config = AutoConfig.from_pretrained(DEFAULT_MODEL, num_hidden_layers=args.layers, hidden_size=args.hidden,
                                        intermediate_size=args.intermediate, num_attention_heads=args.hidden // 64,
                                        num_key_value_heads=args.hidden // 64, head_dim=64, vocab_size=args.vocab,
                                        tie_word_embeddings=False)
    config.layer_types = ["full_attention"] * args.layers
    torch.manual_seed(0)
    model = shard_model(AutoModelForCausalLM.from_config(config), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def worker(args: Args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from common import DEFAULT_MODEL, load_checkpoint, load_tokenizer, save_checkpoint, setup_distributed

    rank, world_size, device = setup_distributed()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model, optimizer = build(args, device)
    ids = torch.randint(0, args.vocab, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # the optimizer now holds its two moments
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    own = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())

    run_info = {"algorithm": "grpo.py", "config": {"model": DEFAULT_MODEL}}
    folder, phase = Path(os.environ["CHECKPOINT_DIR"]), os.environ["PHASE"]

    def call():
        step, final = folder / "step_1", folder / "final"
        if phase == "save":  # as --save-every writes a step
            save_checkpoint(step, {"policy": model}, tokenizer, rank, run_info, optimizer, 1)
        elif phase == "export":  # as final/ is written
            save_checkpoint(final, {"policy": model}, tokenizer, rank, run_info)
        else:  # resume, into a model and optimizer that have taken a step of their own
            load_checkpoint(step, {"policy": model}, optimizer, rank)

    table = [None] * world_size
    dist.all_gather_object(table, measured(call))
    if rank == 0:
        if phase == "save":
            state = 3 * 4 * own  # weights + AdamW's two moments, fp32, this rank's shards
            print(f"{params / 1e6:.1f}M parameters on {world_size} ranks, saved as DCP shards; weights + moments: "
                  f"{3 * 4 * params / 1e6:.0f} MB in all, {state / 1e6:.0f} MB per rank")
            print("| call | rank | seconds | peak RSS growth (MB) | growth / this rank's weights + moments |")
            print("|---|---|---|---|---|")
        for r, (seconds, growth) in enumerate(table):
            print(f"| {phase} | {r} | {seconds:.2f} | {growth / 1e6:.0f} | {growth / (3 * 4 * own):.2f} |", flush=True)


def main(args: Args) -> None:
    if "RANK" in os.environ:
        from common import cleanup_distributed

        worker(args)
        cleanup_distributed()  # after worker has returned: its sharded model is freed
        return
    with tempfile.TemporaryDirectory() as folder:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               "-m", "benchmarks.checkpoint_memory", *sys.argv[1:]]
        env = {**os.environ, "CHECKPOINT_DIR": folder, "OMP_NUM_THREADS": "1"}
        for phase in ("save", "export", "resume"):  # each in fresh processes: no memory carried between them
            subprocess.run(cmd, cwd=ROOT, env={**env, "PHASE": phase}, check=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
