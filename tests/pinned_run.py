"""Run an algorithm file's `main` with each prompt's completions sampled from a seed of its own text.

Sampling is seeded per rank in the algorithm files, so 1 process and 2 ranks would draw different
completions for the same prompts. Pinning the seed per prompt (and generating each group alone, so
batch shapes match too) makes the global batch identical whatever the number of ranks or
micro-batches; everything after generation is the file's own code.

    python tests/pinned_run.py grpo --num-steps 1 ...
"""

import importlib
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the algorithm files and common.py
from common import cat_rollouts  # noqa: E402
from common import generate as real_generate
from harness import cleanup_distributed, cli  # noqa: E402


def pinned_generate(
    model, tokenizer, prompts, group_size, max_new_tokens, temperature, greedy=False, vllm=None, env=None, rows=None
):
    """With an environment, each row's episodes from a seed of its prompt and answer (the game's secret)."""
    parts = []
    for i, prompt in enumerate(prompts):
        torch.manual_seed(zlib.crc32((prompt + ("" if env is None else rows[i]["answer"])).encode()))
        parts.append(
            real_generate(
                model,
                tokenizer,
                [prompt],
                group_size,
                max_new_tokens,
                temperature,
                greedy,
                vllm,
                env,
                None if env is None else rows[i : i + 1],
            )
        )
    return cat_rollouts(parts, tokenizer.pad_token_id)


if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    module.generate = pinned_generate
    module.main(cli(module.Args, args=sys.argv[2:]))
    cleanup_distributed()
