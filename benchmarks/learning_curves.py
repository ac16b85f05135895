"""Learning curves of every algorithm file on a built-in task, several seeds each, side by side: one CSV, a PNG of
the curves (mean and min-max over seeds), how fast each file reaches a target held-out accuracy, and on the chain,
guess and stress tasks the lab's rollout metrics (docs/lab.md).

    python -m benchmarks.learning_curves                        # from the repo root: 10 files x seeds 1 2 3 x 200 steps
    python -m benchmarks.learning_curves --task chain           # the lab: 10 files and 4 variants x 3 seeds x 60 steps
    python -m benchmarks.learning_curves --task guess --eval-every 4   # multi-turn: 10 files x 3 seeds x 12 steps
    python -m benchmarks.learning_curves --task stress          # the chain, 16 optimizer steps per rollout
    python -m benchmarks.learning_curves --task stress --rates 2e-4 5e-5 1.25e-5 --jobs 2   # each config at 3 rates
    python -m benchmarks.learning_curves --task stress --configs dapo "dapo +keep-all-groups"  # a change, not a flag
    python -m benchmarks.learning_curves --task chain --configs grpo cispo --off-policy-steps 0 4 --jobs 2 \\
        --out benchmarks/results/off_policy_chain.csv      # the lab's off-policy grid: K x anchors (docs/lab.md)
    python -m benchmarks.learning_curves --configs grpo "gvpo --reuse-steps 1" --seeds 1 2
    python -m benchmarks.learning_curves --from-csv             # table and plot of --out only, no training

Every run is `python <file>.py --seed S --num-steps N --eval-every E` with the files' shared defaults and the task's
flags (`TASKS`): the same rollouts per step for every file, but for DAPO's extra rounds of dynamic sampling, which
`completions` counts; a `+name` in a config makes a change no flag makes (CHANGES), and names it in the CSV. CSV
rows (config, seed, step): `wall_s`, the training seconds so far (without evaluation); `eval_accuracy`,
`eval_accuracy_greedy` after `step` steps (empty between evaluations); `reward_mean` and the rest (`ROLLOUT`,
docs/metrics.md), of that step's rollout. Each finished run is appended at once and runs already there are skipped:
an interrupted benchmark goes on where it stopped. --jobs N runs N at a time on cores/N threads each; a run on one
thread gives the same digits again, on more the math library may take fewer when busy. The plot needs matplotlib."""

import csv
import importlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import tyro

from benchmarks import as_flags

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo", "sapo", "dppo"]
# The lab's variants (docs/lab.md says what each one probes)
LAB_CONFIGS = {
    "chain": [
        "dapo --clip-eps-high 0.2",
        "dapo --overlong-buffer 0",
        "gvpo --reuse-steps 1 --updates-per-rollout 1",
        "gvpo --demos-per-group 2",
    ],
    "stress": [
        "dapo --clip-eps-high 0.2",
        "gvpo --target-kl 1",
        "grpo --beta 0",
        "sapo --beta 0.04",
        "sapo --tau-pos 10 --tau-neg 10.5",
    ],
}
# steps, target held-out accuracy, flags (the chain task starts at ~0.27: 0.4 is ~5 evaluation standard errors above)
CHAIN, GUESS = ["--task", "chain", "--prompts-per-step", "16"], ["--task", "guess", "--prompts-per-step", "8"]
TASKS = {
    "add": (200, 0.7, []),
    "chain": (60, 0.4, CHAIN),
    "guess": (12, 0.5, GUESS + ["--eval-size", "100"]),
    "stress": (60, 0.4, CHAIN + ["--num-minibatches", "8", "--eval-size", "250"]),
}
ROLLOUT = {
    "reward_mean": "reward/mean",
    "correct": "reward/correct",  # column: metric of the rollout
    "response_length": "response/length_mean",
    "length_correct": "response/length_correct",
    "length_wrong": "response/length_wrong",
    "truncated_frac": "response/truncated_frac",
    "entropy": "policy/entropy",
    "clipfrac_low": "policy/clipfrac_low",
    "clipfrac_high": "policy/clipfrac_high",
    "self_correction_frac": "task/self_correction_frac",
    "turns": "env/turns",
    "self_correction_accuracy": "task/self_correction_accuracy",
    "kept_groups_frac": "algo/kept_groups_frac",
    "explained_variance": "algo/explained_variance",
    "step_s": "perf/step_s",
    "approx_kl": "policy/approx_kl",
    "gradient_removed": "policy/gradient_removed",
    "gate_weight": "policy/gate_weight",
    "beta": "algo/beta",
    "maskfrac": "policy/maskfrac",
    "band_clipfrac": "policy/band_clipfrac",
    "kl_to_anchor": "algo/kl_to_anchor",
    "off_policy_steps": "policy/off_policy_steps",
    "sampler_gap": "policy/sampler_logprob_gap",
    "ratio_ess": "policy/sampler_ratio_ess",
    "correction_ess": "policy/correction_ess",
    "correction_truncated": "policy/correction_truncated_frac",
    "correction_masked": "policy/correction_masked_frac",
}
COLUMNS = ["config", "seed", "step", "wall_s", "completions", "eval_accuracy", "eval_accuracy_greedy", *ROLLOUT]


