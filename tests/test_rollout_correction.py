"""The rollout correction (--rollout-correction): when completions come from a sampler whose distribution
pi_s is not the trainer's pi_old (vLLM: bf16, other kernels), each token's loss is weighted by
w = pi_old / pi_s, detached:

- TIS, truncated importance sampling: min(w, C) (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"; verl's rollout correction, TRL's vllm_importance_sampling_cap);
- MIS, the token mask: 1 where 1/C <= w <= C, else 0 (verl's token-level rejection, `token_k1`);

and at the level of the completion, with its ratio prod_t w_t (verl's rollout_corr_helper.py):

- seq-tis: min(prod_t w_t, C) on every token of the completion (verl's rollout_is="sequence");
- seq-mis: the completion left out when prod_t w_t is outside [1/C, C] (verl's seq_sum_k1);
- geo-mis: the same for the geometric mean exp(mean_t log w_t), whatever the length (verl's seq_mean_k1).

The weights multiply the gradient of each token's term; the normaliser (tokens or sequences) is unchanged,
as TRL multiplies per_token_loss before its usual aggregation (verl removes rejected tokens from it)."""

import importlib
import math

import pytest
import torch

from common import reweighted, rollout_weights, sampler_logprob_gap
from conftest import ALGORITHMS, read_metrics


def example():
    """Ratios pi_old / pi_s of 1/4, 3/2 and 3 on response tokens, then a position after EOS (both log-probs 0)."""
    sampler = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    old = sampler + torch.log(torch.tensor([[0.25, 1.5, 3.0, 1.0]]))
    old[0, 3] = 0.0
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return old, sampler, mask


def test_tis_truncates_the_ratio_at_the_cap():
    old, sampler, mask = example()
    torch.testing.assert_close(rollout_weights(old, sampler, mask, "tis", 2.0), torch.tensor([[0.25, 1.5, 2.0, 1.0]]))
    torch.testing.assert_close(rollout_weights(old, sampler, mask, "tis", 4.0), torch.tensor([[0.25, 1.5, 3.0, 1.0]]))


