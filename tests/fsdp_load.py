"""Run by tests/test_precision.py under torchrun: each rank loads the model of argv[1] as --fsdp does (load_model, then
shard_model); rank 0 prints, as JSON, each rank's growth of its peak resident memory while doing so (the logits check
left out: its forward holds what any forward holds) and the sum of the sharded model's weights gathered whole (every
named weight, a tied one under each of its names)."""

import inspect
import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import harness  # noqa: E402
from common import peak_memory_gb  # noqa: E402
from harness import cleanup_distributed, load_model, load_tokenizer, setup_distributed, shard_model  # noqa: E402

rank, world_size, device = setup_distributed()
tokenizer = load_tokenizer(sys.argv[1])
with torch.device("meta"):  # the model's code imported first (~140 MB): no part of what loading holds
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
harness.check_output_logits = lambda *args: None
Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory from here on (VmHWM)
base = peak_memory_gb(device)
sharded = {"sharded": True} if "sharded" in inspect.signature(load_model).parameters else {}  # (before #61: none)
model = load_model(sys.argv[1], "float32", device, tokenizer, **sharded)
shard_model(model, device, *(["float32"] if sharded else []))
growth = (peak_memory_gb(device) - base) * 2**30
total = sum(tensor.full_tensor().double().sum().item() for tensor in model.state_dict().values())
figures = [None] * world_size
torch.distributed.all_gather_object(figures, {"rank": rank, "growth": growth, "total": total})
if rank == 0:
    print(json.dumps(figures), flush=True)
cleanup_distributed()
