"""Run by tests/test_runs.py under torchrun with 2 ranks: a prompt that rows share runs once
(common.response_hidden_states, and in sampling common.sample_hf) only where every rank can share, since a
DDP or FSDP model's forward is collective (DDP broadcasts buffers, FSDP all-gathers weights): a rank
that ran two forwards where the other ran one would pair mismatched collectives. Rank 0's rows share
their prompts, rank 1's do not. For DDP and for FSDP, one backward of the log-probs, then sampling:
each rank writes its log-probs, the gradient norm and its completions to rank_<r>.json in the working
folder, for the test to compare with one process."""

import json
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import format_prompt, generate, get_logprobs, unwrap
from harness import (
    DEFAULT_MODEL,
    cleanup_distributed,
    clip_grad_norm,  # noqa: E402
    load_model,
    load_tokenizer,
    setup_distributed,
    shard_model,
)

PROMPTS = [["1+2", "1+2", "45+67", "45+67"], ["1+2", "45+67", "9+99", "23+5"]]  # rank 0 shares, rank 1 does not


def rows(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each prompt followed by the same 3-token response: (ids, mask, prompt width)."""
    enc = tokenizer(
        [format_prompt(tokenizer, p, True) for p in prompts],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    response = torch.tensor(tokenizer("12", add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
    ids = torch.cat([enc.input_ids, response.expand(len(prompts), -1)], 1)
    return (
        ids,
        torch.cat([enc.attention_mask, torch.ones(len(prompts), len(response), dtype=torch.long)], 1),
        enc.input_ids.shape[1],
    )


def main() -> None:
    rank, world_size, device = setup_distributed(timeout_minutes=1)  # a mismatched collective fails within a minute
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    ids, mask, P = rows(tokenizer, PROMPTS[rank])
    figures = {}
    for mode in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = load_model(DEFAULT_MODEL, "float32", device, tokenizer)
        model = DDP(model) if mode == "ddp" else shard_model(model, device)
        logprobs, _ = get_logprobs(model, ids, mask, P, 1.0)
        logprobs.sum().backward()
        grad_norm = clip_grad_norm(model.parameters(), float("inf"), 0, Path.cwd())
        torch.manual_seed(rank)
        prompts = [format_prompt(tokenizer, p, True) for p in PROMPTS[rank][::2]]
        rollout = generate(unwrap(model), tokenizer, prompts, 2 - rank, 4, 1.0)  # rank 1: one row per prompt
        figures[mode] = {"logprobs": logprobs.tolist(), "grad_norm": grad_norm.item(), "texts": rollout.texts}
    Path(f"rank_{rank}.json").write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
    cleanup_distributed()
