"""dapo.py: its four changes against hand-worked numbers, each derived in its test from the paper's
equation, against autograd, and in runs."""

import json
import math
from pathlib import Path

import pytest
import torch

import dapo
import grpo
from common import UsageError, prompt_batch
from conftest import read_metrics, record_batch_sizes, run


@pytest.mark.parametrize("length, penalty", [(16000, 0.0), (16384, 0.0), (18432, -0.5), (20480, -1.0), (20481, -1.0)])
def test_overlong_penalty_worked_example(length, penalty):
    # DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, Eq. 13), L_max 20480, L_cache 4096:
    # 0 up to L_max - L_cache = 16384 tokens, then (16384 - |y|) / 4096 (18432: -0.5), -1 from L_max on.
    assert dapo.overlong_penalty(torch.tensor([float(length)]), 20480, 4096).item() == pytest.approx(penalty)


def test_overlong_penalty_on_the_default_lengths():
    # --max-new-tokens 8, --overlong-buffer 4: free up to 4 tokens (a 3-digit sum and EOS), then -1/4 a token.
    lengths = torch.arange(1.0, 9.0)
    assert dapo.overlong_penalty(lengths, 8, 4).tolist() == [0, 0, 0, 0, -0.25, -0.5, -0.75, -1.0]
    assert dapo.overlong_penalty(lengths, 8, 0).tolist() == [0] * 8  # --overlong-buffer 0: no shaping


def test_filter_groups_uses_correctness():
    correct = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1])
    assert dapo.filter_groups(correct, 4).tolist() == [False, False, True, True]


def test_token_mean_differs_from_grpo_seq_mean_on_unequal_lengths():
    lp = torch.zeros(2, 4)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]).float()
    token_mean, _ = dapo.compute_loss(lp, lp, adv, mask, num_tokens=mask.sum().item())
    seq_mean, _ = grpo.compute_loss(lp, lp, None, adv, mask, num_sequences=2, beta=0.0)
    assert token_mean.item() == pytest.approx(-(4 - 1) / 5)  # every token weighs 1/5: the long answer dominates
    assert seq_mean.item() == pytest.approx(0.0)  # every sequence weighs 1/2


