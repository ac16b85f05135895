"""gvpo.py: the group MSE against hand-worked numbers (derived in the test from the paper's loss), autograd, group
integrity, and the replay of past groups (the learning tests, on-policy and with --reuse-steps 1,
are in test_runs.py)."""

import json

import pytest
import torch

import gvpo
from common import UsageError
from conftest import read_metrics, record_batch_sizes

B_REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])


def loss_at(a: torch.Tensor, rewards: torch.Tensor = B_REWARDS, beta: float = 0.1, num_groups: float = 1.0):
    """The loss with a_i = a (one token per completion, anchor log-prob 0): returns (loss, d loss / d a)."""
    a = a.clone().requires_grad_()
    b = gvpo.compute_advantages(rewards, 4)
    loss, _ = gvpo.compute_loss(a.view(-1, 1), torch.zeros(len(a), 1), b, torch.ones(len(a), 1), num_groups, 4, beta)
    loss.backward()
    return loss.item(), a.grad


def test_centred_rewards_are_not_divided_by_the_std():
    torch.testing.assert_close(gvpo.compute_advantages(B_REWARDS, 4), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    torch.testing.assert_close(gvpo.compute_advantages(B_REWARDS * 10, 4), torch.tensor([5.0, -5, -5, 5]))


def test_worked_example():
    # GVPO's loss (Zhang et al. 2025, arXiv:2504.19599; the authors' verl recipe), per group of k:
    # 1/(k-1) sum_i 1/2 (beta (a_i - mean a) - b_i)^2, b = R - mean R. Rewards [1, 0, 0, 1], k 4, beta 0.1:
    # b = [0.5, -0.5, -0.5, 0.5]. On-policy (a = 0) the loss is 1/3 * 1/2 * 4 * 0.25 = 0.166667.
    loss, grad = loss_at(torch.zeros(4))
    assert loss == pytest.approx(0.166667, abs=1e-6)
    # a = [0.2, -0.1, 0, 0.1]: mean a 0.05, beta (a - mean a) = [0.015, -0.015, -0.005, 0.005],
    # e = that - b = [-0.485, 0.485, 0.495, -0.495], loss = 1/3 * 1/2 * (2 * 0.485^2 + 2 * 0.495^2) = 0.160083;
    # the weights of the policy gradient are w = -e.
    a = torch.tensor([0.2, -0.1, 0.0, 0.1])
    loss, grad = loss_at(a)
    assert loss == pytest.approx(0.160083, abs=1e-6)
    w = torch.tensor([0.485, -0.485, -0.495, 0.495])
    torch.testing.assert_close(grad, -0.1 * w / 3)  # d loss / d a_i = -beta w_i / (k-1)


def test_on_policy_gradient_is_the_centred_reward_policy_gradient():
    _, grad = loss_at(torch.zeros(4))
    torch.testing.assert_close(grad, -0.1 * gvpo.compute_advantages(B_REWARDS, 4) / 3)


def test_detaching_the_group_mean_leaves_the_gradient_unchanged():
    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    b = gvpo.compute_advantages(torch.rand(4), 4)
    e = 0.1 * (a - a.mean().detach()) - b
    (0.5 * (e**2).sum() / 3).backward()
    _, grad = loss_at(a.detach(), rewards=b + 0.3)  # the same centred rewards
    torch.testing.assert_close(grad, a.grad)


def test_loss_is_zero_at_the_kl_regularised_optimum_whatever_sampled_the_completions():
    # beta (a - mean a) = b for any a of that form: a constant shift per group does not matter, so
    # completions drawn by any sampler are at the optimum once the implicit rewards match.
    torch.manual_seed(0)
    rewards = torch.rand(8)
    b = gvpo.compute_advantages(rewards, 4)
    a = b / 0.1 + torch.tensor([3.0] * 4 + [-7.0] * 4)
    loss, _ = gvpo.compute_loss(a.view(-1, 1), torch.zeros(8, 1), b, torch.ones(8, 1), 2, 4, 0.1)
    assert loss.item() == pytest.approx(0.0, abs=1e-9)


def test_sequence_sums_and_groups_add_up_over_micro_batches():
    torch.manual_seed(0)
    lp, anchor = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    mask = (torch.rand(8, 5) > 0.3).double()
    b = gvpo.compute_advantages(torch.rand(8, dtype=torch.float64), 4)
    full, _ = gvpo.compute_loss(lp, anchor, b, mask, 2, 4)
    halves = sum(
        gvpo.compute_loss(lp[i : i + 4], anchor[i : i + 4], b[i : i + 4], mask[i : i + 4], 2, 4)[0] for i in (0, 4)
    )
    assert halves.item() == pytest.approx(full.item(), abs=1e-12)
    lp.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: gvpo.compute_loss(x, anchor, b, mask, 2, 4)[0], (lp,))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"micro_batch_size": 2}, "--micro-batch-size must be a multiple of --group-size"),
        (
            {"num_minibatches": 8, "prompts_per_step": 4},
            "--num-minibatches must split the sequences per rank into whole",
        ),
    ],
)
def test_a_batch_split_that_would_cut_a_group_is_rejected(tmp_path, overrides, message):
    args = {
        "num_steps": 1,
        "prompts_per_step": 4,
        "group_size": 4,
        "eval_every": 0,
        "output_dir": str(tmp_path),
        **overrides,
    }
    with pytest.raises(UsageError, match=message):
        gvpo.main(gvpo.Args(**args))
    assert not list(tmp_path.iterdir())


