"""Where a training step's time goes, for every algorithm file on the offline default: generation,
old/reference log-probs (and PPO's values), the update, tokens per second and peak memory; then how
grpo.py's step time grows as the group size and the generation limit double. Runs one after the
other, as here, show where the time goes; for ratios (against TRL's GRPOTrainer, or a file before and
after a change) they are too noisy on a shared machine: benchmarks/lockstep.py measures those.

    python -m benchmarks.step_time                 # from the repo root: every file, 12 steps each, then scaling
    python -m benchmarks.step_time --steps 30 --files grpo ppo --no-scaling
    python -m benchmarks.step_time --extra "--prompts-per-step 64"   # flags passed to every run

Each configuration runs as its own process (`python <file>.py --eval-every 0 ...`); the figures are
the means of the `perf/*` metrics over the steps after the first two (warm-up). Not a test: timings
depend on the machine and on whatever else runs on it.
"""

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

ROOT = Path(__file__).resolve().parent.parent
FILES = ["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo"]
KEYS = ["perf/step_s", "perf/gen_s", "perf/logprobs_s", "perf/update_s", "perf/tokens_per_s", "perf/peak_mem_gb",
        "response/length_mean"]


def run(file: str, steps: int, extra: list[str], out: Path) -> dict[str, float]:
    name = f"{file}_{'_'.join(extra) or 'default'}".replace("-", "")
    cmd = [sys.executable, str(ROOT / f"{file}.py"), "--num-steps", str(steps), "--eval-every", "0",
           "--output-dir", str(out), "--run-name", name, *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()][2:]
    return {k: statistics.mean(r[k] for r in rows) for k in KEYS}


@dataclass
class Args:
    steps: int = 12
    """steps per run; the first two are left out of the means"""
    files: tuple[Literal["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo"], ...] = tuple(FILES)
    scaling: bool = True
    """the group-size and generation-limit runs after the table"""
    extra: str = ""
    """flags passed to every run, as one string after '=': --extra="--prompts-per-step 64" """


def main(args: Args) -> None:
    extra = shlex.split(args.extra)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        print(f"offline default, {args.steps} steps each (mean of steps 2..{args.steps - 1})")
        print("| file | step s | generation s | log-probs s | update s | response tokens/s | peak GB |")
        print("|---|---|---|---|---|---|---|")
        for file in args.files:
            m = run(file, args.steps, extra, out)
            print(f"| {file}.py | {m['perf/step_s']:.3f} | {m['perf/gen_s']:.3f} | {m['perf/logprobs_s']:.3f} | "
                  f"{m['perf/update_s']:.3f} | {m['perf/tokens_per_s']:.0f} | {m['perf/peak_mem_gb']:.2f} |",
                  flush=True)
        if not args.scaling:
            return
        for flag, values in [("--group-size", [8, 16, 32]), ("--max-new-tokens", [8, 16, 32])]:
            print(f"\ngrpo.py, {flag} doubling (other flags default)")
            print(f"| {flag} | step s | x previous | generation s | update s | response length |")
            print("|---|---|---|---|---|---|")
            previous = None
            for value in values:
                m = run("grpo", args.steps, [flag, str(value), *extra], out)
                growth = f"{m['perf/step_s'] / previous:.2f}" if previous else "-"
                previous = m["perf/step_s"]
                print(f"| {value} | {m['perf/step_s']:.3f} | {growth} | {m['perf/gen_s']:.3f} | "
                      f"{m['perf/update_s']:.3f} | {m['response/length_mean']:.2f} |", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
