"""The benchmark scripts run (at tiny shapes) and print their figures; the figures themselves are
measured by running the scripts, not asserted here."""

import json
import re

import pytest
import torch

from conftest import ROOT, run

pytestmark = pytest.mark.slow  # each benchmark run at a tiny shape: `-m 'not slow'` skips them


def test_memory_fit_table_and_one_measurement_run(tmp_path):
    result = run(["-m", "benchmarks.memory_fit"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "| README.md | grpo.py | Qwen/Qwen2.5-7B-Instruct | 16 | --fsdp --gradient-checkpointing" in result.stdout
    command = "python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --micro-batch-size 16"
    result = run(["-m", "benchmarks.memory_fit", "--command", command], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["loading", "sampling", "update", "fits:"]
    result = run(["-m", "benchmarks.memory_fit", "--one", "1", "32", "64", "2", "16", "1"], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    measured, predicted, params = result.stdout.split()[-3:]
    assert float(measured) > 0 and float(predicted) > 0 and int(params) > 0


def test_memory_formula_counts_parameters_like_the_model():
    import torch  # noqa: F401
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks.memory_fit import Shape

    config = Qwen3Config(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    shape = Shape("t", 3, 64, 96, 4, 2, vocab=100)
    # Qwen3 adds a q/k norm per layer (2 x head_dim) that Qwen2.5's shapes do not have
    assert shape.params == sum(p.numel() for p in model.parameters()) - 3 * 2 * 16


def test_learning_curves_write_csv_resume_and_summarize(tmp_path):
    """Two tiny runs of one file with different flags go to the CSV, each with its own rows; a second call
    skips them (nothing rerun), and the table is printed."""
    out = tmp_path / "curves.csv"
    args = [
        "-m",
        "benchmarks.learning_curves",
        "--configs",
        "grpo",
        "grpo --beta 0",
        "--seeds",
        "1",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--out",
        str(out),
        "--extra=--eval-size 8 --prompts-per-step 4 --group-size 4",
    ]
    result = run(args, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    from benchmarks.learning_curves import read_csv

    rows = read_csv(out)
    assert [(r["config"], r["step"]) for r in rows] == [(c, s) for c in ["grpo", "grpo --beta 0"] for s in range(3)]
    assert [r["completions"] for r in rows[:3]] == [0, 16, 32]  # 4 prompts x 4 completions per step
    assert rows[2]["reward_mean"] is None and rows[2]["eval_accuracy"] is not None  # the final evaluation
    assert "| grpo | 1 | 2 |" in result.stdout
    again = run(args, cwd=ROOT)
    assert again.returncode == 0, again.stderr
    assert "0 runs of 2 steps to do (2 already in" in again.stdout
    assert len(read_csv(out)) == len(rows)


def test_learning_curves_summary_counts_steps_to_target():
    from benchmarks.learning_curves import summarize, to_rows

    def metrics(accuracies):  # an evaluation before every step, steps of 2 s with 0.5 s of evaluation
        lines = [
            {
                "step": s,
                "eval/accuracy": a,
                "eval/accuracy_greedy": a,
                "reward/mean": 0.5,
                "response/length_mean": 3.0,
                "perf/step_s": 2.0,
                "perf/eval_s": 0.5,
                "algo/gen_rounds": 2,
            }
            for s, a in enumerate(accuracies[:-1])
        ]
        return lines + [
            {"step": len(accuracies) - 1, "eval/accuracy": accuracies[-1], "eval/accuracy_greedy": accuracies[-1]}
        ]

    rows = to_rows("x", 1, metrics([0.4, 0.6, 0.75, 0.8]), 10) + to_rows("x", 2, metrics([0.4, 0.5, 0.6, 0.7]), 10)
    (t,) = summarize(rows, target=0.7)
    assert t["reached"] == "2/2"
    assert t["steps_to_target"] == format((2 + 3) / 2, ".0f")  # first evaluations at >= 0.7: steps 2 and 3
    assert t["wall_to_target"] == format((2 * 1.5 + 3 * 1.5) / 2, ".0f")  # evaluation time left out
    assert t["completions_to_target"] == format((2 * 20 + 3 * 20) / 2, ".0f")  # 2 rounds of 10 per step
    assert t["final"] == "0.750 ± 0.071"


def test_a_run_collapses_at_the_first_of_five_steps_below_five_percent_rollout_accuracy():
    from benchmarks.learning_curves import collapse_step, summarize

    def run(seed, accuracy):  # rollouts' accuracy per step; held-out accuracy at steps 0 and the last
        held_out = [None] * len(accuracy)
        held_out[0], held_out[-1] = 0.3, 0.1 * seed
        return [
            {
                "config": "x",
                "seed": seed,
                "step": s,
                "correct": a,
                "eval_accuracy": held_out[s],
                "eval_accuracy_greedy": 0.5,
                "wall_s": 0.0,
            }
            for s, a in enumerate(accuracy)
        ]

    falls = run(1, [0.3, 0.2, 0.06, 0.04, 0.04, 0.04, 0.04, 0.1])  # steps 2-6 average 0.044; steps 1-5 0.076
    dips = run(2, [0.3, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3])  # four steps at 0, then back: no five in a row
    assert collapse_step(falls) == 2 and collapse_step(dips) is None
    (t,) = summarize(falls + dips, target=0.9)
    assert t["collapsed"] == "1/2 (2)"
    assert t["gain"] == "-0.150 ± 0.071"  # 0.1 - 0.3 and 0.2 - 0.3


def test_dapo_without_its_changes_as_the_lab_runs_it():
    """The lab's ablations of dapo.py (docs/lab.md, claim 15): without the token-level loss its loss is grpo.py's
    (the mean over each completion's tokens, then over completions; DAPO arXiv:2503.14476 Eq. 12 against GRPO's
    Eq. 3) at grpo's clip and beta 0, in value and gradient, with dapo's metrics; without dynamic sampling every group
    is kept, those whose completions are all right or all wrong too."""
    import dapo
    import grpo
    from benchmarks.learning_curves import keep_all_groups, sequence_mean

    torch.manual_seed(0)
    logprobs = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    old, advantages = logprobs.detach() + 0.3 * torch.randn(6, 5, dtype=torch.float64), torch.randn(6).double()
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in (1, 2, 3, 4, 5, 5)], dtype=torch.float64)
    loss, metrics = sequence_mean(dapo.compute_loss)(logprobs, old, advantages, mask, mask.sum(), 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    want = grpo.compute_loss(logprobs, old, None, advantages, mask, 6, 0.2, 0.0)[0]
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.autograd.grad(want, logprobs)[0], rtol=1e-12, atol=1e-12)
    token_mean = dapo.compute_loss(logprobs, old, advantages, mask, mask.sum(), 0.2, 0.2)
    assert metrics.keys() == token_mean[1].keys() and not torch.isclose(loss, token_mean[0])
    with pytest.raises(AssertionError, match="one micro-batch"):  # a micro-batch of a larger step: len(mask) is wrong
        sequence_mean(dapo.compute_loss)(logprobs, old, advantages, mask, 2 * mask.sum(), 0.2, 0.2)
    correct = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups of 2: all right, mixed, all wrong
    assert dapo.filter_groups(correct, 2).tolist() == [False, True, False]
    assert keep_all_groups(dapo.filter_groups)(correct, 2).tolist() == [True, True, True]


def test_learning_curves_run_changes_and_rates_side_by_side(tmp_path):
    """A +change and --rates run as named in the CSV, --jobs 2 at a time, the rows in the order asked."""
    out = tmp_path / "changes.csv"
    result = run(
        [
            "-m",
            "benchmarks.learning_curves",
            "--configs",
            "dapo +keep-all-groups",
            "--rates",
            "1e-4",
            "--jobs",
            "2",
            "--seeds",
            "1",
            "2",
            "--steps",
            "1",
            "--eval-every",
            "1",
            "--out",
            str(out),
            "--extra=--eval-size 4 --prompts-per-step 2 --group-size 4",
        ],
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    from benchmarks.learning_curves import read_csv

    rows = read_csv(out)
    assert [(r["config"], r["seed"]) for r in rows] == [
        ("dapo +keep-all-groups --learning-rate 1e-4", seed) for seed in (1, 1, 2, 2)
    ]
    assert [r["kept_groups_frac"] for r in rows[::2]] == [1.0, 1.0]  # every group trained


def test_learning_curves_on_the_chain_task_write_the_lab_columns_and_table(tmp_path):
    """--task chain: the lab's metrics as columns, gvpo's demonstrations not counted as sampled, and the
    table of each rollout metric's first and last steps."""
    out = tmp_path / "lab.csv"
    result = run(
        [
            "-m",
            "benchmarks.learning_curves",
            "--task",
            "chain",
            "--configs",
            "grpo",
            "gvpo --demos-per-group 1",
            "--seeds",
            "1",
            "--steps",
            "2",
            "--eval-every",
            "2",
            "--out",
            str(out),
            "--extra=--eval-size 8 --prompts-per-step 2 --group-size 4",
        ],
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    from benchmarks.learning_curves import read_csv

    rows = read_csv(out)
    assert [r["completions"] for r in rows] == [0, 8, 16, 0, 6, 12]  # 2 prompts x (4 - 1 demonstration)
    assert rows[0]["length_wrong"] is not None and rows[0]["clipfrac_high"] is not None
    assert rows[3]["clipfrac_high"] is None and rows[3]["entropy"] is not None  # gvpo clips nothing
    assert re.search(r"^\| grpo \| [\d.]+ \[[\d.]+, [\d.]+\] → ", result.stdout, re.M)


def test_lab_table_gives_first_and_last_steps_over_seeds():
    from benchmarks.learning_curves import LAB, lab_table

    rows = [
        {"config": "x", "seed": seed, "step": step, "entropy": entropy}
        for seed, values in ((1, [1.0, 2.0, 3.0, 4.0]), (2, [3.0, 4.0, 5.0, 8.0]))
        for step, entropy in enumerate(values)
    ]
    line = lab_table(rows, LAB["chain"], window=2).splitlines()[2].removesuffix(" |").split(" | ")
    assert line[1 + LAB["chain"].index("entropy")] == "2.5 [1.5, 3.5] → 5 [3.5, 6.5]"  # seeds' means of steps 0-1 / 2-3
    assert line[1 + LAB["chain"].index("step_s")] == "-"


def test_rows_appended_to_an_older_csv_keep_its_columns(tmp_path):
    from benchmarks.learning_curves import append_csv, read_csv

    out = tmp_path / "old.csv"
    out.write_text("config,seed,step,eval_accuracy\ngrpo,1,0,0.5\n")
    append_csv(out, [{"config": "dapo", "seed": 1, "step": 0, "eval_accuracy": 0.25, "entropy": 0.1}])
    assert read_csv(out) == [
        {"config": "grpo", "seed": 1, "step": 0, "eval_accuracy": 0.5},
        {"config": "dapo", "seed": 1, "step": 0, "eval_accuracy": 0.25},
    ]


def test_gpu_check_runs_at_a_tiny_shape_on_cpu(tmp_path):
    """What a lent GPU runs, in its small configuration (without vLLM here: generate only)."""
    result = run(["-m", "benchmarks.gpu_check", "--device-check", "--out", str(tmp_path / "r.json")], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    figures = json.loads((tmp_path / "r.json").read_text())["tiny"]["generate"]
    assert figures["gen_tokens_per_s"] > 0 and figures["update_tflops_per_s"] > 0 and figures["round_s"] > 0


@pytest.mark.parametrize("shared", [False, True])  # 3 prompts, or 1 prompt that the 3 rows share
@pytest.mark.parametrize("recompute_above", [2**27, 0])  # the logits kept for the backward, or recomputed there
def test_gpu_check_flop_count_matches_torch_flop_counter(recompute_above, shared):
    """update_flops (full attention) against the matmul FLOPs PyTorch counts in one get_logprobs forward +
    backward with eager attention (matmuls the counter sees), plus what the recipe leaves out on purpose:
    each forward's one logit per row (the backbone's) and, when get_logprobs recomputes its chunks in the
    backward pass (above `recompute_above` logits), their LM-head forward again. Rows that share a prompt
    run it once (then two forwards: the prompt's, 1 row, and the responses')."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.gpu_check import update_flops
    from common import get_logprobs
    from harness import DEFAULT_MODEL

    config = AutoConfig.from_pretrained(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    B, P, L = 3, 10, 6
    ids = torch.randint(1, config.vocab_size, (B, P + L))
    if shared:
        ids[:, :P] = ids[0, :P]
    with FlopCounterMode(display=False) as counter:
        logprobs, _ = get_logprobs(model, ids, torch.ones_like(ids), P, 1.0, recompute_above=recompute_above)
        logprobs.sum().backward()
    head = 2 * config.hidden_size * config.vocab_size
    recomputed = head * B * L if B * L * config.vocab_size > recompute_above else 0
    prompts = 1 if shared else None
    expected = update_flops(config, B, P + L, L, causal=False, prompts=prompts) + recomputed + head * (B + shared)
    assert abs(counter.get_total_flops() - expected) / expected < 1e-4
    assert update_flops(config, B, P + L, L, prompts=prompts) < expected  # causal: half the attention
    if shared:
        assert expected < update_flops(config, B, P + L, L, causal=False)  # fewer positions than 3 whole rows


def lockstep(*args: str) -> dict:
    result = run(["-m", "benchmarks.lockstep", "--rounds", "2", "--warmup", "1", *args], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "| grpo.py (this checkout) | " in result.stdout
    return json.loads(result.stdout.splitlines()[-1])


def test_lockstep_against_another_checkout_runs():
    """This checkout against itself (as --against): two workers of the same code take turns, so the ratio is about
    1, and the file's split adds up to less than its round. This side cuts its micro-batches by a token budget (rows
    by length: less padding in what the update computes than the other's 128-row micro-batches in their order); a
    budget of 2,048 positions, two micro-batches of the ~3,400: a smaller one is slower on this toy shape, where each
    forward's fixed cost outweighs the padding it saves (--this-flags=--max-tokens-per-micro-batch 256: ~3x)."""
    figures = lockstep(
        "--against", str(ROOT), "--flags=--micro-batch-size 128", "--this-flags=--max-tokens-per-micro-batch 2048"
    )
    assert 0.5 < figures["ratio"] < 2, figures
    for side in ("this", "other"):
        s = figures[side]
        assert 0 < s["gen_s"] + s["logprobs_s"] + s["update_s"] < s["median_s"] * 1.01, s
        assert 0 <= s["update_padding"] < s["update_positions"] and s["sampled_positions"] > 0, s
    this, other = (figures[side]["update_padding"] / figures[side]["update_positions"] for side in ("this", "other"))
    assert this < other, (this, other)


def test_lockstep_against_trl_runs_when_trl_is_installed():
    """Skipped without trl (an optional, benchmark-only dependency): pip install -r benchmarks/requirements.txt."""
    pytest.importorskip("trl")
    figures = lockstep()
    assert figures["other"]["rollout_s"] < figures["other"]["median_s"] and 0.1 < figures["ratio"] < 10, figures


def test_lockstep_stops_on_a_bad_against(tmp_path):
    result = run(["-m", "benchmarks.lockstep", "--against", str(tmp_path)], cwd=ROOT)
    assert result.returncode != 0 and "neither 'trl' nor a folder with grpo.py" in result.stderr


def test_the_off_policy_grid_runs_each_config_at_each_staleness_under_each_anchor():
    from benchmarks.learning_curves import off_policy_grid

    assert off_policy_grid(("grpo", "gvpo --beta 0.2"), (0, 4), ("recompute", "tis", "behaviour")) == (
        "grpo",  # K = 0: the anchors agree in fp32, one run
        "grpo --off-policy-steps 4 --rollout-correction none",
        "grpo --off-policy-steps 4 --rollout-correction tis",
        "grpo --off-policy-steps 4 --anchor behaviour",
        "gvpo --beta 0.2",
        "gvpo --beta 0.2 --off-policy-steps 4 --rollout-correction none",
        "gvpo --beta 0.2 --off-policy-steps 4 --rollout-correction tis",
        "gvpo --beta 0.2 --off-policy-steps 4 --anchor behaviour",
    )
    assert off_policy_grid(("grpo",), (), ("tis",)) == ()  # no --off-policy-steps: the configs as given
