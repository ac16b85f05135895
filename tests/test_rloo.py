"""rloo.py: its advantage and loss against hand-worked numbers, each derived in its test from the paper,
against TRL's form of the loss at the first update, against autograd, the micro-batch split, and the KL
penalty taken from the reward in a short run (the shared equivalence, resume, learning and shared-lines
tests run on it with the other files)."""

import pytest
import torch

import rloo
from common import all_reduce_mean
from conftest import read_metrics


def test_advantage_is_the_reward_minus_the_mean_of_the_others():
    # RLOO (Ahmadian et al. 2024, arXiv:2402.14740, its RLOO estimator): A_i = R_i - 1/(k-1) sum_{j != i} R_j.
    # Rewards [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3.
    # A nearly all-right group [1, 1, 1, 0]: A_0 = 1 - 2/3 = 1/3, A_3 = 0 - 3/3 = -1.
    adv = rloo.compute_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([2, -2, -2, 2, 1, 1, 1, -3]) / 3)


def test_the_baseline_of_a_completion_does_not_depend_on_its_own_reward():
    # dA_i/dR_i = 1 (the baseline leaves R_i out, so it is independent of y_i and the estimate unbiased);
    # dA_i/dR_j = -1/(k-1) for each of the other k - 1 = 3 completions.
    jacobian = torch.autograd.functional.jacobian(lambda r: rloo.compute_advantages(r, 4), torch.rand(4))
    torch.testing.assert_close(jacobian, torch.eye(4) - (1 - torch.eye(4)) / 3)


def lengths_2_and_4():
    """A right completion of 2 tokens (A = +2/3) and a wrong one of 4 (A = -2/3), each token's log-prob -1."""
    logprobs = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    return logprobs, mask, torch.tensor([2 / 3, -2 / 3], dtype=torch.float64)


def test_loss_is_reinforce_on_the_completions_summed_log_prob():
    # Loss = -1/k sum_i A_i log pi(y_i|x), log pi(y_i|x) = sum_t log pi(y_it): -2 and -4 here, k = 2:
    # -(2/3 * -2 + -2/3 * -4) / 2 = -2/3. Each token's gradient is -A_i / k, whatever the length: -1/3 for the
    # right completion's 2 tokens, +1/3 for the wrong one's 4, 0 on padding.
    logprobs, mask, adv = lengths_2_and_4()
    loss, metrics = rloo.compute_loss(logprobs, logprobs.detach(), adv, mask, 2)
    assert loss.item() == pytest.approx(-2 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1, -1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64) / 3)
    assert all_reduce_mean(metrics)["policy/approx_kl"] == 0


def trl_rloo_loss(logprobs, old_logprobs, advantages, mask, eps=0.2):
    """TRL's RLOOTrainer loss, written out: PPO's clipped surrogate on the whole-sequence ratio
    pi_theta(y_i|x) / pi_old(y_i|x), averaged over the completions."""
    ratio = torch.exp(((logprobs - old_logprobs) * mask).sum(-1))  # (B,)
    return -torch.min(ratio * advantages, torch.clamp(ratio, 1 - eps, 1 + eps) * advantages).mean()


