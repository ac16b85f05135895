"""Peak memory of grpo.py's training, full fine-tuning against LoRA adapters, at the benchmarks' Qwen3-0.6B-like
shape (Qwen3-0.6B's config with 4 of its 28 layers, random weights, as benchmarks/lockstep.py's realistic
shape): with adapters there is no reference copy of the model (the policy with its adapters off is the
reference), no gradients and no AdamW moments but the adapters'.

    python -m benchmarks.lora_memory                 # from the repo root: CPU peak resident memory, ~2 minutes
    python -m benchmarks.lora_memory --beta 0        # without the reference model (GRPO's beta 0)
    python -m benchmarks.lora_memory --layers 1 --vocab 1000 --steps 1   # the quick check the tests run

Each configuration runs in a process of its own for --steps steps (4 prompts x 4 completions of 32 new
tokens, `perf/peak_mem_gb`: on CPU the process's peak resident memory, on GPU the peak allocated) and
prints the largest peak; the formula's terms (benchmarks/memory_fit.py) are printed beside it.
"""

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from transformers import AutoModelForCausalLM, Qwen3Config

from benchmarks.gpu_recipe import QWEN3_0_6B
from benchmarks.lockstep import save_with_offline_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Args:
    layers: int = 4
    """layers of Qwen3-0.6B's 28 kept"""
    vocab: int = 151936
    """vocabulary size (Qwen3's; smaller for a quick check)"""
    lora_rank: int = 8
    beta: float = 0.04
    """GRPO's KL weight: > 0 loads the reference (a copy without LoRA, the policy itself with it)"""
    steps: int = 2


def peak(model: Path, args: Args, flags: list[str], out: Path, name: str) -> float:
    command = [sys.executable, str(ROOT / "grpo.py"), "--model", str(model), "--num-steps", str(args.steps),
               "--eval-every", "0", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "32",
               "--beta", str(args.beta), "--learning-rate", "1e-5", "--output-dir", str(out), "--run-name", name,
               *flags]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)}:\n{result.stderr[-3000:]}")
    return max(json.loads(line)["perf/peak_mem_gb"] for line in (out / name / "metrics.jsonl").read_text().splitlines())


def main(args: Args) -> None:
    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": args.layers, "vocab_size": args.vocab})
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        n = sum(p.numel() for p in model.parameters())
        save_with_offline_tokenizer(model, Path(tmp) / "model")
        del model
        print(f"Qwen3-0.6B shape, {args.layers} layers: {n / 1e6:.0f} M parameters ({4 * n / 1e9:.2f} GB in fp32); "
              f"beta {args.beta}; {args.steps} steps of 4 x 4 completions of 32 tokens", flush=True)
        full = peak(Path(tmp) / "model", args, [], Path(tmp) / "runs", "full")
        lora = peak(Path(tmp) / "model", args, ["--lora-rank", str(args.lora_rank)], Path(tmp) / "runs", "lora")
    # full: weights, gradients, 2 AdamW moments, + the reference when beta > 0; LoRA: the weights (+ adapters)
    expected = 4 * n * (4 + (args.beta > 0)) / 1e9 - 4 * n / 1e9
    print(f"peak memory, full fine-tuning: {full:.2f} GB; LoRA rank {args.lora_rank}: {lora:.2f} GB; "
          f"saved {full - lora:.2f} GB (formula: {expected:.2f} GB = gradients, AdamW's two moments"
          f"{' and the reference copy' if args.beta > 0 else ''}, 4 bytes each per weight)")


if __name__ == "__main__":
    main(tyro.cli(Args))
