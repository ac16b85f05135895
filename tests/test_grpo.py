"""grpo.py's algorithm functions against hand-worked numbers, each derived in its test from the paper's
equation, and against autograd."""

import math

import pytest
import torch

from common import all_reduce_mean
from grpo import compute_advantages, compute_loss


def loss_of(logprobs, old, ref, adv, mask, n=None, **kw):
    """The loss, and its metrics as logged: each (sum, count) pair's mean."""
    loss, metrics = compute_loss(logprobs, old, ref, adv, mask, n if n is not None else len(adv), **kw)
    return loss, all_reduce_mean(metrics)


def test_group_advantage_worked_example():
    # GRPO's outcome advantage (Shao et al. 2024, arXiv:2402.03300, section 4.1.2): A_i = (r_i - mean r) / std r.
    # Rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) = 0.57735, A = +-0.5 / 0.57735 = +-0.86603;
    # with eps 1e-6 added to the std (verl's): +-0.86602; with eps 1e-4: +-0.86588.
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, std_eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1, -1, -1, 1]) * 0.866025, atol=1e-6, rtol=0)
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, std_eps=1e-6)
    assert adv[0].item() == pytest.approx(0.86602, abs=1e-5)
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, std_eps=1e-4)
    assert adv[0].item() == pytest.approx(0.86588, abs=1e-5)


def test_advantages_are_per_group_and_zero_for_equal_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 0.0, 2.0])
    adv = compute_advantages(rewards, group_size=4)
    assert torch.equal(adv[:4], torch.zeros(4))  # all-equal group: no signal, no NaN
    assert adv[4].item() == pytest.approx(-0.866025, abs=1e-5)  # second group normalised on its own
    assert adv[4:].sum().item() == pytest.approx(0.0, abs=1e-6)


def test_k3_worked_example():
    # GRPO's KL estimator (arXiv:2402.03300, Eq. 4): k3 = pi_ref/pi - log(pi_ref/pi) - 1.
    # log pi = -1.0, log pi_ref = -1.2: k3 = e^-0.2 - (-0.2) - 1 = 0.8187308 + 0.2 - 1 = 0.0187308.
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.2]])
    _, m = loss_of(lp, lp, ref, torch.zeros(1), torch.ones(1, 1), beta=0.04)
    assert m["loss/kl"] == pytest.approx(0.0187308, abs=1e-7)
    loss, _ = loss_of(lp, lp, ref, torch.zeros(1), torch.ones(1, 1), beta=0.04)
    assert loss.item() == pytest.approx(0.04 * 0.0187308, abs=1e-8)


def test_ratio_one_reduces_to_minus_mean_advantage():
    torch.manual_seed(0)
    lp = torch.randn(6, 5)
    adv = torch.randn(6)
    mask = torch.ones(6, 5)
    loss, m = loss_of(lp, lp, None, adv, mask, beta=0.0)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert m["policy/clipfrac"] == 0.0 and m["policy/approx_kl"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize(
    "advantage, ratio, has_grad, objective",
    [
        # PPO's clipped objective (Schulman et al. 2017, arXiv:1707.06347, Eq. 7), eps 0.2: min(r A, clip(r) A).
        (+1.0, 1.3, False, 1.2),  # min(1.3, 1.2) = 1.2: the clipped term, no gradient
        (+1.0, 0.7, True, 0.7),  # below the trust region with A > 0: min picks the unclipped term
        (-1.0, 0.7, False, -0.8),  # min(-0.7, -0.8) = -0.8: the clipped term, no gradient
        (-1.0, 1.3, True, -1.3),  # A < 0 and r > 1 + eps: pessimistic term, gradient flows
    ],
)
def test_clipping_zeroes_the_gradient_exactly_where_it_should(advantage, ratio, has_grad, objective):
    old = torch.tensor([[-2.0]])
    lp = (old + math.log(ratio)).requires_grad_()
    loss, _ = loss_of(lp, old, None, torch.tensor([advantage]), torch.ones(1, 1), beta=0.0)
    assert -loss.item() == pytest.approx(objective, abs=1e-6)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    if has_grad:  # d(-r A)/d logp = -r A
        assert lp.grad.item() == pytest.approx(-ratio * advantage, abs=1e-6)


def test_masks_ignore_padding():
    torch.manual_seed(0)
    lp, old, ref = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    adv = torch.randn(3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]).float()
    loss, _ = loss_of(lp, old, ref, adv, mask)
    # padding positions hold other (finite) values: get_logprobs returns 0 there, a caller may not
    garbage = torch.where(mask.bool(), lp, torch.randn(3, 4) * 5)
    loss2, _ = loss_of(garbage, old, ref, adv, mask)
    assert loss.item() == pytest.approx(loss2.item(), abs=1e-6)


def test_seq_mean_differs_from_token_mean_on_unequal_lengths():
    lp = torch.zeros(2, 4)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]).float()
    loss, _ = loss_of(lp, lp, None, adv, mask, beta=0.0)
    # seq-mean-token-mean: each sequence weighs 1/2 whatever its length -> (-1 + 1) / 2 = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    token_mean = -(adv[:, None] * mask).sum() / mask.sum()  # DAPO's aggregation would give -3/5
    assert token_mean.item() == pytest.approx(-0.6)


def test_eos_token_gets_gradient():
    # The mask includes EOS (the last real token); its log-prob must receive gradient.
    lp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # two response tokens, the second is EOS, then padding
    loss, _ = loss_of(lp, lp.detach(), None, torch.tensor([1.0]), mask, beta=0.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, -0.5, 0.0]]))


def test_analytic_gradient_at_ratio_one_with_kl():
    # d/d logp of [-A r + beta k3] / |o| at r = 1: (-A + beta (1 - pi_ref/pi)) / |o| / N
    torch.manual_seed(0)
    lp = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(4, 3, dtype=torch.float64)
    adv = torch.randn(4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    loss, _ = compute_loss(lp, lp.detach(), ref, adv, mask, num_sequences=8.0, beta=0.04)
    loss.backward()
    expected = (-adv[:, None] + 0.04 * (1 - torch.exp(ref - lp.detach()))) / mask.sum(-1, keepdim=True) / 8.0 * mask
    torch.testing.assert_close(lp.grad, expected)


def test_gradcheck():
    torch.manual_seed(0)
    lp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old = lp.detach() + 0.1 * torch.randn(3, 4, dtype=torch.float64)  # ratios near 1, some clipped
    ref = torch.randn(3, 4, dtype=torch.float64)
    adv = torch.randn(3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: compute_loss(x, old, ref, adv, mask, 3.0, clip_eps=0.05)[0], (lp,))


def test_normaliser_splits_over_micro_batches():
    # The caller passes the step's sequence count, so micro-batch losses add up to the full-batch loss.
    torch.manual_seed(0)
    lp, old, ref = torch.randn(8, 5), torch.randn(8, 5) * 0.1, torch.randn(8, 5)
    old = lp + old
    adv = torch.randn(8)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1
    full, _ = compute_loss(lp, old, ref, adv, mask, 8)
    parts = sum(
        compute_loss(lp[i : i + 3], old[i : i + 3], ref[i : i + 3], adv[i : i + 3], mask[i : i + 3], 8)[0]
        for i in range(0, 8, 3)
    )
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)