def test_reuse_trains_on_the_previous_steps_groups(tmp_path, monkeypatch):
    sizes = record_batch_sizes(monkeypatch, gvpo)
    gvpo.main(
        gvpo.Args(
            num_steps=4,
            prompts_per_step=4,
            group_size=4,
            eval_every=0,
            reuse_steps=2,
            output_dir=str(tmp_path),
            run_name="reuse",
        )
    )
    assert sizes == [16, 32, 48, 48]  # fresh groups, plus those of at most the 2 previous steps


@pytest.mark.parametrize("reuse_steps, updates, passes", [(0, 2, 2), (1, 2, 1), (2, 2, 1), (1, 4, 2), (1, 1, 1)])
def test_replay_passes_over_each_group_updates_per_rollout_times_in_all(
    tmp_path, monkeypatch, reuse_steps, updates, passes
):
    """With --reuse-steps K a group is trained at K+1 steps, so --updates-per-rollout counts the passes over it in
    all: updates // (K+1) a step, at least 1. The default 2 with K = 1 is one pass a step, two over each group as
    on-policy. Two a step (four over each group) collapsed on the default task: held-out +0.09 / +0.06 / +0.13 at
    step 200 over seeds 1-3, greedy accuracy falling from 0.64 to 0.45-0.66 (docs/gvpo.md)."""
    calls, step = [], torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda *a, **k: calls.append(1) or step(*a, **k))  # one a pass
    gvpo.main(
        gvpo.Args(
            num_steps=2,
            prompts_per_step=2,
            group_size=4,
            eval_every=0,
            reuse_steps=reuse_steps,
            updates_per_rollout=updates,
            output_dir=str(tmp_path),
            run_name="passes",
        )
    )
    assert len(calls) == 2 * passes


def test_a_resume_with_another_group_size_stops(tmp_path):
    """The replayed rollouts hold groups of the checkpoint's --group-size: regrouped by another they would mix
    prompts in a group. The resume stops with one line, as for another number of ranks."""
    settings = dict(
        prompts_per_step=4, eval_every=0, reuse_steps=1, save_every=2, output_dir=str(tmp_path), run_name="g"
    )
    gvpo.main(gvpo.Args(num_steps=2, group_size=4, **settings))
    with pytest.raises(UsageError, match="--group-size 2: must be 4"):
        gvpo.main(gvpo.Args(num_steps=4, group_size=2, resume="latest", **settings))


