"""The real-model recipe: an algorithm file on GSM8K (Qwen2.5-0.5B-Instruct) or MATH (Qwen2.5-Math-1.5B),
run as a user would, with the held-out accuracy before and after training printed at the end.

Needs one GPU, the model and the dataset reachable (the Hugging Face Hub, or local copies passed with
--model and --dataset) and `pip install datasets`. The run's metrics and checkpoints go to
<output-dir>/<file>-<recipe>/, and a summary to <output-dir>/<file>-<recipe>.json.

    python -m benchmarks.real_model                       # grpo.py, Qwen2.5-0.5B-Instruct, GSM8K train -> test
    python -m benchmarks.real_model --file dapo.py
    python -m benchmarks.real_model --recipe math         # Qwen2.5-Math-1.5B, MATH train -> MATH-500
    python -m benchmarks.real_model --flags="--beta 0 --micro-batch-size 8"   # any flag of the file, given last
"""

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import tyro

ROOT = Path(__file__).resolve().parent.parent

# The data of each recipe, and the flags that matter at this scale (one GPU, 0.5B-1.5B parameters).
RECIPES = {
    "gsm8k": dict(model="Qwen/Qwen2.5-0.5B-Instruct", dataset="openai/gsm8k", dataset_config="main",
                  prompt_field="question", answer_field="answer", eval_dataset=None, eval_split="test",
                  max_new_tokens=512),
    "math": dict(model="Qwen/Qwen2.5-Math-1.5B", dataset="DigitalLearningGmbH/MATH-lighteval", dataset_config=None,
                 prompt_field="problem", answer_field="solution", eval_dataset="HuggingFaceH4/MATH-500",
                 eval_split="test", max_new_tokens=1024),
}
SCALE_FLAGS = ["--learning-rate", "1e-6", "--prompts-per-step", "32", "--group-size", "8", "--micro-batch-size", "16",
               "--max-prompt-length", "512", "--temperature", "1.0", "--save-every", "50"]


@dataclass
class Args:
    recipe: Literal["gsm8k", "math"] = "gsm8k"
    """GSM8K with Qwen2.5-0.5B-Instruct, or MATH with Qwen2.5-Math-1.5B (held out: MATH-500)"""
    file: str = "grpo.py"
    """the algorithm file to run"""
    num_steps: int = 200
    """training steps (held-out accuracy is measured before the first and after the last)"""
    model: Optional[str] = None
    """instead of the recipe's model (a Hub name or a local folder)"""
    dataset: Optional[str] = None
    """instead of the recipe's training data (with --dataset-config, --prompt-field, ... as the file takes them)"""
    dataset_config: Optional[str] = None
    eval_dataset: Optional[str] = None
    eval_split: Optional[str] = None
    prompt_field: Optional[str] = None
    answer_field: Optional[str] = None
    max_new_tokens: Optional[int] = None
    flags: str = ""
    """more flags for the file, as --flags="--beta 0 --micro-batch-size 8" (given last: they override the recipe's)"""
    output_dir: str = "runs/real_model"
    """where the run's folder and the summary go"""


def command(args: Args) -> list[str]:
    """The file's command line: the recipe's data and scale flags, then --flags."""
    data = dict(RECIPES[args.recipe])
    if args.dataset is not None:  # other data: only what is given
        data = {key: None for key in data} | {"model": data["model"], "max_new_tokens": data["max_new_tokens"]}
    for key in data:
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    cmd = [sys.executable, str(ROOT / args.file)]
    for key, value in data.items():
        if value is not None:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    name = f"{Path(args.file).stem}-{args.recipe}"
    return cmd + SCALE_FLAGS + ["--num-steps", str(args.num_steps), "--eval-every", str(args.num_steps),
                                "--output-dir", args.output_dir, "--run-name", name, *shlex.split(args.flags)]


def main(args: Args) -> dict:
    cmd = command(args)
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    name = cmd[cmd.index("--run-name") + 1]
    metrics = [json.loads(line) for line in (Path(args.output_dir) / name / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/accuracy" in m]
    summary = {
        "file": args.file, "recipe": args.recipe, "command": cmd[1:], "steps": evals[-1]["step"],
        "hours": (time.perf_counter() - start) / 3600,
        "accuracy_before": evals[0]["eval/accuracy"], "accuracy_after": evals[-1]["eval/accuracy"],
        "greedy_before": evals[0]["eval/accuracy_greedy"], "greedy_after": evals[-1]["eval/accuracy_greedy"],
    }
    (Path(args.output_dir) / f"{name}.json").write_text(json.dumps(summary, indent=2))
    print(f"{args.file} on {args.recipe}, {summary['steps']} steps, {summary['hours']:.2f} h: held-out accuracy "
          f"{summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f} (one sample at T=1), greedy "
          f"{summary['greedy_before']:.3f} -> {summary['greedy_after']:.3f}")
    return summary


if __name__ == "__main__":
    main(tyro.cli(Args))
