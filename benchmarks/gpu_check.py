"""The GPU check: grpo.py's own training rounds on one GPU at a real model's shape (random weights of Qwen2.5-0.5B or
1.5B, the offline tokenizer, prompts of --prompt-length tokens; EOS is rare, so completions run to --new-tokens),
sampling with `model.generate` and with --vllm (its engine keeping its weights between calls, and not), each with the
LM head in bf16 and in fp32 (--lm-head-fp32: the sampler gap printed shows what it closes), then against
TRL's GRPOTrainer in turns (benchmarks/lockstep.py), each side with its own sampler, where trl is installed.

    python -m benchmarks.gpu_check            # in the vLLM environment (requirements-vllm.txt), + trl for TRL
    python -m benchmarks.gpu_check --shapes tiny --device-check   # the CPU check the tests run

Each run is 1 + --rounds steps, the first left out. Printed from its metrics.jsonl: seconds per round and of
sampling, sampled tokens per second, peak memory, the update's TFLOP/s (`update_flops` over perf/update_s) and, on a
GPU, its MFU (over --peak-tflops); the sampler gap, and with --vllm what the rollout correction did.
"""

import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import tyro
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks import as_flags
from benchmarks.lockstep import ROOT, UPDATES_PER_ROLLOUT, Shape, compare, print_comparison, save_with_offline_tokenizer
from benchmarks.memory_fit import SHAPES as MODEL_SHAPES
from benchmarks.memory_fit import Shape as ModelShape
from common import format_prompt
from harness import load_tokenizer

SAMPLERS = {
    "generate": [],
    "generate_fp32_head": ["--lm-head-fp32"],
    "vllm": ["--vllm"],
    "vllm_fp32_head": ["--vllm", "--lm-head-fp32"],
    "vllm_weights_freed": ["--vllm", "--no-vllm-keep-weights"],
}
# Qwen2.5-0.5B's and 1.5B's shapes (memory_fit's), and the CPU check's (vLLM's CPU attention takes heads of 32)
SHAPES = {
    "0.5b": MODEL_SHAPES["Qwen2.5-0.5B"],
    "1.5b": MODEL_SHAPES["Qwen2.5-1.5B"],
    "tiny": ModelShape("tiny", 2, 64, 128, 2, 1, tied=True),
}
# --device-check: a configuration that runs on a CPU in about a minute (the tests')
DEVICE_CHECK = dict(
    shapes=["tiny"], prompts=2, group_size=2, prompt_length=40, new_tokens=8, micro_batch_size=4, rounds=1
)


def qwen_config(s: ModelShape) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        use_sliding_window=False,
        tie_word_embeddings=True,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
    )


def update_flops(
    config,
    num_sequences: int,
    sequence_length: int,
    response_length: int,
    causal: bool = True,
    prompts: int | None = None,
) -> float:
    """Model FLOPs of a forward + backward (2 forwards) of grpo.py's update over `num_sequences` sequences of
    `sequence_length` tokens, `response_length` scored; with `prompts`, that many shared prompt forwards (one per
    micro-batch: common.response_hidden_states), else each sequence whole. Attention: its causal half."""
    d, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer_weights = d * (q_dim + 2 * kv_dim) + q_dim * d + 3 * d * config.intermediate_size  # attention + MLP
    P, L, n = sequence_length - response_length, response_length, num_sequences
    if prompts is None:  # each sequence's positions, each against all T (or, causal, half of the T x T)
        positions, scores = n * sequence_length, n * sequence_length**2 / (2 if causal else 1)
    else:  # the prompts' positions among themselves, each response position against its prompt and response
        positions, scores = prompts * P + n * L, (prompts * P**2 + n * L**2) / (2 if causal else 1) + n * L * P
    weights = 2 * layers * layer_weights * positions
    attention = 2 * 2 * layers * q_dim * scores  # QK^T and AV
    lm_head = 2 * d * config.vocab_size * n * response_length
    return 3 * (weights + attention + lm_head)


@dataclass
class Args:
    shapes: list[str] = field(default_factory=lambda: ["0.5b", "1.5b"])
    """Qwen2.5 shapes to run: 0.5b, 1.5b (tiny: the CPU check)"""
    prompts: int = 32
    group_size: int = 8
    prompt_length: int = 256
    """tokens of each prompt, with the chat template"""
    new_tokens: int = 512
    micro_batch_size: int = 32
    rounds: int = 2
    """timed rounds of each run, after one warm-up round"""
    peak_tflops: float = 989.0
    """the accelerator's dense bf16 peak (H100/H200 SXM: 989)"""
    trl: bool = True
    """grpo.py against TRL, when trl is installed and a GPU is there"""
    device_check: bool = False
    """a small configuration that runs on a CPU in about a minute (the tests')"""
    out: Path | None = None
    """also write the figures to this JSON file"""


