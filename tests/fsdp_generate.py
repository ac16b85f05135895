"""Run by tests/test_runs.py under torchrun with 2 ranks: greedy generation from an FSDP-sharded model
when one rank's completions end several tokens before the other's, followed at once by another kind
of collective. Prints each rank's completions, which must equal the unsharded model's."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import (  # noqa: E402
    DEFAULT_MODEL,
    cleanup_distributed,
    format_prompt,
    generate,
    load_model,
    load_tokenizer,
    setup_distributed,
    shard_model,
)

rank, world_size, device = setup_distributed()
tokenizer = load_tokenizer(DEFAULT_MODEL)
prompt = format_prompt(tokenizer, ["1+1", "55+55"][rank], True)  # 1-digit answer on rank 0, 3 digits on rank 1
plain = generate(load_model(DEFAULT_MODEL, "float32", device, tokenizer), tokenizer, [prompt], 1, 8, 1.0, greedy=True)
model = shard_model(load_model(DEFAULT_MODEL, "float32", device, tokenizer), device)
sharded = generate(model, tokenizer, [prompt], 1, 8, 1.0, greedy=True)
total = torch.tensor([float(sharded.response_mask.sum())])
dist.all_reduce(total)  # a different collective right after: a rank that left generation early would meet it alone
length = int(sharded.response_mask.sum())
print(f"rank {rank}: {sharded.texts[0]!r} {plain.texts[0]!r} {length} {int(total)}", flush=True)
assert sharded.texts == plain.texts
cleanup_distributed()
