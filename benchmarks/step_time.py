"""Where a training step's time goes, for every algorithm file on the offline default: generation,
old/reference log-probs (and PPO's values), the update, tokens per second and peak memory; then how
grpo.py's step time grows as the group size and the generation limit double; and, when `trl` is
installed (optional: pip install -r benchmarks/requirements.txt), grpo.py's step time over that of
TRL's GRPOTrainer at the same configuration (benchmarks/trl_grpo.py), measured in the same run.

    python -m benchmarks.step_time                 # from the repo root: every file, 12 steps each, then scaling
    python -m benchmarks.step_time --steps 30 --files grpo ppo --no-scaling --no-trl
    python -m benchmarks.step_time --extra "--prompts-per-step 64"   # flags passed to every run

Each configuration runs as its own process (`python <file>.py --eval-every 0 ...`); the figures are
the means of the `perf/*` metrics over the steps after the first two (warm-up). Not a test: timings
depend on the machine and on whatever else runs on it.
"""

import importlib.util
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


def compare_with_trl(grpo: dict[str, float], steps: int, extra: list[str]) -> None:
    """grpo.py's mean step time over TRL GRPOTrainer's mean rollout round, same configuration."""
    if importlib.util.find_spec("trl") is None:
        print("\nTRL comparison skipped: trl is not installed (pip install -r benchmarks/requirements.txt)")
        return
    cmd = [sys.executable, "-m", "benchmarks.trl_grpo", "--steps", str(steps), *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    trl = json.loads(result.stdout.splitlines()[-1])["trl_round_s"]
    print(f"\nTRL GRPOTrainer at grpo.py's configuration: {trl:.3f} s per rollout round; "
          f"grpo.py {grpo['perf/step_s']:.3f} s; grpo.py / TRL = {grpo['perf/step_s'] / trl:.2f}", flush=True)


@dataclass
class Args:
    steps: int = 12
    """steps per run; the first two are left out of the means"""
    files: tuple[Literal["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo"], ...] = tuple(FILES)
    scaling: bool = True
    """the group-size and generation-limit runs after the table"""
    trl: bool = True
    """the comparison with TRL, when trl is installed"""
    extra: str = ""
    """flags passed to every run, as one string after '=': --extra="--prompts-per-step 64" (the TRL run
    takes --prompts-per-step, --group-size, --max-new-tokens, --updates-per-rollout, --learning-rate,
    --beta, --seed)"""


def main(args: Args) -> None:
    extra = shlex.split(args.extra)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        print(f"offline default, {args.steps} steps each (mean of steps 2..{args.steps - 1})")
        print("| file | step s | generation s | log-probs s | update s | response tokens/s | peak GB |")
        print("|---|---|---|---|---|---|---|")
        measured = {}
        for file in args.files:
            m = measured[file] = run(file, args.steps, extra, out)
            print(f"| {file}.py | {m['perf/step_s']:.3f} | {m['perf/gen_s']:.3f} | {m['perf/logprobs_s']:.3f} | "
                  f"{m['perf/update_s']:.3f} | {m['perf/tokens_per_s']:.0f} | {m['perf/peak_mem_gb']:.2f} |",
                  flush=True)
        if args.trl:
            compare_with_trl(measured.get("grpo") or run("grpo", args.steps, extra, out), args.steps, extra)
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
