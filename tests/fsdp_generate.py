"""Run by tests/test_runs.py under torchrun with 2 ranks: greedy generation from an FSDP-sharded model
when one rank's completions end several tokens before the other's, followed at once by another kind
of collective. Each rank checks that its completion equals the unsharded model's and writes its
length to rank_<r>.json in the working folder (two processes printing to one pipe can interleave)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import format_prompt, generate
from harness import DEFAULT_MODEL, cleanup_distributed, load_model, load_tokenizer, setup_distributed, shard_model


def main() -> None:
    rank, world_size, device = setup_distributed()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    prompt = format_prompt(tokenizer, ["1+1", "55+55"][rank], True)  # 1-digit answer on rank 0, 3 digits on rank 1
    unsharded = load_model(DEFAULT_MODEL, "float32", device, tokenizer)
    plain = generate(unsharded, tokenizer, [prompt], 1, 8, 1.0, greedy=True)
    model = shard_model(load_model(DEFAULT_MODEL, "float32", device, tokenizer), device)
    sharded = generate(model, tokenizer, [prompt], 1, 8, 1.0, greedy=True)
    length = int(sharded.response_mask.sum())
    total = torch.tensor([float(length)])
    dist.all_reduce(total)  # a different collective right after: a rank that left generation early would meet it alone
    assert sharded.texts == plain.texts, (sharded.texts, plain.texts)
    Path(f"rank_{rank}.json").write_text(json.dumps({"length": length, "total": int(total), "text": sharded.texts[0]}))


if __name__ == "__main__":
    main()
    cleanup_distributed()  # after main has returned: the sharded model is freed before the process group