def test_same_gradient_as_trls_clipped_form_at_the_first_update_only():
    torch.manual_seed(0)
    logprobs = torch.randn(6, 5, dtype=torch.float64).requires_grad_(True)
    mask = (torch.rand(6, 5) < 0.7).double()
    mask[:, 0] = 1
    adv = torch.randn(6, dtype=torch.float64)
    # First update: old = the policy, ratio 1. Both gradients are -A_i/k grad log pi(y_i|x).
    (ours,) = torch.autograd.grad(rloo.compute_loss(logprobs, logprobs.detach(), adv, mask, 6)[0], logprobs)
    (trl,) = torch.autograd.grad(trl_rloo_loss(logprobs, logprobs.detach(), adv, mask), logprobs)
    torch.testing.assert_close(ours, trl)
    # Later: old log-probs 0.5 lower on every token, so each sequence ratio is e^(0.5 |y_i|) >= 1.65, past TRL's
    # clip: TRL drops the gradient of the completions with A > 0; this loss keeps it, unchanged.
    old = logprobs.detach() - 0.5
    (later,) = torch.autograd.grad(rloo.compute_loss(logprobs, old, adv, mask, 6)[0], logprobs)
    (trl_later,) = torch.autograd.grad(trl_rloo_loss(logprobs, old, adv, mask), logprobs)
    torch.testing.assert_close(later, ours)
    assert torch.all(trl_later[adv > 0] == 0) and not torch.all(ours[adv > 0] == 0)


def test_gradcheck_and_micro_batches_add_up_to_the_step_loss():
    torch.manual_seed(1)
    lp = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    old, adv = lp.detach() + 0.05 * torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    mask = (torch.rand(6, 4) > 0.3).double()
    assert torch.autograd.gradcheck(lambda x: rloo.compute_loss(x, old, adv, mask, 6)[0], (lp,))
    whole, _ = rloo.compute_loss(lp, old, adv, mask, 6)
    parts = sum(
        rloo.compute_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], 6)[0] for i in range(0, 6, 2)
    )
    torch.testing.assert_close(parts, whole)


def test_kl_to_the_reference_is_taken_from_the_reward(tmp_path, monkeypatch):
    # With --beta, each completion's reward becomes R_i - beta * sum_t log(pi_old(y_it) / pi_ref(y_it)) before
    # the leave-one-out baseline (the paper's RLHF reward). Step 0: the policy is the reference, KL exactly 0.
    # Step 1: it has moved, so the rewards the advantage sees average reward/mean - beta * algo/kl.
    seen, real = [], rloo.compute_advantages
    monkeypatch.setattr(rloo, "compute_advantages", lambda r, g: seen.append(r.clone()) or real(r, g))
    beta = 0.5
    rloo.main(
        rloo.Args(
            beta=beta,
            num_steps=2,
            prompts_per_step=4,
            group_size=4,
            eval_every=0,
            output_dir=str(tmp_path),
            run_name="kl",
        )
    )
    metrics = read_metrics(tmp_path / "kl")
    assert metrics[0]["algo/kl"] == 0
    assert seen[0].mean().item() == pytest.approx(metrics[0]["reward/mean"], abs=1e-6)
    assert metrics[1]["algo/kl"] != 0
    assert seen[1].mean().item() == pytest.approx(metrics[1]["reward/mean"] - beta * metrics[1]["algo/kl"], abs=1e-5)


def test_kl_penalised_reward_subtracts_beta_times_the_summed_log_ratio():
    # RLOO's RLHF reward (Ahmadian et al. 2024, arXiv:2402.14740, section 2: r(x, y) - beta log(pi(y|x) /
    # pi_ref(y|x))), the sequence's log-ratio summed over its tokens (k1), under the sampling policy pi_old.
    # Row 0 (2 tokens): (-1 - -1.5) + (-2 - -1) = -0.5; row 1 (3 tokens): 1 + 0 + 0 = 1. The third column of
    # row 0 is padding after EOS and is left out. beta 0.1: rewards [1, 0] -> [1.05, -0.1].
    old = torch.tensor([[-1.0, -2.0, -7.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    rewards, kl = rloo.kl_penalised_rewards(torch.tensor([1.0, 0.0]), old, ref, mask, beta=0.1)
    torch.testing.assert_close(kl, torch.tensor([-0.5, 1.0]))
    torch.testing.assert_close(rewards, torch.tensor([1.05, -0.1]))
    rewards, kl = rloo.kl_penalised_rewards(torch.tensor([1.0, 0.0]), old, None, mask, beta=0.0)  # no reference
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(kl, torch.zeros(2))
