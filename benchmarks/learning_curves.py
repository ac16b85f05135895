"""Learning curves of every algorithm file on the offline default, several seeds each, side by side:
one CSV, a PNG of the curves (mean and min-max over seeds) and a table of how fast each file
reaches a target held-out accuracy.

    python -m benchmarks.learning_curves                        # from the repo root: 8 files x seeds 1 2 3 x 200 steps
    python -m benchmarks.learning_curves --configs grpo "gvpo --reuse-steps 1" --seeds 1 2
    python -m benchmarks.learning_curves --from-csv             # table and plot of --out only, no training

Every run is `python <file>.py --seed S --num-steps N --eval-every E` with the files' shared defaults
(32 prompts x 8 completions per step, 2 updates per rollout, learning rate 2e-4): the same rollout
budget per step for every file, except that DAPO's dynamic sampling draws extra rounds of prompts
to replace the groups it drops, which the `completions` column counts.

CSV columns, one row per (config, seed, step): `step` = training steps done; `wall_s` = their
training time (the sum of `perf/step_s` without evaluation); `completions` = completions sampled
by them; `eval_accuracy`, `eval_accuracy_greedy` = held-out accuracy of the policy after `step`
steps (500 prompts, one sample at T=1 / greedy; empty between evaluations); `reward_mean`,
`response_length` = of the rollout sampled at that step (empty at the last row). Each finished run
is appended at once, and runs already in the CSV are skipped, so an interrupted benchmark goes on
where it stopped. Plotting needs matplotlib (`pip install -r benchmarks/requirements.txt`);
without it the CSV and the table are still written.
"""

import csv
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo"]
COLUMNS = ["config", "seed", "step", "wall_s", "completions", "eval_accuracy", "eval_accuracy_greedy",
           "reward_mean", "response_length"]