def staleness(config: str, steps: int, anchor: str) -> str:
    """The config with rollouts sampled `steps` behind and `anchor`'s flags; at 0 steps the config as it is (in fp32
    pi_old, the sampler and the correction's weights agree to ~1e-6: the anchors are one run)."""
    if steps == 0:
        return config
    flags = {"recompute": "--rollout-correction none", "behaviour": "--anchor behaviour"}
    return f"{config} --off-policy-steps {steps} {flags.get(anchor, f'--rollout-correction {anchor}')}"


def off_policy_grid(configs: tuple[str, ...], steps: tuple[int, ...], anchors: tuple[str, ...]) -> tuple[str, ...]:
    """Each config at each K under each anchor, K = 0 once."""
    return tuple(dict.fromkeys(staleness(c, k, a) for c in configs for k in steps for a in anchors))


def keep_all_groups(filter_groups):  # dapo.py without dynamic sampling: every group trained, one-outcome ones too
    return lambda correct, group_size: correct.new_ones(len(correct) // group_size).bool()


def sequence_mean(compute_loss):
    """dapo.py without the token-level loss: each completion's token mean, then the mean over completions (grpo's)"""

    def loss(logprobs, old_logprobs, advantages, mask, num_tokens, *clip):  # len(mask) below: the step's completions
        assert mask.sum() == num_tokens, "+sequence-mean: the step in one micro-batch (one rank, no --micro-batch-*)"
        per_completion = mask / mask.sum(-1, keepdim=True).clamp(min=1)  # each completion's tokens weigh 1 in all
        metrics = compute_loss(logprobs, old_logprobs, advantages, mask, num_tokens, *clip)[1]  # logged as dapo's
        return compute_loss(logprobs, old_logprobs, advantages, per_completion, len(mask), *clip)[0], metrics

    return loss


CHANGES = {"+keep-all-groups": ("filter_groups", keep_all_groups), "+sequence-mean": ("compute_loss", sequence_mean)}


def changed(file: str, changes: list[str]) -> None:
    """Run <file>.py with the CHANGES named made to its functions (main calls them by their module names)."""
    module = importlib.import_module(file)
    for name, change in (CHANGES[c] for c in changes):
        setattr(module, name, change(getattr(module, name)))
    module.main(module.cli(module.Args))


def run(config: str, seed: int, steps: int, eval_every: int, extra: list[str], out: Path, threads: int) -> list[dict]:
    """Train one configuration ("<file> [+change] [flags]") for one seed; its metrics as CSV rows."""
    file, *flags = shlex.split(config)
    changes, flags = [f for f in flags if f in CHANGES], [f for f in flags if f not in CHANGES]
    name = f"{re.sub(r'[^A-Za-z0-9]+', '_', config)}_s{seed}"  # one folder per config and seed
    script = (
        ["-c", f"from benchmarks.learning_curves import changed; changed({file!r}, {changes})"]
        if changes
        else [str(ROOT / f"{file}.py")]
    )
    options = {"seed": seed, "num_steps": steps, "eval_every": eval_every, "output_dir": out, "run_name": name}
    cmd = [sys.executable, *script, *flags, *as_flags(options), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed:\n{result.stderr[-3000:]}")
    run_config = json.loads((out / name / "config.json").read_text())
    metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    sampled = run_config["group_size"] - run_config.get("demos_per_group", 0)
    return to_rows(config, seed, metrics, run_config["prompts_per_step"] * sampled)


def to_rows(config: str, seed: int, metrics: list[dict], completions_per_round: int) -> list[dict]:
    """metrics.jsonl lines -> a row per step: the evaluation before step s trains (after s steps), and its rollout."""
    rows, wall, completions = [], 0.0, 0
    for m in metrics:
        rows.append(
            {
                "config": config,
                "seed": seed,
                "step": m["step"],
                "wall_s": round(wall, 3),
                "completions": completions,
                "eval_accuracy": m.get("eval/accuracy"),
                "eval_accuracy_greedy": m.get("eval/accuracy_greedy"),
                **{column: m.get(key) for column, key in ROLLOUT.items()},
            }
        )
        if "perf/step_s" in m:  # a training step (the final evaluation line has none)
            wall += m["perf/step_s"] - m.get("perf/eval_s", 0.0)
            completions += completions_per_round * round(m.get("algo/gen_rounds", 1))
    return rows


def read_csv(path: Path) -> list[dict]:
    def parse(key: str, value: str):  # 'nan' is a float too
        if key == "config":
            return value
        if value == "":
            return None
        return int(value) if key in ("seed", "step", "completions") else float(value)

    with open(path, newline="") as f:
        return [{k: parse(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def append_csv(path: Path, rows: list[dict]) -> None:
    """Rows appended under the file's header (one written before a column was added keeps its columns)."""
    columns = next(csv.reader(open(path))) if path.exists() else COLUMNS
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if not path.stat().st_size:
            writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)


def curves(rows: list[dict], key: str) -> dict[str, dict[int, list[dict]]]:
    """config -> seed -> the rows that carry `key`, in step order."""
    out: dict[str, dict[int, list[dict]]] = {}
    for row in rows:
        if row.get(key) is not None:
            out.setdefault(row["config"], {}).setdefault(row["seed"], []).append(row)
    return {c: {s: sorted(r, key=lambda row: row["step"]) for s, r in seeds.items()} for c, seeds in out.items()}


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def collapse_step(run: list[dict], floor: float = 0.05, span: int = 5) -> Optional[int]:
    """The first of `span` steps in a row whose rollouts average below `floor` accuracy, or None: a run there has
    collapsed (a group all wrong has no advantage, so nothing trains it back)."""
    accuracy = [row["correct"] for row in run]
    return next(
        (run[i]["step"] for i in range(len(run) - span + 1) if statistics.mean(accuracy[i : i + span]) < floor), None
    )


def summarize(rows: list[dict], target: float) -> list[dict]:
    """Per config: final held-out accuracy (mean ± std over seeds); steps, seconds and completions until the first
    evaluation at `target` (mean over the seeds that reach it, and how many do)."""
    table, rollouts = [], curves(rows, "correct")
    for config, seeds in curves(rows, "eval_accuracy").items():
        finals = [r[-1] for r in seeds.values()]
        ran = rollouts.get(config, {}).values()  # empty where the CSV has no `correct` column
        fell = [s for s in map(collapse_step, ran) if s is not None]
        hits = [next((row for row in r if row["eval_accuracy"] >= target), None) for r in seeds.values()]
        reached = [h for h in hits if h is not None]

        def at_target(key: str) -> str:
            return f"{statistics.mean(h[key] for h in reached):.0f}" if reached else "-"

        collapsed = "-"  # no rollout accuracy recorded
        if ran:
            collapsed = f"{len(fell)}/{len(ran)}" + (f" ({', '.join(map(str, fell))})" if fell else "")
        table.append(
            {
                "config": config,
                "seeds": len(seeds),
                "steps": finals[0]["step"],
                "final": mean_std([f["eval_accuracy"] for f in finals]),
                "gain": mean_std([r[-1]["eval_accuracy"] - r[0]["eval_accuracy"] for r in seeds.values()]),
                "collapsed": collapsed,
                "final_greedy": mean_std([f["eval_accuracy_greedy"] for f in finals]),
                "reached": f"{len(reached)}/{len(seeds)}",
                "steps_to_target": at_target("step"),
                "wall_to_target": at_target("wall_s"),
                "completions_to_target": at_target("completions"),
                "train_s": f"{statistics.mean(f['wall_s'] for f in finals):.0f}",
            }
        )
    return table


def format_table(table: list[dict], target: float) -> str:
    heads = {
        "config": "config",
        "seeds": "seeds",
        "steps": "steps",
        "final": "final sampled acc.",
        "gain": "gain",
        "final_greedy": "final greedy acc.",
        "collapsed": "collapsed (at step)",
        "reached": f"reached {target}",
        "steps_to_target": f"steps to {target}",
        "wall_to_target": f"train s to {target}",
        "completions_to_target": f"completions to {target}",
        "train_s": "train s (all)",
    }
    lines = ["| " + " | ".join(heads.values()) + " |", "|---" * len(heads) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(t[key]) for key in heads) + " |" for t in table])


PANELS = [
    ("step", "eval_accuracy", "held-out accuracy (sampled, T=1)"),
    ("step", "eval_accuracy_greedy", "held-out accuracy (greedy)"),
    ("completions", "eval_accuracy", "held-out accuracy (sampled, T=1)"),
]
LAB = {
    "chain": [
        "entropy",
        "length_correct",
        "length_wrong",
        "truncated_frac",
        "clipfrac_low",
        "clipfrac_high",
        "self_correction_frac",
        "self_correction_accuracy",
        "kept_groups_frac",
        "explained_variance",
        "step_s",
    ],
    "guess": ["turns", "truncated_frac", "response_length", "entropy", "step_s"],
    "off-policy": [
        "sampler_gap",
        "ratio_ess",
        "correction_ess",
        "correction_truncated",
        "correction_masked",
        "approx_kl",
        "clipfrac_low",
        "clipfrac_high",
        "maskfrac",
        "gate_weight",
        "entropy",
    ],
    "stress": [
        "entropy",
        "approx_kl",
        "clipfrac_low",
        "clipfrac_high",
        "gradient_removed",
        "gate_weight",
        "maskfrac",
        "band_clipfrac",
        "beta",
        "kl_to_anchor",
        "step_s",
    ],
}


def plot(rows: list[dict], path: Path, title: str, panels: list[tuple[str, str, str]]) -> bool:
    """A panel per (x, y, label): a line per config (mean over seeds) in its min-max band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    columns = min(len(panels), 4)
    rows_of_panels = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows_of_panels, columns, figsize=(4.5 * columns, 4 * rows_of_panels), squeeze=False)

    def split(config: str) -> tuple[str, str]:  # a config keeps its colour in every panel, a rate its line style
        return config.partition(" --learning-rate ")[::2]

    bases, rates = (list(dict.fromkeys(split(row["config"])[i] for row in rows)) for i in (0, 1))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (x_key, y_key, y_label) in zip(axes.flat, panels):
        for config, seeds in curves(rows, y_key).items():
            k, rate = bases.index(split(config)[0]), rates.index(split(config)[1])
            runs = [{row["step"]: row for row in run} for run in seeds.values()]
            steps = sorted(set.intersection(*(set(run) for run in runs)))
            x = [statistics.mean(run[s][x_key] for run in runs) for s in steps]  # completions differ by seed
            ys = [[run[s][y_key] for run in runs] for s in steps]
            colour, style = colours[k % len(colours)], ["-", "--", ":", "-."][(rate + k // len(colours)) % 4]
            ax.plot(
                x,
                [statistics.mean(y) for y in ys],
                color=colour,
                linestyle=style,
                label=f"{config} ({len(runs)} seeds)",
            )
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=colour, alpha=0.15)
        ax.set_xlabel({"step": "training step", "completions": "completions sampled"}[x_key])
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if len(panels) < axes.size:  # the legend in the first empty cell, else over the first panel
        axes.flat[len(panels)].legend(*axes.flat[0].get_legend_handles_labels(), loc="center", fontsize=9)
    else:
        axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def lab_table(rows: list[dict], keys: list[str], window: int = 10) -> str:
    """Per config, each metric of `keys` over the first and the last `window` steps: mean over seeds [min, max]."""

    def spread(values: list[float]) -> str:
        return f"{statistics.mean(values):.3g} [{min(values):.3g}, {max(values):.3g}]"

    lines = [f"| config | {' | '.join(keys)} |", "|---" * (len(keys) + 1) + "|"]
    for config, seeds in curves(rows, "step").items():
        cells = []
        for key in keys:
            values = [[row[key] for row in run if row.get(key) is not None] for run in seeds.values()]
            cells.append(
                "-"
                if not all(values)
                else f"{spread([statistics.mean(v[:window]) for v in values])} → "
                f"{spread([statistics.mean(v[-window:]) for v in values])}"
            )
        lines.append(f"| {config} | {' | '.join(cells)} |")
    return "\n".join(lines)


@dataclass
class Args:
    task: Literal["add", "chain", "guess", "stress"] = "add"
    """add (the offline default), chain (the lab), guess (multi-turn), stress (the chain, 16 steps per rollout)"""
    configs: Optional[tuple[str, ...]] = None
    """algorithm files, each optionally with its own flags, e.g. grpo "gvpo --reuse-steps 1"; left out: the 10
    files (and on the chain and stress tasks the lab's variants, LAB_CONFIGS)"""
    seeds: tuple[int, ...] = (1, 2, 3)
    steps: Optional[int] = None
    """training steps of each run; left out: 200 for add, 60 for chain and stress, 12 for guess"""
    eval_every: int = 20
    target: Optional[float] = None
    """held-out sampled accuracy for the table; left out: 0.7 for add, 0.4 for chain and stress, 0.5 for guess"""
    out: Optional[Path] = None
    """the CSV, the PNG beside it; left out: benchmarks/results/learning_curves[_<task>].csv"""
    from_csv: bool = False
    """no training: the table and the plot from --out"""
    extra: str = ""
    """flags passed to every run, as one string after '=': --extra="--eval-size 100" """
    rates: tuple[str, ...] = ()
    """learning rates: each config runs at each, as '<config> --learning-rate R'; left out: the files' own"""
    jobs: int = 1
    """runs at a time, each on cores/jobs threads"""
    off_policy_steps: tuple[int, ...] = ()
    """K: each config runs with rollouts sampled K steps behind, under each of --anchors (K = 0: once, as it is)"""
    anchors: tuple[Literal["recompute", "tis", "geo-mis", "behaviour"], ...] = ("recompute", "tis", "behaviour")
    """with --off-policy-steps: recompute (pi_old at the update's start, no correction), tis or geo-mis (the same,
    weighted by pi_old / pi_sampler: decoupled), behaviour (pi_old the sampler's)"""


def main(args: Args) -> None:
    steps, target, task_flags = TASKS[args.task]
    args.steps, args.target = args.steps or steps, args.target or target
    args.configs = args.configs or tuple(CONFIGS + LAB_CONFIGS.get(args.task, []))
    args.configs = tuple(f"{c} --learning-rate {r}" for r in args.rates for c in args.configs) or args.configs
    args.configs = off_policy_grid(args.configs, args.off_policy_steps, args.anchors) or args.configs
    args.out = args.out or ROOT / "benchmarks" / "results" / (
        "learning_curves.csv" if args.task == "add" else f"learning_curves_{args.task}.csv"
    )
    extra = task_flags + shlex.split(args.extra)
    for file in [f for f in (shlex.split(config)[0] for config in args.configs) if not (ROOT / f"{f}.py").exists()]:
        raise SystemExit(f"error: --configs: no file {file}.py (choose from {', '.join(CONFIGS)})")

    if not args.from_csv:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        done = {
            (r["config"], r["seed"])
            for r in (read_csv(args.out) if args.out.exists() else [])
            if r["step"] == args.steps
        }
        # seed-major: every config has a seed early, should the benchmark be stopped half way
        todo = [(c, s) for s in args.seeds for c in args.configs if (c, s) not in done]
        print(f"{len(todo)} runs of {args.steps} steps to do ({len(done)} already in {args.out})", flush=True)
        start_all, threads = time.perf_counter(), max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else 0
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:  # results in todo's order
            runs = pool.map(lambda c_s: run(*c_s, args.steps, args.eval_every, extra, Path(tmp), threads), todo)
            for i, ((config, seed), new) in enumerate(zip(todo, runs), 1):
                append_csv(args.out, new)
                print(
                    f"[{i}/{len(todo)}] {config} seed {seed}: held-out {new[0]['eval_accuracy']:.3f} -> "
                    f"{new[-1]['eval_accuracy']:.3f} (greedy {new[-1]['eval_accuracy_greedy']:.3f}), "
                    f"{time.perf_counter() - start_all:.0f} s so far",
                    flush=True,
                )
        print(f"{len(todo)} runs in {(time.perf_counter() - start_all) / 60:.1f} minutes")

    if not args.out.exists():
        raise SystemExit(f"--from-csv: {args.out} does not exist; run without --from-csv first")
    rows = [r for r in read_csv(args.out) if r["config"] in args.configs and r["seed"] in args.seeds]
    print(format_table(summarize(rows, args.target), args.target))
    panels, lab = PANELS, "off-policy" if args.off_policy_steps else args.task
    if lab in LAB:
        window = max(1, min(10, args.steps // 3))  # 10 steps on the chain task, 4 on guess
        print(
            f"\nEach rollout metric over the first and the last {window} steps (mean over seeds [min, max]):\n"
            f"{lab_table(rows, LAB[lab], window)}"
        )
        panels = PANELS + [
            ("step", key, key.replace("_", " "))
            for key in LAB[lab]  # those some run logs
            if any(row.get(key) is not None for row in rows)
        ]
    png, seeds = args.out.with_suffix(".png"), " ".join(map(str, args.seeds))
    title = f"{len(args.configs)} configurations on the {args.task} task, seeds {seeds}; mean and min-max over seeds"
    print(
        f"plot: {png}"
        if plot(rows, png, f"{title}; plotted {time.strftime('%Y-%m-%d')}", panels)
        else "no plot: matplotlib is not installed (pip install -r benchmarks/requirements.txt)"
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
