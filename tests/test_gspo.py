"""gspo.py: its loss against hand-worked numbers, each derived in its test from the paper, against the paper's
GSPO-token form written out here, against autograd, and the micro-batch split (the shared equivalence, resume,
learning and shared-lines tests run on it with the other files)."""

import math

import pytest
import torch

import grpo
import gspo
from common import all_reduce_mean


def test_advantage_is_grpos():
    # GSPO (Zheng et al. 2025, arXiv:2507.18071) keeps GRPO's group z-score: rewards [1, 0, 0, 1] -> +-0.86603.
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
    torch.testing.assert_close(gspo.compute_advantages(rewards, 4), grpo.compute_advantages(rewards, 4))
    torch.testing.assert_close(gspo.compute_advantages(rewards, 4)[:2], torch.tensor([0.86603, -0.86603]))


def test_each_sequence_has_one_ratio_the_geometric_mean_clipped_as_a_whole():
    # s_i = exp(1/|y_i| sum_t (log pi_theta - log pi_old)) (arXiv:2507.18071, defined with Eq. 5), clipped to
    # [1 - 3e-4, 1 + 4e-4] (section 5.1); J = 1/G sum_i min(s_i A_i, clip(s_i) A_i) (Eq. 5), G = 2 here.
    # Completion 0 (2 tokens, A = +1): log-ratios 0.001, 0.003 -> s_0 = e^0.002 = 1.002002 > 1.0004: clipped,
    #   its term is -1.0004 and it has no gradient.
    # Completion 1 (4 tokens, A = -1): log-ratios -1e-4 each -> s_1 = e^-1e-4 = 0.9999000 inside the range:
    #   its term is +s_1, and each token's gradient is s_1 / |y_1| / G = 0.9999000 / 8 = 0.1249875.
    # Loss = (-1.0004 + 0.9999000) / 2 = -0.00025000.
    old = torch.zeros(2, 4, dtype=torch.float64)
    logprobs = torch.tensor([[0.001, 0.003, 0, 0], [-1e-4] * 4], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    loss, metrics = gspo.compute_loss(logprobs, old, None, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, 2)
    s1 = math.exp(-1e-4)
    assert loss.item() == pytest.approx((-1.0004 + s1) / 2, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0, 0, 0, 0], [s1 / 8] * 4], dtype=torch.float64))
    assert all_reduce_mean(metrics)["policy/clipfrac"] == pytest.approx(2 / 6)  # the clipped sequence's 2 tokens of 6


def test_tokens_share_their_sequences_ratio_where_grpo_clips_each_token():
    # One completion (A = +1, G = 1) whose token log-ratios are +0.003 and -0.003: s = e^0 = 1, not clipped, and
    # both tokens get -A s / |y| = -0.5. GRPO with the same range clips per token: r_1 = e^0.003 > 1.0004 with
    # A > 0 loses its gradient; r_2 = e^-0.003 = 0.9970045 keeps -A r_2 / |o| = -0.4985022.
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask, adv = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    logprobs = torch.tensor([[0.003, -0.003]], dtype=torch.float64, requires_grad=True)
    gspo.compute_loss(logprobs, old, None, adv, mask, 1)[0].backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5]], dtype=torch.float64))
    logprobs.grad = None
    grpo.compute_loss(logprobs, old, None, adv, mask, 1, clip_eps=4e-4, beta=0.0)[0].backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -math.exp(-0.003) / 2]], dtype=torch.float64))


def gspo_token_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """The paper's GSPO-token objective (arXiv:2507.18071), negated, with one advantage per
    completion: s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)], J = 1/G sum_i 1/|y_i| sum_t
    min(s_it A_i, clip(s_it) A_i). verl's loss_mode=gspo computes this form ("seq-mean-token-mean")."""
    lengths = mask.sum(-1)
    s = torch.exp(((logprobs - old_logprobs) * mask).sum(-1) / lengths)  # (B,)
    s_t = s.detach().unsqueeze(-1) * torch.exp(logprobs - logprobs.detach())  # (B, T): value s_i, token gradient
    adv = advantages.unsqueeze(-1)
    j = torch.min(s_t * adv, torch.clamp(s_t, 1 - eps_low, 1 + eps_high) * adv)
    return -((j * mask).sum(-1) / lengths).mean()


def test_same_value_and_gradient_as_the_gspo_token_form():
    # The paper: with A_it = A_i for every token, GSPO-token and GSPO have the same objective and gradient.
    torch.manual_seed(0)
    logprobs = torch.randn(8, 6, dtype=torch.float64).requires_grad_(True)
    old = logprobs.detach() + 6e-4 * torch.randn(8, 6, dtype=torch.float64)  # some sequences inside the range, some not
    mask = (torch.rand(8, 6) < 0.7).double()
    mask[:, 0] = 1
    adv = torch.randn(8, dtype=torch.float64)
    loss, metrics = gspo.compute_loss(logprobs, old, None, adv, mask, 8)
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference = gspo_token_loss(logprobs, old, adv, mask, 3e-4, 4e-4)
    (reference_grad,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, reference_grad)
    assert 0 < all_reduce_mean(metrics)["policy/clipfrac"] < 1


def test_kl_term_and_gradcheck():
    # beta > 0 adds GRPO's token-mean k3: log pi = -1.0, log pi_ref = -1.2 on one token, A = 0:
    # k3 = e^-0.2 + 0.2 - 1 = 0.0187308 (arXiv:2402.03300, Eq. 4); loss = 0.1 * 0.0187308.
    lp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.2]])
    loss, _ = gspo.compute_loss(lp, lp, ref, torch.zeros(1), torch.ones(1, 1), 1, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * 0.0187308, abs=1e-8)
    torch.manual_seed(0)
    lp = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    old, ref = lp.detach() + 1e-3 * torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.7, -0.2, -0.5, 1.1], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: gspo.compute_loss(x, old, ref, adv, mask, 4, beta=0.1)[0], (lp,))


def test_micro_batches_add_up_to_the_step_loss():
    torch.manual_seed(1)
    lp = torch.randn(6, 4)
    old, adv = lp + 5e-4 * torch.randn(6, 4), torch.randn(6)
    mask = (torch.rand(6, 4) > 0.3).float()
    mask[:, 0] = 1
    whole, _ = gspo.compute_loss(lp, old, None, adv, mask, 6)
    parts = sum(
        gspo.compute_loss(lp[i : i + 2], old[i : i + 2], None, adv[i : i + 2], mask[i : i + 2], 6)[0]
        for i in range(0, 6, 2)
    )
    torch.testing.assert_close(parts, whole)


def test_a_row_without_tokens_adds_nothing_to_the_loss_as_in_grpo():
    # A completion with no response token (mask all 0) has no action to score: GRPO's masked token sum gives
    # it 0, and so must GSPO, whose sequence ratio exp(0) = 1 would otherwise add -A_i = -1.5 to the loss value.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    advantages = torch.tensor([0.5, 1.5])
    for module in (gspo, grpo):
        both, _ = module.compute_loss(logprobs, logprobs, None, advantages, mask, 1, beta=0.0)
        first, _ = module.compute_loss(logprobs[:1], logprobs[:1], None, advantages[:1], mask[:1], 1, beta=0.0)
        torch.testing.assert_close(both, first)
        torch.testing.assert_close(both, torch.tensor(-0.5))  # -A_0 * ratio 1