def test_mis_keeps_only_the_tokens_whose_ratio_is_within_the_cap_and_its_inverse():
    old, sampler, mask = example()
    # 1/4 < 1/2 and 3 > 2 are dropped; 3/2 is kept, with weight 1 (not 3/2)
    torch.testing.assert_close(rollout_weights(old, sampler, mask, "mis", 2.0), torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    torch.testing.assert_close(rollout_weights(old, sampler, mask, "mis", 4.0), torch.tensor([[1.0, 1.0, 1.0, 1.0]]))


def test_the_sequence_modes_weigh_a_completion_by_the_product_of_its_ratios():
    """The example's ratios 1/4, 3/2, 3: their product is 9/8, their geometric mean (9/8)^(1/3) = 1.040.
    Every token of the completion gets the completion's weight; the position after EOS does not count."""
    old, sampler, mask = example()
    product, geometric = 9 / 8, (9 / 8) ** (1 / 3)
    assert 1.03 < geometric < 1.1 < product < 2.0  # so each cap below sorts the three modes apart
    for cap, seq_tis, seq_mis, geo_mis in [(2.0, product, 1.0, 1.0), (1.1, 1.1, 0.0, 1.0), (1.03, 1.03, 0.0, 0.0)]:
        for mode, expected in [("seq-tis", seq_tis), ("seq-mis", seq_mis), ("geo-mis", geo_mis)]:
            weights = rollout_weights(old, sampler, mask, mode, cap)
            torch.testing.assert_close(weights[:, :3], torch.full((1, 3), expected), msg=f"{mode} at C={cap}")


def test_the_sequence_modes_do_not_overflow_on_long_completions():
    """2,000 tokens with w = e^0.5 each: prod_t w_t = e^1000, past float32 (and float64): the sum stays in
    log space, so seq-tis gives C, seq-mis leaves the completion out, and the geometric mean e^0.5 = 1.65 is
    within [1/2, 2]; a ratio of e^-0.5 (prod e^-1000) is left out by seq-mis, kept by geo-mis."""
    sampler = torch.full((2, 2000), -3.0)
    old = sampler + torch.tensor([[0.5], [-0.5]])
    mask = torch.ones(2, 2000)
    seq_tis = rollout_weights(old, sampler, mask, "seq-tis", 2.0)  # e^-1000 is held at verl's floor, e^-20
    torch.testing.assert_close(seq_tis, torch.tensor([[2.0], [math.exp(-20)]]).expand(2, 2000))
    assert torch.equal(rollout_weights(old, sampler, mask, "seq-mis", 2.0), torch.zeros(2, 2000))
    assert torch.equal(rollout_weights(old, sampler, mask, "geo-mis", 2.0), torch.ones(2, 2000))


def test_the_geometric_mean_counts_the_response_tokens_only():
    """Two completions with the same ratios on their tokens, one cut short by EOS: their geometric means are
    the same (it divides by each one's length), their products are not."""
    sampler = torch.full((2, 4), -1.0)
    old = sampler + math.log(1.5)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    old, sampler = old * mask, sampler * mask  # both 0 after EOS, as the trainer and the samplers give them
    assert torch.equal(rollout_weights(old, sampler, mask, "geo-mis", 1.6), torch.ones(2, 4))
    seq = rollout_weights(old, sampler, mask, "seq-mis", 3.0)  # 1.5^4 = 5.06 > 3, 1.5^2 = 2.25 < 3
    assert seq[:, 0].tolist() == [0.0, 1.0]


def test_no_correction_leaves_the_log_probs_as_they_are():
    old, sampler, mask = example()
    assert rollout_weights(old, sampler, mask, "none", 2.0) is None
    logprobs = old.clone().requires_grad_()
    assert reweighted(logprobs, None) is logprobs


def test_the_weights_carry_no_gradient():
    old, sampler, mask = example()
    old.requires_grad_()
    assert not rollout_weights(old, sampler, mask, "tis", 2.0).requires_grad


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


def peer_weights(old, sampler, mask, correction, cap):
    """The peers' weights, written out again from their code: TRL's GRPOTrainer (token_truncate,
    sequence_truncate: exp of the summed log-ratio, clamped at C_max) and verl's rollout_corr_helper.py (the
    rejection masks, in log space: token_k1, seq_sum_k1, seq_mean_k1 with bounds log(1/C), log C on minus
    the log-ratio)."""
    diff = (old - sampler) * mask  # TRL's per_token_logps_diff; verl's log_ratio on the response tokens
    lower, upper = math.log(1 / cap), math.log(cap)
    statistic = {
        "mis": -diff,
        "seq-mis": -diff.sum(-1, keepdim=True),
        "geo-mis": -diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True),
    }
    if correction in statistic:
        return ((statistic[correction] >= lower) & (statistic[correction] <= upper)).to(old.dtype).expand_as(old)
    return {"tis": diff, "seq-tis": diff.sum(-1, keepdim=True)}[correction].exp().clamp(max=cap).expand_as(old)


