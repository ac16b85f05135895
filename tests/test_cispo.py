"""cispo.py: the clipped, detached IS weight against autograd, and its relation to PPO's clipping."""

import math

import pytest
import torch

import cispo
import dapo
from common import all_reduce_mean


def coefficients(ratio: torch.Tensor, advantage: torch.Tensor, **kw) -> torch.Tensor:
    """d loss / d log pi per token, for log pi_old = 0 and one token per sequence."""
    lp = torch.log(ratio).requires_grad_()
    loss, _ = cispo.compute_loss(
        lp.view(-1, 1), torch.zeros(len(lp), 1), advantage, torch.ones(len(lp), 1), num_tokens=1, **kw
    )
    loss.backward()
    return lp.grad


def test_gradient_coefficient_is_the_clipped_weight_times_the_advantage():
    torch.manual_seed(0)
    ratio = torch.exp(torch.randn(200) * 0.8)  # ratios from ~0.1 to ~10
    adv = torch.randn(200)
    grad = coefficients(ratio, adv, is_eps_high=0.5)
    torch.testing.assert_close(grad, -ratio.clamp(max=1.5) * adv)  # no floor by default
    grad = coefficients(ratio, adv, is_eps_high=0.5, is_eps_low=0.3)
    torch.testing.assert_close(grad, -ratio.clamp(0.7, 1.5) * adv)


@pytest.mark.parametrize("advantage, ratio, coefficient", [(1.0, 1.3, 1.28), (-1.0, 0.7, -0.7), (1.0, 0.7, 0.7)])
def test_worked_example_tokens_that_ppo_silences_keep_a_gradient(advantage, ratio, coefficient):
    # CISPO's gradient (MiniMax 2025, arXiv:2506.13585, Eqs. 4-5): sg(clip(r, 1 - eps_low, 1 + eps_high)) A grad log pi.
    # eps_high 0.28: A = +1, r = 1.3 -> min(1.3, 1.28) A = 1.28; A = -1, r = 0.7, no floor -> 0.7 A = -0.7.
    # PPO/DAPO give both a zero gradient (tests/test_dapo.py).
    grad = coefficients(torch.tensor([ratio]), torch.tensor([advantage]), is_eps_high=0.28)
    assert -grad.item() == pytest.approx(coefficient, abs=1e-6)


def test_the_weight_carries_no_gradient():
    # Were the weight not detached, d/d logp of -r A logp would add -r A logp to the coefficient.
    ratio, adv = torch.tensor([1.1]), torch.tensor([2.0])
    assert coefficients(ratio, adv).item() == pytest.approx(-1.1 * 2.0, abs=1e-6)
    _, metrics = cispo.compute_loss(
        torch.log(ratio).view(1, 1), torch.zeros(1, 1), adv, torch.ones(1, 1), 1, is_eps_high=0.05
    )
    metrics = all_reduce_mean(metrics)  # (sum, count) pairs, as logged
    assert metrics["policy/clipfrac"] == 1.0 and metrics["algo/is_weight_mean"] == pytest.approx(1.05)


def test_unified_form_with_ppo_mask_reproduces_the_clipped_surrogate_gradient():
    """The paper's unified objective sg(r) A log pi M, with M = 0 where PPO's clip is active
    (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low), has exactly PPO's gradient: CISPO is
    this form with M = 1 and the weight clipped instead."""
    torch.manual_seed(0)
    old = torch.randn(8, 6)
    lp = (old + torch.randn(8, 6) * 0.4).requires_grad_()
    adv = torch.randn(8)
    mask = (torch.rand(8, 6) > 0.2).float()
    n = mask.sum().item()
    ppo_loss, _ = dapo.compute_loss(lp, old, adv, mask, n, clip_eps_low=0.2, clip_eps_high=0.28)
    (ppo_grad,) = torch.autograd.grad(ppo_loss, lp)
    ratio = torch.exp(lp - old).detach()
    A = adv[:, None]
    M = ~(((A > 0) & (ratio > 1.28)) | ((A < 0) & (ratio < 0.8)))
    unified = -(ratio * A * lp * M * mask).sum() / n
    (unified_grad,) = torch.autograd.grad(unified, lp)
    torch.testing.assert_close(unified_grad, ppo_grad)
    assert not M.all()  # some tokens were clipped: the check is not vacuous
    cispo_loss, _ = cispo.compute_loss(lp, old, adv, mask, n, is_eps_high=0.28)
    (cispo_grad,) = torch.autograd.grad(cispo_loss, lp)
    assert (cispo_grad[~M & mask.bool()] != 0).all()  # where PPO is silent, CISPO is not


def test_micro_batches_add_up_to_the_step_loss():
    # (No gradcheck here: the stop-gradient on the weight makes autograd differ from finite differences
    # by design. The coefficient tests above check the gradient exactly.)
    torch.manual_seed(0)
    lp = torch.randn(6, 5, dtype=torch.float64)
    old = lp + 0.5 * torch.randn(6, 5, dtype=torch.float64)
    adv = torch.randn(6, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    n = mask.sum().item()
    full = cispo.compute_loss(lp, old, adv, mask, n)[0]
    parts = [cispo.compute_loss(lp[i : i + 4], old[i : i + 4], adv[i : i + 4], mask[i : i + 4], n)[0] for i in (0, 4)]
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-12)


def test_ratio_one_gives_the_policy_gradient():
    # On-policy (r = 1) CISPO is REINFORCE with the group advantage: coefficient -A / N per token.
    adv = torch.tensor([0.5, -2.0])
    grad = coefficients(torch.ones(2), adv)
    torch.testing.assert_close(grad, -adv)
    assert math.isclose(cispo.Args().is_eps_high, 4.0) and cispo.Args().is_eps_low is None