def dataset(folder: Path, args: Args) -> None:
    """<folder>/prompts.jsonl: prompts of digits that take --prompt-length tokens with the chat template."""
    tokenizer = load_tokenizer(str(folder / "model"))
    template = len(tokenizer(format_prompt(tokenizer, "", True), add_special_tokens=False).input_ids)
    generator = torch.Generator().manual_seed(0)
    digits = [torch.randint(10, (args.prompt_length - template,), generator=generator) for _ in range(4 * args.prompts)]
    rows = [{"prompt": "".join(map(str, prompt.tolist())), "answer": "1"} for prompt in digits]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def grpo_rounds(folder: Path, args: Args, config, name: str) -> dict:
    """grpo.py's figures for --rounds rounds after a warm-up with sampler `name`, from its metrics.jsonl."""
    options = {
        "model": folder / "model",
        "dataset": folder / "prompts.jsonl",
        "eval_every": 0,
        "eval_size": 0,
        "num_steps": 1 + args.rounds,
        "learning_rate": "1e-6",
        "output_dir": folder / "runs",
        "run_name": name,
    }
    batch = Shape(args.prompts, args.group_size, args.new_tokens, args.micro_batch_size)
    command = [sys.executable, str(ROOT / "grpo.py"), *as_flags(options), *SAMPLERS[name], *batch.flags()]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: grpo.py {' '.join(SAMPLERS[name])} failed:\n{result.stderr[-3000:]}")
    steps = [json.loads(line) for line in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()][1:]
    B, L = args.prompts * args.group_size, round(statistics.median(m["response/length_mean"] for m in steps))
    # micro-batches of whole groups: each group's prompt runs once
    flops = UPDATES_PER_ROLLOUT * update_flops(config, B, args.prompt_length + L, L, prompts=args.prompts)
    update_s = statistics.median(m["perf/update_s"] for m in steps)
    figures = {
        "round_s": statistics.median(m["perf/step_s"] for m in steps),
        "gen_s": statistics.median(m["perf/gen_s"] for m in steps),
        "gen_tokens_per_s": statistics.median(m["response/length_mean"] * B / m["perf/gen_s"] for m in steps),
        "update_s": update_s,
        "update_tflops_per_s": flops / update_s / 1e12,
        "peak_mem_gb": max(m["perf/peak_mem_gb"] for m in steps),
    }
    if torch.cuda.is_available():
        figures["mfu"] = figures["update_tflops_per_s"] / args.peak_tflops
    keys = ("sampler_logprob_gap", "sampler_logprob_gap_max", "correction_weight_mean", "correction_truncated_frac")
    figures |= {key: max(m[f"policy/{key}"] for m in steps) for key in keys if f"policy/{key}" in steps[0]}
    return figures


def main(args: Args) -> None:
    if args.device_check:
        args = replace(args, **DEVICE_CHECK)
    has_vllm, gpu = importlib.util.find_spec("vllm") is not None, torch.cuda.is_available()
    device = "GPU " + torch.cuda.get_device_name() if gpu else "CPU"
    print(
        f"{device}; {args.prompts} prompts of {args.prompt_length} tokens x {args.group_size} completions of "
        f"{args.new_tokens} new tokens, micro-batches of {args.micro_batch_size}, {args.rounds} timed round(s) "
        f"after a warm-up{'' if has_vllm else '; vLLM is not installed: generate only'}",
        flush=True,
    )
    results = {shape: {} for shape in args.shapes}
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as tmp:
            folder, config = Path(tmp), qwen_config(SHAPES[shape])
            torch.manual_seed(0)
            save_with_offline_tokenizer(
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), folder / "model"
            )
            dataset(folder, args)
            # vllm_weights_freed on a GPU only: on a CPU vLLM never sleeps, so it would repeat the vllm run
            for name in [
                n for n in SAMPLERS if (has_vllm or "--vllm" not in SAMPLERS[n]) and (gpu or n != "vllm_weights_freed")
            ]:
                figures = results[shape][name] = grpo_rounds(folder, args, config, name)
                print(
                    f"Qwen2.5-{shape} grpo.py {' '.join(SAMPLERS[name])}: "
                    + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()),
                    flush=True,
                )
            if not (args.trl and importlib.util.find_spec("trl") and torch.cuda.is_available()):
                print("grpo.py against TRL: not run (it needs trl and a GPU)", flush=True)
                continue
            batch = Shape(args.prompts, args.group_size, args.new_tokens, args.micro_batch_size)
            for vllm in (False, True) if has_vllm else (False,):
                result = compare(
                    "grpo",
                    "trl",
                    str(folder / "model"),
                    batch,
                    2,
                    1,
                    ["--vllm"] if vllm else [],
                    1,
                    str(folder / f"lockstep_{vllm}"),
                    trl_vllm=vllm,
                )
                print_comparison(result, batch, 2, 1)
                results[shape]["trl_vllm" if vllm else "trl"] = {
                    "grpo_round_s": result["this"]["median_s"],
                    "trl_round_s": result["other"]["median_s"],
                    "ratio": result["ratio"],
                }
    print(json.dumps(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(tyro.cli(Args))
