"""dppo.py: the divergence mask on the tokens its docstring tabulates, the binary KL hand-worked, the loss and
its gradient hand-worked, against verl's and Stable-RL's form of the loss written out here, against autograd, and
the micro-batch split (the shared equivalence, resume, learning and shared-lines tests run on it with the others).

DPPO (arXiv:2602.04879): with mu = pi_old(o_t) and p = pi_theta(o_t), binary TV = |p - mu|, binary KL =
mu log(mu / p) + (1 - mu) log((1 - mu) / (1 - p)); a token is masked once that divergence passes delta (0.15 TV,
0.05 KL) in the direction its advantage pushes; the objective is the unclipped r A on the other tokens.
"""

import math

import pytest
import torch

import dppo
import grpo
from common import all_reduce_mean

# (mu, p): a rare token tripled, a common one pushed from 0.5 to 0.9, a near-certain one pulled to 0.8
TOKENS = [(0.001, 0.003), (0.5, 0.9), (0.99, 0.8)]


def masks(divergence, delta, advantage):
    mu = torch.tensor([[m for m, _ in TOKENS]], dtype=torch.float64)
    p = torch.tensor([[q for _, q in TOKENS]], dtype=torch.float64)
    return dppo.divergence_mask(p.log(), mu.log(), torch.tensor([[advantage]], dtype=torch.float64), divergence, delta)[
        0
    ].tolist()


def test_the_mask_bounds_the_probability_move_not_the_ratio():
    # TV: 0.002, 0.4, 0.19. With A > 0 only upward moves count: the rare token (ratio 3, which PPO's band at 0.2
    # clips) is kept; 0.5 -> 0.9 is masked. With A < 0 only downward moves: 0.99 -> 0.8 (ratio 0.81, inside PPO's
    # band) is masked; 0.5 -> 0.9 is kept (it moved up, away from where A < 0 pushes).
    assert masks("tv", 0.15, +1.0) == [False, True, False]
    assert masks("tv", 0.15, -1.0) == [False, False, True]
    # Binary KL, hand-worked: 0.001 log(1/3) + 0.999 log(0.999 / 0.997) = 0.0009034;
    # 0.5 log(0.5 / 0.9) + 0.5 log(0.5 / 0.1) = 0.5108256; 0.99 log(0.99 / 0.8) + 0.01 log(0.01 / 0.2) = 0.1810050.
    assert masks("kl", 0.05, +1.0) == [False, True, False]
    assert masks("kl", 0.05, -1.0) == [False, False, True]
    assert masks("kl", 0.52, +1.0) == [False, False, False]  # 0.5108 < 0.52
    assert masks("kl", 0.18, -1.0) == [False, False, True] and masks("kl", 0.182, -1.0) == [False, False, False]