@pytest.mark.parametrize("correction", ["tis", "mis", "seq-tis", "seq-mis", "geo-mis"])
def test_grpo_gradient_is_trl_per_token_loss_times_the_peers_weight(correction):
    """The weights are the peers' (`peer_weights`), and with them applied through the log-probs GRPO's gradient
    is that of TRL's form: the per-token clipped surrogate multiplied by the weight, then aggregated as usual
    (token-mean per sequence)."""
    from grpo import compute_loss

    torch.manual_seed(0)
    old = -torch.rand(3, 5, dtype=torch.float64) * 2
    sampler = old + torch.randn(3, 5, dtype=torch.float64) * 0.8
    logprobs = (old + torch.randn(3, 5, dtype=torch.float64) * 0.1).requires_grad_()
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float64)
    cap = 1.2 if correction == "geo-mis" else 2.0  # a geometric mean varies less: a cap that masks some
    weights = rollout_weights(old, sampler, mask, correction, cap)
    torch.testing.assert_close(
        weights * mask, peer_weights(old, sampler, mask, correction, cap) * mask, rtol=1e-15, atol=0
    )
    loss, _ = compute_loss(reweighted(logprobs, weights), old, None, advantages, mask, 3, 0.2, 0.0)
    (ours,) = torch.autograd.grad(loss, logprobs)

    ratio = torch.exp(logprobs - old)  # TRL's _compute_loss, written out again
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv) * weights
    theirs_loss = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    (theirs,) = torch.autograd.grad(theirs_loss, logprobs)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)
    assert ((weights != 1) & (mask == 1)).any()  # the example exercises the correction


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
    assert tis["policy/correction_truncated_seq_frac"] == 1  # the one completion has a truncated token


def test_the_effective_sample_size_of_the_weights():
    """ESS = (sum w)^2 / (n sum w^2) over the response tokens, a share in (0, 1]: the example's ratios pi_old /
    pi_sampler are 0.25, 1.5 and 3 (22.5625 / (3 * 11.3125) = 0.6648), truncated at C = 2 0.25, 1.5 and 2 (14.0625 /
    (3 * 6.3125) = 0.7426), masked 0, 1 and 0 (1 / 3); equal weights give 1."""
    old, sampler, mask = example()
    tis = sampler_logprob_gap(sampler, old, mask, "tis", 2.0)
    assert tis["policy/sampler_ratio_ess"] == pytest.approx(4.75**2 / (3 * (0.25**2 + 1.5**2 + 3.0**2)))
    assert tis["policy/correction_ess"] == pytest.approx(3.75**2 / (3 * (0.25**2 + 1.5**2 + 2.0**2)))
    assert sampler_logprob_gap(sampler, old, mask, "mis", 2.0)["policy/correction_ess"] == pytest.approx(1 / 3)
    assert sampler_logprob_gap(sampler + 0.7 * mask, sampler, mask)["policy/sampler_ratio_ess"] == pytest.approx(1)


def test_metrics_of_the_sequence_modes_count_completions():
    """Two completions with w = 1.5 on each token, of 4 and 2 tokens: products 5.06 and 2.25. seq-mis at C = 3
    leaves the first out (4 of 6 tokens, 1 of 2 completions); seq-tis at C = 3 truncates it to 3."""
    sampler = torch.full((2, 4), -1.0)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    old, sampler = (sampler + math.log(1.5)) * mask, sampler * mask
    mis = sampler_logprob_gap(sampler, old, mask, "seq-mis", 3.0)
    assert mis["policy/correction_masked_frac"] == pytest.approx(4 / 6)
    assert mis["policy/correction_masked_seq_frac"] == pytest.approx(1 / 2)
    assert mis["policy/correction_weight_mean"] == pytest.approx(2 / 6)
    tis = sampler_logprob_gap(sampler, old, mask, "seq-tis", 3.0)
    assert tis["policy/correction_truncated_seq_frac"] == pytest.approx(1 / 2)
    assert tis["policy/correction_weight_mean"] == pytest.approx((4 * 3.0 + 2 * 1.5**2) / 6)


