"""The rollout correction (--rollout-correction): when completions come from a sampler whose distribution
pi_s is not the trainer's pi_old (vLLM: bf16, other kernels), each token's loss is weighted by
w = pi_old / pi_s, detached:

- TIS, truncated importance sampling: min(w, C) (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"; verl's rollout correction, TRL's vllm_importance_sampling_cap);
- MIS, masked importance sampling (IcePop, arXiv:2510.18855): 1 where 1/C <= w <= C, else 0.

The weights multiply the gradient of each token's term; the normaliser (tokens or sequences) is unchanged,
as TRL and verl multiply per_token_loss before their usual aggregation."""

import math

import pytest
import torch

from common import reweighted, rollout_weights, sampler_logprob_gap
from conftest import read_metrics


def example():
    """Ratios pi_old / pi_s of 1/4, 3/2 and 3 on response tokens, then a position after EOS (both log-probs 0)."""
    sampler = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    old = sampler + torch.log(torch.tensor([[0.25, 1.5, 3.0, 1.0]]))
    old[0, 3] = 0.0
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return old, sampler, mask


def test_tis_truncates_the_ratio_at_the_cap():
    old, sampler, _ = example()
    torch.testing.assert_close(rollout_weights(old, sampler, "tis", 2.0), torch.tensor([[0.25, 1.5, 2.0, 1.0]]))
    torch.testing.assert_close(rollout_weights(old, sampler, "tis", 4.0), torch.tensor([[0.25, 1.5, 3.0, 1.0]]))


def test_mis_keeps_only_the_tokens_whose_ratio_is_within_the_cap_and_its_inverse():
    old, sampler, _ = example()
    # 1/4 < 1/2 and 3 > 2 are dropped; 3/2 is kept, with weight 1 (not 3/2)
    torch.testing.assert_close(rollout_weights(old, sampler, "mis", 2.0), torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    torch.testing.assert_close(rollout_weights(old, sampler, "mis", 4.0), torch.tensor([[1.0, 1.0, 1.0, 1.0]]))


def test_no_correction_leaves_the_log_probs_as_they_are():
    old, sampler, _ = example()
    assert rollout_weights(old, sampler, "none", 2.0) is None
    logprobs = old.clone().requires_grad_()
    assert reweighted(logprobs, None) is logprobs


def test_the_weights_carry_no_gradient():
    old, sampler, _ = example()
    old.requires_grad_()
    assert not rollout_weights(old, sampler, "tis", 2.0).requires_grad


def test_reweighted_keeps_the_values_and_scales_each_tokens_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[0.25, 1.5, 0.0]], dtype=torch.float64)
    out = reweighted(logprobs, weights)
    assert torch.equal(out, logprobs)  # exactly: lp + w * 0 (w * lp + (1 - w) * lp is off by an ulp)
    float32 = torch.randn(1000).log_softmax(0)  # float32 values and weights, as in a run
    assert torch.equal(reweighted(float32, torch.rand(1000) * 2), float32)
    coefficients = torch.tensor([[3.0, -1.0, 2.0]], dtype=torch.float64)
    (out * coefficients).sum().backward()
    torch.testing.assert_close(logprobs.grad, weights * coefficients)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_grpo_gradient_is_trl_per_token_loss_times_the_weight(correction):
    """With the weights applied through the log-probs, GRPO's gradient is that of TRL's form: the per-token
    clipped surrogate multiplied by the weight, then aggregated as usual (token-mean per sequence)."""
    from grpo import compute_loss

    torch.manual_seed(0)
    old = -torch.rand(3, 5, dtype=torch.float64) * 2
    sampler = old + torch.randn(3, 5, dtype=torch.float64) * 0.8
    logprobs = (old + torch.randn(3, 5, dtype=torch.float64) * 0.1).requires_grad_()
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    weights = rollout_weights(old, sampler, correction, 2.0)
    loss, _ = compute_loss(reweighted(logprobs, weights), old, None, advantages, mask, 3, 0.2, 0.0)
    (ours,) = torch.autograd.grad(loss, logprobs)

    ratio = torch.exp(logprobs - old)  # TRL's _compute_loss, written out again
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * weights
    theirs_loss = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    (theirs,) = torch.autograd.grad(theirs_loss, logprobs)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)
    assert (weights != 1).any()  # the example exercises the correction


