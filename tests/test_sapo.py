"""sapo.py: its loss against hand-worked numbers derived in each test from the paper's gate, against TRL's and verl's
formula written out here, against autograd, and the micro-batch split (the shared equivalence, resume, learning
and shared-lines tests run on it with the other files).

SAPO (Gao et al., arXiv:2511.20347): per token the objective is f(r) A with f(r) = (4 / tau) sigmoid(tau (r - 1)),
tau = tau_pos (1.0) where A > 0 and tau_neg (1.05) otherwise, averaged over each completion's tokens, then over
the completions. Its slope, the weight of the token's gradient, is w = 4 s (1 - s), s = sigmoid(tau (r - 1)).
"""

import math

import pytest
import torch

import grpo
import sapo
from common import all_reduce_mean


def test_advantage_is_grpos():
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
    torch.testing.assert_close(sapo.compute_advantages(rewards, 4), grpo.compute_advantages(rewards, 4))


def test_gated_loss_and_gradient_hand_worked():
    # Completion 0 (A = +1, tau_pos = 1), 2 tokens with ratios 1.5 and 1:
    #   f(1.5) = 4 sigmoid(0.5) = 4 x 0.6224593 = 2.4898373, f(1) = 4 x 0.5 = 2; its term -(2.4898373 + 2) / 2.
    #   gradients -A w r / |o| / G: w(1.5) = 4 x 0.6224593 x 0.3775407 = 0.9400148 -> -0.9400148 x 1.5 / 4 =
    #   -0.3525056; w(1) = 1 -> -1 / 4 = -0.25 (the policy gradient: the gate's slope is 1 at r = 1).
    # Completion 1 (A = -1, tau_neg = 1.05), 1 token (of 2 positions) with ratio 0.5:
    #   f(0.5) = (4 / 1.05) sigmoid(-0.525) = 3.8095238 x 0.3716837 = 1.4159383; its term +1.4159383.
    #   gradient -A w r / 1 / G = 4 x 0.3716837 x 0.6283163 x 0.5 / 2 = 0.2335350.
    # Loss = (-2.2449187 + 1.4159383) / 2 = -0.4144902.
    old = torch.zeros(2, 2, dtype=torch.float64)
    logprobs = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = sapo.compute_loss(logprobs, old, None, adv, mask, 2)
    assert loss.item() == pytest.approx(-0.4144902, abs=1e-7)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731 the same, exactly, from the formula
    assert loss.item() == pytest.approx((-(4 * sigmoid(0.5) + 2) / 2 + 4 / 1.05 * sigmoid(-0.525)) / 2, abs=1e-15)
    loss.backward()
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[-0.3525056, -0.25], [0.2335350, 0.0]], dtype=torch.float64), atol=1e-7, rtol=0
    )
    # The mean gate weight over the 3 tokens: (0.9400148 + 1 + 0.9341398) / 3 = 0.9580516. The share of
    # sum_t r |A| = 1.5 + 1 + 0.5 = 3 the gate removes: (1.5 x 0.0599852 + 0 + 0.5 x 0.0658602) / 3 = 0.0409693.
    metrics = all_reduce_mean(metrics)  # (sum, count) pairs, as logged
    assert metrics["policy/gate_weight"] == pytest.approx(0.9580516, abs=1e-7)
    assert metrics["policy/gradient_removed"] == pytest.approx(0.0409693, abs=1e-7)


def test_on_policy_it_is_grpos_step_and_far_off_policy_the_gradient_fades_without_an_edge():
    # At r = 1 the gate's slope is 1 for any tau: the first update of a rollout is GRPO's (its clip inactive).
    torch.manual_seed(0)
    lp = torch.randn(4, 5, dtype=torch.float64)
    adv, mask = torch.randn(4, dtype=torch.float64), (torch.rand(4, 5) > 0.3).double()
    grads = []
    for loss_fn in (
        lambda x: sapo.compute_loss(x, lp, None, adv, mask, 4, tau_pos=3.0, tau_neg=0.5)[0],
        lambda x: grpo.compute_loss(x, lp, None, adv, mask, 4, beta=0.0)[0],
    ):
        x = lp.clone().requires_grad_()
        loss_fn(x).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1])
    # One token, A = +1: GRPO's gradient is 1 up to r = 1.2 and 0 after; SAPO's weight w r decays smoothly,
    # 4 sigmoid(0.19)(1 - sigmoid(0.19)) x 1.19 = 1.1793 just inside the band, 1.2 x 0.9901 = 1.1881 at its edge,
    # and at r = 5 still 5 x 0.0707 = 0.3533.
    for r, expected in [
        (1.19, 1.19 * 4 * 0.5473576 * 0.4526424),
        (1.2, 1.2 * 4 * 0.5498340 * 0.4501660),
        (5.0, 5.0 * 4 * 0.9820138 * 0.0179862),
    ]:
        x = torch.tensor([[math.log(r)]], dtype=torch.float64, requires_grad=True)
        sapo.compute_loss(
            x,
            torch.zeros(1, 1, dtype=torch.float64),
            None,
            torch.ones(1, dtype=torch.float64),
            torch.ones(1, 1, dtype=torch.float64),
            1,
        )[0].backward()
        assert -x.grad.item() == pytest.approx(expected, abs=1e-6)


def peers_sapo_loss(logprobs, old_logprobs, advantages, mask, tau_pos=1.0, tau_neg=1.05):
    """TRL's loss_type="sapo" (grpo_trainer.py: temperatures = where(advantages > 0, pos, neg); soft_coef =
    sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures; per_token_loss = -soft_coef * advantages; loss = mean
    over sequences of the masked token mean) and verl's compute_policy_loss_sapo (the same gate, on the log-ratio
    clamped to [-20, 20], with loss_agg_mode seq-mean-token-mean), written out."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))
    adv = advantages.unsqueeze(-1)
    # (in float64 here: torch.where of two Python floats is float32, where 1.05 is 1.0499999523)
    temperatures = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    per_token_loss = -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * adv
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def test_same_value_and_gradient_as_trl_and_verl():
    torch.manual_seed(2)
    old = torch.randn(6, 7, dtype=torch.float64)
    lp = (old + 0.4 * torch.randn(6, 7, dtype=torch.float64)).requires_grad_()
    adv, mask = torch.tensor([1.2, -0.7, 0.0, 0.3, -1.5, 0.9], dtype=torch.float64), (torch.rand(6, 7) > 0.25).double()
    mask[:, 0] = 1
    loss, _ = sapo.compute_loss(lp, old, None, adv, mask, 6)
    reference = peers_sapo_loss(lp, old, adv, mask)
    torch.testing.assert_close(loss, reference, rtol=0, atol=1e-12)
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(reference, lp)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_gradient_matches_autograd_with_the_kl_term():
    torch.manual_seed(3)
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old, ref = lp.detach() + 0.2 * torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    adv, mask = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: sapo.compute_loss(x, old, ref, adv, mask, 3, beta=0.1)[0], (lp,))


def test_micro_batches_add_up_to_the_step_loss():
    torch.manual_seed(1)
    lp = torch.randn(6, 4)
    old, adv = lp + 0.3 * torch.randn(6, 4), torch.randn(6)
    mask = (torch.rand(6, 4) > 0.3).float()
    whole, _ = sapo.compute_loss(lp, old, None, adv, mask, 6)
    parts = sum(
        sapo.compute_loss(lp[i : i + 2], old[i : i + 2], None, adv[i : i + 2], mask[i : i + 2], 6)[0]
        for i in range(0, 6, 2)
    )
    torch.testing.assert_close(parts, whole)