def run_with_sampler_temperature(
    tmp_path, monkeypatch, name: str, factor: float, flags: list[str], algo: str = "grpo", steps: int = 2
) -> list[dict]:
    """A file's metrics when its sampler draws at `factor` times the temperature the trainer assumes: a
    mismatched sampler, as another engine's numerics make one, only larger."""
    from harness import cli

    module = importlib.import_module(algo)
    real = module.generate

    def mismatched(model, tokenizer, prompts, group_size, max_new_tokens, temperature, *args, **kwargs):
        return real(model, tokenizer, prompts, group_size, max_new_tokens, temperature * factor, *args, **kwargs)

    monkeypatch.setattr(module, "generate", mismatched)
    module.main(
        cli(
            module.Args,
            args=[
                "--num-steps",
                str(steps),
                "--eval-every",
                "0",
                "--output-dir",
                str(tmp_path),
                "--run-name",
                name,
                *flags,
            ],
        )
    )
    return read_metrics(tmp_path / name)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_file_runs_the_sequence_modes(tmp_path, monkeypatch, algo):
    """--rollout-correction seq-tis, seq-mis and geo-mis in every file, with a sampler at 1.5 times the trainer's
    temperature and C = 1.2 (so that the sequence ratios leave [1/C, C]): the metrics follow the definitions, a
    0/1 weight's mean is the share of tokens kept, and some completions are truncated or masked."""
    flags = ["--prompts-per-step", "4", "--group-size", "4", "--correction-cap", "1.2", "--rollout-correction"]
    for mode, changed in [("seq-tis", "truncated"), ("seq-mis", "masked"), ("geo-mis", "masked")]:
        steps = run_with_sampler_temperature(tmp_path, monkeypatch, mode, 1.5, flags + [mode], algo)
        assert sum(m[f"policy/correction_{changed}_seq_frac"] for m in steps) > 0, (mode, steps)
        for m in steps:
            if m.get("algo/kept_groups_frac") == 0:  # DAPO drew no group with a signal: nothing to weigh
                continue
            for share in [f"policy/correction_{changed}_frac", f"policy/correction_{changed}_seq_frac"]:
                assert 0 <= m[share] <= 1, (mode, m)
            if changed == "masked":
                assert m["policy/correction_weight_mean"] == pytest.approx(1 - m["policy/correction_masked_frac"])
            else:
                assert 0 < m["policy/correction_weight_mean"] <= 1.2


def test_the_metrics_follow_the_formula_with_a_mismatched_sampler(tmp_path, monkeypatch):
    """Sampled from pi_s, the untruncated weight pi_old / pi_s has expectation 1 at every position (the sum of
    pi_old over the vocabulary), so its mean over the tokens is ~1 however far pi_s is from pi_old; a cap
    then lowers it and truncates some tokens; MIS masks some. With the sampler the trainer's own, every
    weight is 1. One step each, of 256 completions, one update: the metrics are the rollout's."""

    def one_step(name: str, factor: float, *flags: str) -> list[dict]:
        return run_with_sampler_temperature(
            tmp_path, monkeypatch, name, factor, ["--updates-per-rollout", "1", *flags], steps=1
        )

    matched = one_step("matched", 1.0, "--rollout-correction", "tis")
    untruncated = one_step("wide", 2.0, "--rollout-correction", "tis", "--correction-cap", "1e9")
    tis = one_step("tis", 2.0, "--rollout-correction", "tis")
    mis = one_step("mis", 2.0, "--rollout-correction", "mis")
    for m in matched:
        assert m["policy/correction_weight_mean"] == pytest.approx(1, abs=1e-5)
        assert m["policy/correction_truncated_frac"] == 0
    assert len(matched) == len(untruncated) == 1
    for m_wide, m_tis, m_mis in zip(untruncated, tis, mis):
        assert m_wide["policy/sampler_logprob_gap"] > 0.1  # the sampler is far from the trainer
        assert m_wide["policy/correction_weight_mean"] == pytest.approx(1, abs=0.15)
        assert m_wide["policy/correction_truncated_frac"] == 0
        assert 0 < m_tis["policy/correction_truncated_frac"] < 1
        assert m_tis["policy/correction_weight_mean"] < m_wide["policy/correction_weight_mean"]
        assert 0 < m_mis["policy/correction_masked_frac"] < 1
        assert m_mis["policy/correction_weight_mean"] == pytest.approx(1 - m_mis["policy/correction_masked_frac"])