def test_loss_gradient_and_metrics_hand_worked():
    # One completion (A = +1, G = 1), the three tokens above as (mu, p): ratios 3, 1.8, 0.8081. TV masks the
    # second. Loss = -(3 + 0 + 0.8080808) / 3 = -1.2693603; gradients -A r / |o|: -1, 0, -0.2693603.
    # Masked fraction 1/3; PPO's band (eps 0.2, A > 0: r > 1.2) would clip the first two: 2/3. The share of
    # sum_t r |A| = 5.6080808 removed: 1.8 / 5.6080808 = 0.3209654.
    mu = torch.tensor([[m for m, _ in TOKENS]], dtype=torch.float64)
    logprobs = torch.tensor([[q for _, q in TOKENS]], dtype=torch.float64).log().requires_grad_()
    loss, metrics = dppo.compute_loss(
        logprobs, mu.log(), None, torch.ones(1, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64), 1
    )
    assert loss.item() == pytest.approx(-(3 + 0.8 / 0.99) / 3, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, 0.0, -0.8 / 0.99 / 3]], dtype=torch.float64))
    metrics = all_reduce_mean(metrics)  # (sum, count) pairs, as logged
    assert metrics["policy/maskfrac"] == pytest.approx(1 / 3)
    assert metrics["policy/band_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["policy/gradient_removed"] == pytest.approx(0.3209654, abs=1e-7)


def peers_dppo_loss(logprobs, old_logprobs, advantages, mask, delta=0.15):
    """verl's compute_policy_loss_dppo_tv (and Stable-RL's dppo_binary_tv), written out: prob = exp(log_prob),
    valid = where(A > 0, prob - old_prob <= delta, prob - old_prob >= -delta); ratio clamped at clip_ratio_c and
    detached; pg_losses = -A sg(ratio) log_prob valid, aggregated here as GRPO's seq-mean-token-mean."""
    adv = advantages.unsqueeze(-1)
    prob, old_prob = logprobs.exp(), old_logprobs.exp()
    valid = torch.where(adv > 0, prob - old_prob <= delta, prob - old_prob >= -delta).double()
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20)).clamp(max=1e4).detach()
    pg_losses = -adv * ratio * logprobs * valid
    return ((pg_losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def test_same_gradient_as_verl():
    # verl's loss value is -A r log pi (a surrogate for its gradient), this file's -A r: the gradients agree.
    torch.manual_seed(2)
    old = torch.log_softmax(torch.randn(6, 7, 3, dtype=torch.float64), -1)[..., 0]
    lp = (old + 0.8 * torch.randn(6, 7, dtype=torch.float64)).clamp(max=-1e-3).requires_grad_()
    adv, mask = torch.tensor([1.2, -0.7, 0.0, 0.3, -1.5, 0.9], dtype=torch.float64), (torch.rand(6, 7) > 0.25).double()
    mask[:, 0] = 1
    loss, metrics = dppo.compute_loss(lp, old, None, adv, mask, 6)
    assert 0.05 < all_reduce_mean(metrics)["policy/maskfrac"] < 0.5  # the mask has work to do here
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(peers_dppo_loss(lp, old, adv, mask), lp)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


def test_with_nothing_masked_it_is_the_unclipped_policy_gradient_of_grpo():
    # delta large enough that no token is masked: the loss is GRPO's with a clip that never binds.
    torch.manual_seed(3)
    old = torch.randn(4, 5, dtype=torch.float64) - 2
    lp = old + 0.1 * torch.randn(4, 5, dtype=torch.float64)
    adv, mask = torch.randn(4, dtype=torch.float64), (torch.rand(4, 5) > 0.3).double()
    ours, _ = dppo.compute_loss(lp, old, None, adv, mask, 4, delta=1.0)
    theirs, _ = grpo.compute_loss(lp, old, None, adv, mask, 4, clip_eps=0.99, beta=0.0)
    assert math.isclose(ours.item(), theirs.item(), abs_tol=1e-12) and not math.isclose(ours.item(), 0.0)


def test_gradient_matches_autograd_with_the_kl_term():
    torch.manual_seed(4)
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old, ref = lp.detach() + 0.05 * torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    adv, mask = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    for divergence in ("tv", "kl"):
        assert torch.autograd.gradcheck(
            lambda x: dppo.compute_loss(x, old, ref, adv, mask, 3, divergence, 0.01, beta=0.1)[0], (lp,)
        )


def test_micro_batches_add_up_to_the_step_loss():
    torch.manual_seed(1)
    lp = torch.randn(6, 4)
    old, adv = lp + 0.3 * torch.randn(6, 4), torch.randn(6)
    mask = (torch.rand(6, 4) > 0.3).float()
    whole, _ = dppo.compute_loss(lp, old, None, adv, mask, 6, "kl", 0.05)
    parts = sum(
        dppo.compute_loss(lp[i : i + 2], old[i : i + 2], None, adv[i : i + 2], mask[i : i + 2], 6, "kl", 0.05)[0]
        for i in range(0, 6, 2)
    )
    torch.testing.assert_close(parts, whole)