def test_replayed_groups_with_longer_prompts_are_scored_at_the_right_columns(tmp_path):
    """Fresh and replayed prompts of different widths are re-padded into one batch; the update must
    score responses where they start in that batch. On the first update of a step the ratio to the
    anchor is then exactly 1 (approx_kl 0); scored at the wrong columns it would not be."""
    rows = [{"prompt": "1+1" if i % 2 else "12345+67890+1", "answer": "2" if i % 2 else "80236"} for i in range(64)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    gvpo.main(
        gvpo.Args(
            dataset=str(path),
            eval_size=4,
            num_steps=8,
            prompts_per_step=1,
            group_size=4,
            eval_every=0,
            reuse_steps=2,
            updates_per_rollout=1,
            output_dir=str(tmp_path),
            run_name="w",
        )
    )
    assert all(m["policy/approx_kl"] < 1e-6 for m in read_metrics(tmp_path / "w")), read_metrics(tmp_path / "w")


def test_a_replayed_group_keeps_the_rollout_correction_of_its_own_step(tmp_path, monkeypatch):
    """--reuse-steps with --rollout-correction: the weight corrects the engine's mismatch when the group
    was sampled, pi_old(then) / pi_sampler(then), kept with the group. Weighting a replayed group by
    pi_anchor(now) / pi_sampler(then) would put the policy's move since then into an importance weight,
    which GVPO's loss does not need (its §3.3). Here the sampler is the trainer itself, so every weight
    is 1 (to the ~1e-6 of two fp32 computations), a replayed group's as well as a fresh one's."""
    steps = []
    real = gvpo.reweighted

    def reweighted(logprobs, weights):
        steps.append(weights)
        return real(logprobs, weights)

    monkeypatch.setattr(gvpo, "reweighted", reweighted)
    gvpo.main(
        gvpo.Args(
            num_steps=3,
            prompts_per_step=4,
            group_size=4,
            eval_every=0,
            reuse_steps=1,
            updates_per_rollout=1,
            rollout_correction="tis",
            output_dir=str(tmp_path),
            run_name="replay",
        )
    )
    weights = torch.cat([w.flatten() for w in steps])
    assert sum(len(w) for w in steps) == 16 + 32 + 32  # steps 1 and 2: 16 fresh rows, then the 16 replayed
    torch.testing.assert_close(weights, torch.ones_like(weights), rtol=0, atol=1e-4)


def test_a_resume_with_the_rollout_correction_turned_on_weights_the_replayed_groups_by_1(tmp_path, monkeypatch):
    """Groups replayed from a checkpoint saved without the correction (on a CPU `auto` is none) carry no weights;
    resumed with --rollout-correction tis (or --vllm, which makes `auto` tis), they are weighted by 1, as they
    were trained when they were sampled (it stopped with an AttributeError)."""
    settings = dict(
        prompts_per_step=4,
        group_size=4,
        eval_every=0,
        reuse_steps=1,
        save_every=2,
        updates_per_rollout=1,
        output_dir=str(tmp_path),
        run_name="c",
    )
    gvpo.main(gvpo.Args(num_steps=2, **settings))
    steps, real = [], gvpo.reweighted
    monkeypatch.setattr(gvpo, "reweighted", lambda logprobs, weights: steps.append(weights) or real(logprobs, weights))
    gvpo.main(gvpo.Args(num_steps=3, resume="latest", rollout_correction="tis", **settings))
    weights = torch.cat(steps)  # (32, T): 16 fresh rows, then the 16 replayed from step 1
    assert weights.shape[0] == 32 and torch.equal(weights[16:], torch.ones_like(weights[16:]))


def test_adaptive_beta_hand_worked():
    # PPO's adaptive KL penalty (Schulman et al. 2017, arXiv:1707.06347, section 4), target 1: a KL below 1 / 1.5
    # halves beta, above 1.5 doubles it, between (edges included) keeps it.
    assert [gvpo.update_beta(0.1, kl, 1.0, 0.1) for kl in (0.6, 2 / 3, 1.0, 1.5, 1.6)] == [0.05, 0.1, 0.1, 0.1, 0.2]


def test_adaptive_beta_stays_within_ten_halvings_or_doublings_of_beta():
    """Where each step's KL stays below target / 1.5 (the lab at lr 5e-5: 0.3 nats against 1), beta halved at every
    step, without end: ~1e-16 by step 60, and after ~120 steps the loss, divided by beta, was not finite (the run
    stopped, blaming the learning rate). It now stops at --beta / 2^10 (and, where the KL stays far above, at
    --beta * 2^10), and the loss there is finite for the rewards and log-ratios of a run."""
    beta, ceiling = 0.1, 0.1
    for _ in range(200):
        beta, ceiling = gvpo.update_beta(beta, 0.0, 1.0, 0.1), gvpo.update_beta(ceiling, 1e9, 1.0, 0.1)
    assert (beta, ceiling) == (0.1 / 1024, 0.1 * 1024)
    assert gvpo.update_beta(beta, 1.0, 1.0, 0.1) == beta and gvpo.update_beta(beta, 2.0, 1.0, 0.1) == 2 * beta
    a = torch.tensor([[-160.0], [12.0], [100.0], [-4.0]])  # 4 completions' log-ratios to the anchor, far from it
    loss, _ = gvpo.compute_loss(
        a, torch.zeros(4, 1), torch.tensor([-1.0, 1.0, 1.0, -1.0]), torch.ones(4, 1), 1, 4, beta
    )
    assert torch.isfinite(loss / beta) and loss / beta > 0


def test_target_kl_adapts_beta_from_the_kl_the_step_measured(tmp_path, monkeypatch):
    """Each step's beta is update_beta of the previous step's: measured as the k3 estimate of KL(anchor || updated
    policy) on the step's own samples, summed per completion."""
    seen = []
    real = gvpo.compute_loss
    monkeypatch.setattr(gvpo, "compute_loss", lambda *a: (seen.append(a[-1]), real(*a))[1])
    gvpo.main(
        gvpo.Args(
            num_steps=4,
            prompts_per_step=2,
            group_size=4,
            eval_every=0,
            target_kl=0.05,
            output_dir=str(tmp_path),
            run_name="adapt",
        )
    )
    metrics = read_metrics(tmp_path / "adapt")
    betas = [m["algo/beta"] for m in metrics]
    assert betas[0] == 0.1 and seen == [b for b in betas for _ in range(2)]  # 2 passes x 1 minibatch per step
    for before, after in zip(metrics, metrics[1:]):
        assert after["algo/beta"] == gvpo.update_beta(before["algo/beta"], before["algo/kl_to_anchor"], 0.05, 0.1)
    assert len(set(betas)) > 1, betas  # the controller acted
    with pytest.raises(UsageError, match="--target-kl 0.0: must be > 0"):
        gvpo.main(gvpo.Args(target_kl=0.0, output_dir=str(tmp_path)))