def run(config: str, seed: int, steps: int, eval_every: int, extra: list[str], out: Path) -> list[dict]:
    """Train one configuration ("<file> [flags]") for one seed; its metrics as CSV rows."""
    file, *flags = shlex.split(config)
    name = f"{re.sub(r'[^A-Za-z0-9]+', '_', config)}_s{seed}"  # one folder per config and seed
    cmd = [sys.executable, str(ROOT / f"{file}.py"), *flags, "--seed", str(seed), "--num-steps", str(steps),
           "--eval-every", str(eval_every), "--output-dir", str(out), "--run-name", name, *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{result.stderr[-3000:]}")
    run_config = json.loads((out / name / "config.json").read_text())
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return to_rows(config, seed, metrics, run_config["prompts_per_step"] * run_config["group_size"])


def to_rows(config: str, seed: int, metrics: list[dict], completions_per_round: int) -> list[dict]:
    """metrics.jsonl lines -> one row per step. The line of step s holds the evaluation made before
    step s trains (so after s steps) and step s's rollout; the run's last line is the final evaluation."""
    rows, wall, completions = [], 0.0, 0
    for m in metrics:
        rows.append({"config": config, "seed": seed, "step": m["step"], "wall_s": round(wall, 3),
                     "completions": completions, "eval_accuracy": m.get("eval/accuracy"),
                     "eval_accuracy_greedy": m.get("eval/accuracy_greedy"), "reward_mean": m.get("reward/mean"),
                     "response_length": m.get("response/length_mean")})
        if "perf/step_s" in m:  # a training step (the final evaluation line has none)
            wall += m["perf/step_s"] - m.get("perf/eval_s", 0.0)
            completions += completions_per_round * round(m.get("algo/gen_rounds", 1))
    return rows


def read_csv(path: Path) -> list[dict]:
    def parse(key: str, value: str):
        if key == "config":
            return value
        if value == "":
            return None
        return int(value) if key in ("seed", "step", "completions") else float(value)

    with open(path, newline="") as f:
        return [{k: parse(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def append_csv(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


def curves(rows: list[dict], key: str) -> dict[str, dict[int, list[dict]]]:
    """config -> seed -> the rows that carry `key`, in step order."""
    out: dict[str, dict[int, list[dict]]] = {}
    for row in rows:
        if row[key] is not None:
            out.setdefault(row["config"], {}).setdefault(row["seed"], []).append(row)
    return {c: {s: sorted(r, key=lambda row: row["step"]) for s, r in seeds.items()} for c, seeds in out.items()}


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def summarize(rows: list[dict], target: float) -> list[dict]:
    """Per config: final held-out accuracy (mean ± std over seeds), and the first evaluation at which
    sampled accuracy reaches `target`: steps, training seconds and completions (mean over the seeds
    that reach it, and how many do)."""
    table = []
    for config, seeds in curves(rows, "eval_accuracy").items():
        finals = [r[-1] for r in seeds.values()]
        hits = [next((row for row in r if row["eval_accuracy"] >= target), None) for r in seeds.values()]
        reached = [h for h in hits if h is not None]

        def at_target(key: str, fmt: str) -> str:
            return format(statistics.mean(h[key] for h in reached), fmt) if reached else "-"

        table.append({
            "config": config, "seeds": len(seeds), "steps": finals[0]["step"],
            "final": mean_std([f["eval_accuracy"] for f in finals]),
            "final_greedy": mean_std([f["eval_accuracy_greedy"] for f in finals]),
            "reached": f"{len(reached)}/{len(seeds)}", "steps_to_target": at_target("step", ".0f"),
            "wall_to_target": at_target("wall_s", ".0f"), "completions_to_target": at_target("completions", ".0f"),
            "train_s": f"{statistics.mean(f['wall_s'] for f in finals):.0f}",
        })
    return table


def format_table(table: list[dict], target: float) -> str:
    lines = [f"| config | seeds | steps | final sampled acc. | final greedy acc. | reached {target} | "
             f"steps to {target} | train s to {target} | completions to {target} | train s (all) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['config']} | {t['seeds']} | {t['steps']} | {t['final']} | {t['final_greedy']} | "
                     f"{t['reached']} | {t['steps_to_target']} | {t['wall_to_target']} | "
                     f"{t['completions_to_target']} | {t['train_s']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Three panels: sampled and greedy held-out accuracy against steps, and sampled accuracy against
    completions sampled; a line per config (mean over seeds) in its min-max band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [("step", "eval_accuracy", "held-out accuracy (sampled, T=1)"),
              ("step", "eval_accuracy_greedy", "held-out accuracy (greedy)"),
              ("completions", "eval_accuracy", "held-out accuracy (sampled, T=1)")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (x_key, y_key, y_label) in zip(axes, panels):
        for k, (config, seeds) in enumerate(curves(rows, y_key).items()):
            runs = list(seeds.values())
            n = min(len(r) for r in runs)  # evaluations every seed has
            x = [statistics.mean(r[i][x_key] for r in runs) for i in range(n)]  # completions differ by seed
            ys = [[r[i][y_key] for r in runs] for i in range(n)]
            line, = ax.plot(x, [statistics.mean(y) for y in ys], label=f"{config} ({len(runs)} seeds)",
                            linestyle="-" if k < 10 else "--")  # the colour cycle has 10 colours
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
        ax.set_xlabel({"step": "training step", "completions": "completions sampled"}[x_key])
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@dataclass
class Args:
    configs: tuple[str, ...] = tuple(CONFIGS)
    """algorithm files, each optionally with its own flags, e.g. grpo "gvpo --reuse-steps 1" """
    seeds: tuple[int, ...] = (1, 2, 3)
    steps: int = 200
    eval_every: int = 20
    target: float = 0.7
    """held-out sampled accuracy for the table"""
    out: Path = ROOT / "benchmarks" / "results" / "learning_curves.csv"
    """the CSV (one --steps budget per file); the PNG is written next to it"""
    from_csv: bool = False
    """no training: the table and the plot from --out"""
    extra: str = ""
    """flags passed to every run, as one string after '=': --extra="--eval-size 100" """


def main(args: Args) -> None:
    extra = shlex.split(args.extra)
    for config in args.configs:
        if not (ROOT / f"{shlex.split(config)[0]}.py").exists():
            raise SystemExit(f"error: --configs: no file {shlex.split(config)[0]}.py "
                             f"(choose from {', '.join(CONFIGS)})")

    if not args.from_csv:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        existing = read_csv(args.out) if args.out.exists() else []
        done = {(r["config"], r["seed"]) for r in existing if r["step"] == args.steps}
        # seed-major: every config has a seed early, should the benchmark be stopped half way
        todo = [(c, s) for s in args.seeds for c in args.configs if (c, s) not in done]
        print(f"{len(todo)} runs of {args.steps} steps to do ({len(done)} already in {args.out})", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for i, (config, seed) in enumerate(todo, 1):
                start = time.perf_counter()
                new = run(config, seed, args.steps, args.eval_every, extra, Path(tmp))
                append_csv(args.out, new)
                final = new[-1]
                print(f"[{i}/{len(todo)}] {config} seed {seed}: held-out {new[0]['eval_accuracy']:.3f} -> "
                      f"{final['eval_accuracy']:.3f} (greedy {final['eval_accuracy_greedy']:.3f}), "
                      f"{time.perf_counter() - start:.0f} s", flush=True)

    if not args.out.exists():
        raise SystemExit(f"--from-csv: {args.out} does not exist; run without --from-csv first")
    rows = [r for r in read_csv(args.out) if r["config"] in args.configs and r["seed"] in args.seeds]
    print(format_table(summarize(rows, args.target), args.target))
    png = args.out.with_suffix(".png")
    title = (f"{', '.join(args.configs)} on the offline default, seeds {' '.join(map(str, args.seeds))}; "
             f"mean and min-max over seeds; plotted {time.strftime('%Y-%m-%d')}")
    if plot(rows, png, title):
        print(f"plot: {png}")
    else:
        print("no plot: matplotlib is not installed (pip install -r benchmarks/requirements.txt)")


if __name__ == "__main__":
    main(tyro.cli(Args))
