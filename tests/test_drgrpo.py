"""drgrpo.py: its advantage and loss against hand-worked numbers, each derived in its test from the paper,
against autograd, and the micro-batch split (the shared equivalence, resume, learning and shared-lines
tests run on it with the other files)."""

import pytest
import torch

import drgrpo
import grpo


def test_advantage_is_the_reward_minus_the_group_mean_without_the_std():
    # Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): A_i = R_i - mean R. Rewards [1, 0, 0, 1]: mean 0.5, A = +-0.5
    # (GRPO divides by the unbiased std 0.57735: +-0.86603). A nearly all-right group [1, 1, 1, 0]: mean 0.75,
    # A = [0.25, 0.25, 0.25, -0.75]; GRPO divides by std 0.5 and doubles it, the difficulty bias.
    adv = drgrpo.compute_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))
    torch.testing.assert_close(
        grpo.compute_advantages(torch.tensor([1.0, 1, 1, 0]), 4, std_eps=0.0), torch.tensor([0.5, 0.5, 0.5, -1.5])
    )


def lengths_2_and_4():
    """A right completion of 2 tokens (A = +0.5) and a wrong one of 4 (A = -0.5), at ratio 1."""
    logprobs = torch.full((2, 4), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    return logprobs, mask, torch.tensor([0.5, -0.5], dtype=torch.float64)


def test_loss_divides_by_the_generation_budget_not_by_each_length():
    # At r = 1 the surrogate is -A per token. Dr. GRPO: sum over tokens / (B x L), B = 2, L = 8:
    # (-0.5 * 2 + 0.5 * 4) / 16 = 0.0625, and every token's gradient is -A / 16 = -+0.03125, whatever its
    # completion's length. GRPO's 1/|o_i|: (-0.5 + 0.5) / 2 = 0, gradients -A / (2 |o_i|): -0.125 for each of
    # the right answer's 2 tokens, +0.0625 for each of the wrong answer's 4 (the length bias).
    logprobs, mask, adv = lengths_2_and_4()
    loss, _ = drgrpo.compute_loss(logprobs, logprobs.detach(), None, adv, mask, 2, 8, beta=0.0)
    assert loss.item() == pytest.approx(0.0625)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1, -1, 0, 0], [1, 1, 1, 1]]) * 0.03125, check_dtype=False)
    logprobs, mask, adv = lengths_2_and_4()
    loss, _ = grpo.compute_loss(logprobs, logprobs.detach(), None, adv, mask, 2, beta=0.0)
    assert loss.item() == pytest.approx(0.0)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.125, -0.125, 0, 0], [0.0625] * 4]), check_dtype=False)


def test_kl_term_and_gradcheck():
    # beta > 0 adds GRPO's k3 per token to the same sum: log pi = -1.0, log pi_ref = -1.2 on one token:
    # k3 = e^-0.2 + 0.2 - 1 = 0.0187308 (arXiv:2402.03300, Eq. 4); loss = 0.1 * 0.0187308 / (1 x 8).
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.2]])
    loss, _ = drgrpo.compute_loss(lp, lp, ref, torch.zeros(1), torch.ones(1, 1), 1, 8, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * 0.0187308 / 8, abs=1e-9)
    torch.manual_seed(0)
    lp = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    old, ref = lp.detach() + 0.05 * torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.7, -0.2, -0.5], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x: drgrpo.compute_loss(x, old, ref, adv, mask, 3, 8, clip_eps=0.2, beta=0.1)[0], (lp,)
    )


def test_micro_batches_add_up_to_the_step_loss():
    torch.manual_seed(1)
    lp, old = torch.randn(6, 4), torch.randn(6, 4)
    mask, adv = (torch.rand(6, 4) > 0.3).float(), torch.randn(6)
    whole, _ = drgrpo.compute_loss(lp, old, None, adv, mask, 6, 8)
    parts = sum(
        drgrpo.compute_loss(lp[i : i + 2], old[i : i + 2], None, adv[i : i + 2], mask[i : i + 2], 6, 8)[0]
        for i in range(0, 6, 2)
    )
    torch.testing.assert_close(parts, whole)