def test_metrics_of_the_correction():
    old, sampler, mask = example()
    tis = sampler_logprob_gap(sampler, old, mask, "tis", 2.0)
    assert tis["policy/correction_weight_mean"] == pytest.approx((0.25 + 1.5 + 2.0) / 3)
    assert tis["policy/correction_truncated_frac"] == pytest.approx(1 / 3)
    mis = sampler_logprob_gap(sampler, old, mask, "mis", 2.0)
    assert mis["policy/correction_weight_mean"] == pytest.approx(1 / 3)
    assert mis["policy/correction_masked_frac"] == pytest.approx(2 / 3)
    gap = (abs(math.log(0.25)) + math.log(1.5) + math.log(3.0)) / 3
    assert tis["policy/sampler_logprob_gap"] == pytest.approx(gap)
    assert "policy/correction_weight_mean" not in sampler_logprob_gap(sampler, old, mask)


def run_with_sampler_temperature(tmp_path, monkeypatch, name: str, factor: float, flags: list[str]) -> list[dict]:
    """grpo.py's metrics when its sampler draws at `factor` times the temperature the trainer assumes: a
    mismatched sampler, as another engine's numerics make one, only larger."""
    import grpo
    from common import cli

    real = grpo.generate

    def mismatched(model, tokenizer, prompts, group_size, max_new_tokens, temperature, *args, **kwargs):
        return real(model, tokenizer, prompts, group_size, max_new_tokens, temperature * factor, *args, **kwargs)

    monkeypatch.setattr(grpo, "generate", mismatched)
    grpo.main(cli(grpo.Args, args=["--num-steps", "2", "--eval-every", "0", "--output-dir", str(tmp_path),
                                   "--run-name", name, *flags]))
    return read_metrics(tmp_path / name)


def test_the_metrics_follow_the_formula_with_a_mismatched_sampler(tmp_path, monkeypatch):
    """Sampled from pi_s, the untruncated weight pi_old / pi_s has expectation 1 at every position (the sum of
    pi_old over the vocabulary), so its mean over the tokens is ~1 however far pi_s is from pi_old; a cap
    then lowers it and truncates some tokens; MIS masks some. With the sampler the trainer's own, every
    weight is 1."""
    matched = run_with_sampler_temperature(tmp_path, monkeypatch, "matched", 1.0, ["--rollout-correction", "tis"])
    untruncated = run_with_sampler_temperature(tmp_path, monkeypatch, "wide", 2.0,
                                               ["--rollout-correction", "tis", "--correction-cap", "1e9"])
    tis = run_with_sampler_temperature(tmp_path, monkeypatch, "tis", 2.0, ["--rollout-correction", "tis"])
    mis = run_with_sampler_temperature(tmp_path, monkeypatch, "mis", 2.0, ["--rollout-correction", "mis"])
    for m in matched:
        assert m["policy/correction_weight_mean"] == pytest.approx(1, abs=1e-5)
        assert m["policy/correction_truncated_frac"] == 0
    for m_wide, m_tis, m_mis in zip(untruncated, tis, mis):
        assert m_wide["policy/sampler_logprob_gap"] > 0.1  # the sampler is far from the trainer
        assert m_wide["policy/correction_weight_mean"] == pytest.approx(1, abs=0.15)
        assert m_wide["policy/correction_truncated_frac"] == 0
        assert 0 < m_tis["policy/correction_truncated_frac"] < 1
        assert m_tis["policy/correction_weight_mean"] < m_wide["policy/correction_weight_mean"]
        assert 0 < m_mis["policy/correction_masked_frac"] < 1
        assert m_mis["policy/correction_weight_mean"] == pytest.approx(1 - m_mis["policy/correction_masked_frac"])
