"""--vllm on a GPU: sampling throughput of `model.generate` against the vLLM engine, in grpo.py's own training
rounds, with the gap between vLLM's and the trainer's log-probs (bf16) and what the rollout correction did,
and TRL's round with its colocated vLLM at the same configuration. Random weights of the Qwen2.5-0.5B and
1.5B shapes (nothing is downloaded) with the offline default's tokenizer: ids past its 52 decode to
nothing and EOS is rare, so completions run to --new-tokens, which is what a throughput figure wants.

    python -m benchmarks.vllm_recipe            # in the vLLM environment (requirements-vllm.txt); + trl for TRL
    python -m benchmarks.vllm_recipe --shapes tiny --device-check   # the CPU check tests/test_vllm.py runs

For each shape: grpo.py runs 1 + --rounds steps without and with --vllm (separate processes; the first
step, which compiles and warms up, is left out), each printing per round: seconds, of which sampling,
sampled response tokens per second, and with --vllm `policy/sampler_logprob_gap(_max)` and the
correction's `policy/correction_weight_mean` / `_truncated_frac`. Then, with trl installed, grpo.py --vllm
against TRL (use_vllm, colocate) in turns (benchmarks/lockstep.py). Defaults: 32 prompts x 8 = 256
completions of 512 new tokens, micro-batches of 32, learning rate 1e-6.
"""

import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.lockstep import Shape, compare, print_comparison, save_with_offline_tokenizer

ROOT = Path(__file__).resolve().parent.parent

# Qwen/Qwen2.5-0.5B-Instruct's and Qwen/Qwen2.5-1.5B-Instruct's config.json, written out (no hub access).
QWEN2_5 = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=True),  # for the CPU check only (vLLM's: heads of 32)
}
COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
              hidden_act="silu", use_sliding_window=False)


@dataclass
class Args:
    shapes: list[str] = field(default_factory=lambda: ["0.5b", "1.5b"])
    """Qwen2.5 shapes to run: 0.5b, 1.5b (tiny: the CPU check)"""
    prompts: int = 32
    group_size: int = 8
    new_tokens: int = 512
    micro_batch_size: int = 32
    rounds: int = 2
    """timed training rounds of each run (after one warm-up round)"""
    trl: bool = True
    """grpo.py --vllm against TRL with its colocated vLLM, when trl is installed"""
    device_check: bool = False
    """a small configuration that runs on a CPU in about a minute (the test's)"""
    out: Path | None = None
    """also write the figures to this JSON file"""


def grpo_rounds(model: Path, args: Args, vllm: bool, out: Path) -> dict:
    """grpo.py's figures for --rounds rounds after a warm-up, from its metrics.jsonl."""
    name = "vllm" if vllm else "generate"
    command = [sys.executable, str(ROOT / "grpo.py"), "--model", str(model), "--num-steps", str(1 + args.rounds),
               "--eval-every", "0", "--prompts-per-step", str(args.prompts), "--group-size", str(args.group_size),
               "--max-new-tokens", str(args.new_tokens), "--micro-batch-size", str(args.micro_batch_size),
               "--learning-rate", "1e-6", "--output-dir", str(out), "--run-name", name, *(["--vllm"] if vllm else [])]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: grpo.py{' --vllm' if vllm else ''} failed:\n{result.stderr[-3000:]}")
    steps = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()][1:]
    tokens = [m["response/length_mean"] * args.prompts * args.group_size for m in steps]
    figures = {"round_s": statistics.median(m["perf/step_s"] for m in steps),
               "gen_s": statistics.median(m["perf/gen_s"] for m in steps),
               "gen_tokens_per_s": statistics.median(t / m["perf/gen_s"] for t, m in zip(tokens, steps)),
               "peak_mem_gb": max(m["perf/peak_mem_gb"] for m in steps)}
    for key in ("policy/sampler_logprob_gap", "policy/sampler_logprob_gap_max", "policy/correction_weight_mean",
                "policy/correction_truncated_frac"):
        if key in steps[0]:
            figures[key.removeprefix("policy/")] = max(m[key] for m in steps)
    return figures


def main(args: Args) -> None:
    if args.device_check:
        args.shapes, args.prompts, args.group_size, args.new_tokens, args.micro_batch_size, args.rounds = \
            ["tiny"], 2, 2, 8, 4, 1
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("error: this benchmark needs vLLM: run it in the environment of requirements-vllm.txt")
    device = "GPU " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{device}; {args.prompts} prompts x {args.group_size} completions of {args.new_tokens} new tokens, "
          f"micro-batches of {args.micro_batch_size}, {args.rounds} timed round(s) after a warm-up", flush=True)
    results = {}
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(Qwen2Config(**COMMON, **QWEN2_5[shape]), dtype=torch.bfloat16)
            save_with_offline_tokenizer(model, Path(tmp) / "model")
            del model
            results[shape] = {}
            for vllm in (False, True):
                figures = grpo_rounds(Path(tmp) / "model", args, vllm, Path(tmp) / "runs")
                results[shape]["vllm" if vllm else "generate"] = figures
                print(f"Qwen2.5-{shape} grpo.py{' --vllm' if vllm else ''}: " +
                      ", ".join(f"{k} {v:.4g}" for k, v in figures.items()), flush=True)
            if args.trl and importlib.util.find_spec("trl") is not None and torch.cuda.is_available():
                batch = Shape(args.prompts, args.group_size, args.new_tokens, args.micro_batch_size)
                result = compare("grpo", "trl", str(Path(tmp) / "model"), batch, 2, 1, ["--vllm"], 1,
                                 str(Path(tmp) / "lockstep"), trl_vllm=True)
                print_comparison(result, batch, 2, 1)
                results[shape]["trl_vllm"] = {"grpo_round_s": result["this"]["median_s"],
                                              "trl_round_s": result["other"]["median_s"], "ratio": result["ratio"]}
            else:
                print("TRL's round: not run (it needs trl, and a GPU for TRL's colocated vLLM)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(tyro.cli(Args))