@pytest.mark.parametrize(
    "advantage, ratio, has_grad",
    [
        (+1.0, 1.3, False),  # clip-higher (arXiv:2503.14476, section 3.1): r 1.3 beyond 1 + 0.28, clipped
        (+1.0, 1.25, True),  # inside (1.2, 1.28]: GRPO's clip would stop it, clip-higher lets it grow
        (+1.0, 1.28 - 1e-4, True),
        (+1.0, 0.7, True),  # A > 0 below the range: the unclipped term is the minimum
        (-1.0, 0.7, False),  # r 0.7 below 1 - 0.2 with A < 0: clipped
        (-1.0, 0.85, True),
        (-1.0, 1.3, True),  # A < 0 above the range: pessimistic, gradient flows
    ],
)
def test_clip_higher_gradient(advantage, ratio, has_grad):
    old = torch.tensor([[-2.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, _ = dapo.compute_loss(lp, old, torch.tensor([advantage]), torch.ones(1, 1), num_tokens=1)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    if has_grad:
        assert lp.grad.item() == pytest.approx(-ratio * advantage, abs=1e-6)
    else:
        clipped = min(max(ratio, 0.8), 1.28)
        assert -loss.item() == pytest.approx(clipped * advantage, abs=1e-6)  # 1.28 for (+1, 1.3), -0.8 for (-1, 0.7)


def test_gradcheck_and_micro_batch_split():
    torch.manual_seed(0)
    lp = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    old = lp.detach() + 0.2 * torch.randn(6, 5, dtype=torch.float64)
    adv = torch.randn(6, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[:, 0] = 1
    n = mask.sum().item()
    assert torch.autograd.gradcheck(lambda x: dapo.compute_loss(x, old, adv, mask, n)[0], (lp,))
    full = dapo.compute_loss(lp, old, adv, mask, n)[0]
    parts = sum(dapo.compute_loss(lp[i : i + 4], old[i : i + 4], adv[i : i + 4], mask[i : i + 4], n)[0] for i in (0, 4))
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)  # the global count makes micro-batches add up


# --- dynamic sampling ---------------------------------------------------------------------------


def write_dataset(path: Path, impossible: set[int], size: int = 200) -> Path:
    """Two-digit additions; rows in `impossible` have an answer no completion can match (all wrong:
    their groups carry no signal and dynamic sampling must drop them)."""
    rows = [{"prompt": f"{10 + i % 90}+{10 + i // 90}", "answer": str(20 + i % 90 + i // 90)} for i in range(size)]
    for i in impossible:
        rows[i]["answer"] = "x"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_main(tmp_path, monkeypatch, dataset: Path, **overrides) -> tuple[list[int], list[dict]]:
    """dapo.main in-process; returns the number of completions trained on per step, and the metrics."""
    trained = record_batch_sizes(monkeypatch, dapo)
    args = dapo.Args(
        **{
            "dataset": str(dataset),
            "eval_size": 4,
            "num_steps": 2,
            "prompts_per_step": 8,
            "group_size": 4,
            "eval_every": 0,
            "output_dir": str(tmp_path),
            "run_name": "ds",
            **overrides,
        }
    )
    dapo.main(args)
    return trained, read_metrics(tmp_path / "ds")


def test_dynamic_sampling_refills_to_exactly_the_batch(tmp_path, monkeypatch):
    dataset = write_dataset(tmp_path / "d.jsonl", impossible=set(range(0, 200, 2)))  # half the prompts
    trained, metrics = run_main(tmp_path, monkeypatch, dataset)
    assert trained == [8 * 4, 8 * 4]  # exactly prompts-per-step groups, every step
    assert all(m["algo/gen_rounds"] >= 2 for m in metrics)  # it had to draw fresh prompts
    assert all(m["algo/kept_groups_frac"] <= 0.6 for m in metrics)


def test_dynamic_sampling_budget_runs_out_and_trains_on_what_it_has(tmp_path, monkeypatch, capsys):
    dataset = write_dataset(tmp_path / "d.jsonl", impossible=set(range(200)) - set(range(0, 200, 10)))
    trained, metrics = run_main(tmp_path, monkeypatch, dataset, max_gen_rounds=2)
    assert all(0 <= n < 8 * 4 and n % 4 == 0 for n in trained), trained
    assert [m["algo/gen_rounds"] for m in metrics] == [2, 2]
    assert "dynamic sampling kept" in capsys.readouterr().out and (tmp_path / "ds" / "final").exists()


def test_dynamic_sampling_with_nothing_kept_skips_the_update(tmp_path, monkeypatch):
    dataset = write_dataset(tmp_path / "d.jsonl", impossible=set(range(200)))
    trained, metrics = run_main(tmp_path, monkeypatch, dataset, max_gen_rounds=1)
    assert trained == [] and "policy/grad_norm" not in metrics[0]  # no group reaches the advantages


@pytest.mark.slow
def test_two_ranks_keeping_different_numbers_of_groups_do_not_hang(tmp_path):
    """Rank 0's prompts of the first round are all impossible, rank 1's are not: rank 0 must draw more
    rounds than rank 1 needs, and both must still run the same collectives."""
    first_round_rank0 = prompt_batch(list(range(200)), 0, 8, rank=0, world_size=2, seed=1)
    dataset = write_dataset(tmp_path / "d.jsonl", impossible=set(first_round_rank0))
    result = run(
        [
            "dapo.py",
            "--dataset",
            str(dataset),
            "--eval-size",
            "4",
            "--num-steps",
            "2",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
            "--eval-every",
            "0",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "ranks",
            "--seed",
            "1",
        ],
        cwd=tmp_path,
        torchrun=2,
    )
    assert result.returncode == 0, result.stderr
    assert read_metrics(tmp_path / "ranks")[0]["algo/gen_rounds"] >= 2


@pytest.mark.parametrize("buffer", [-1, 9])
def test_bad_overlong_buffer(tmp_path, buffer):
    with pytest.raises(UsageError, match=f"--overlong-buffer {buffer} must be between 0 and --max-new-tokens"):
        dapo.main(dapo.Args(overlong_buffer=buffer, output_dir=str(tmp_path)))
    assert not list(tmp_path.iterdir())
