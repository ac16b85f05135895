"""Run an algorithm file's `main` with each prompt's completions sampled from a seed of its own text.

Sampling is seeded per rank in the algorithm files, so 1 process and 2 ranks would draw different
completions for the same prompts. Pinning the seed per prompt (and generating each group alone, so
batch shapes match too) makes the global batch identical whatever the number of ranks or
micro-batches; everything after generation is the file's own code. Prompts must tokenize to the
same length (see the `fixed_length_dataset` fixture).

    python tests/pinned_run.py grpo --num-steps 1 ...
"""

import importlib
import sys
import zlib

import torch
import torch.nn.functional as F
import tyro

from common import Rollout
from common import generate as real_generate


def pinned_generate(model, tokenizer, prompts, group_size, max_new_tokens, temperature, greedy=False):
    parts = []
    for prompt in prompts:
        torch.manual_seed(zlib.crc32(prompt.encode()))
        parts.append(real_generate(model, tokenizer, [prompt], group_size, max_new_tokens, temperature, greedy))
    P = parts[0].prompt_length
    assert all(r.prompt_length == P for r in parts), "pinned_run needs prompts of equal token length"
    width = P + max_new_tokens

    def stack(name, value, total):
        return torch.cat([F.pad(getattr(r, name), (0, total - getattr(r, name).shape[1]), value=value) for r in parts])

    return Rollout(
        input_ids=stack("input_ids", tokenizer.pad_token_id, width),
        attention_mask=stack("attention_mask", 0, width),
        response_mask=stack("response_mask", 0, max_new_tokens),
        prompt_length=P,
        texts=[t for r in parts for t in r.texts],
        truncated=torch.cat([r.truncated for r in parts]),
    )


if __name__ == "__main__":
    module = importlib.import_module(sys.argv[1])
    module.generate = pinned_generate
    module.main(tyro.cli(module.Args, args=sys.argv[2:]))
