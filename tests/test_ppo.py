"""ppo.py: GAE against hand-worked numbers (derived in the test from the GAE paper), whitening, the
clipped value loss, the per-token reward (KL penalty, score placement, EOS trick), the adaptive KL
coefficient, and a reward-model run (the shared equivalence, learning and shared-lines tests are in
test_runs.py and test_files.py)."""

import pytest
import torch

import ppo
from common import UsageError, all_reduce_mean
from conftest import read_metrics


def test_gae_worked_example():
    # GAE (Schulman et al. 2016, arXiv:1506.02438, Eq. 16): A_t = delta_t + gamma lam A_{t+1},
    # delta_t = r_t + gamma V(t+1) - V(t), V after the last token 0. gamma 1, lambda 0.95, rewards [0, 0, 1],
    # values [0.5, 0.6, 0.7]: delta = [0.1, 0.1, 0.3]; A_2 = 0.3, A_1 = 0.1 + 0.95 * 0.3 = 0.385,
    # A_0 = 0.1 + 0.95 * 0.385 = 0.46575; returns A + V = [0.96575, 0.985, 1.0].
    rewards, values, mask = torch.tensor([[0.0, 0, 1]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3)
    advantages, returns = ppo.compute_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.46575, 0.385, 0.3]]))
    torch.testing.assert_close(returns, torch.tensor([[0.96575, 0.985, 1.0]]))


def test_gae_treats_the_last_real_token_as_terminal_and_ignores_padding():
    # The same completion padded to 5 columns, with garbage rewards and values after its end: identical
    # numbers on its 3 tokens (V after the last token is 0), zeros after.
    rewards = torch.tensor([[0.0, 0, 1, 5, 5], [0.0, 0, 1, 0, 0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9, 9], [0.5, 0.6, 0.7, 0, 0]])
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1.0, 1, 1, 0, 0]])
    advantages, returns = ppo.compute_advantages(rewards, values, mask)
    expected = torch.tensor([0.46575, 0.385, 0.3, 0, 0])
    torch.testing.assert_close(advantages, torch.stack([expected, expected]))
    torch.testing.assert_close(returns[:, :3], torch.tensor([[0.96575, 0.985, 1.0]] * 2))
    assert (returns[:, 3:] == 0).all()


def test_gae_with_lambda_1_and_gamma_1_is_reward_to_go_minus_value():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.float64)
    advantages, returns = ppo.compute_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(returns, reward_to_go)
    torch.testing.assert_close(advantages, reward_to_go - values)


def test_whitening_uses_only_valid_tokens():
    x = torch.tensor([[1.0, 2, 3, 100], [4.0, 5, -100, -100]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 1, 0, 0]])
    valid = torch.tensor([1.0, 2, 3, 4, 5])
    expected = (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8)  # unbiased variance
    out = ppo.whiten(x, mask)
    torch.testing.assert_close(out[mask > 0], expected)
    assert (out[mask == 0] == 0).all()


def test_whitening_over_ranks_uses_the_whole_batch():
    """Two halves whitened with their statistics summed (what all_reduce does over two ranks) give
    the whole batch's result; whitened alone, they would not."""
    torch.manual_seed(0)
    x, mask = torch.randn(6, 4), (torch.rand(6, 4) > 0.3).float()
    whole = ppo.whiten(x, mask)
    halves = [(x[:3], mask[:3]), (x[3:], mask[3:])]
    sums = sum(torch.stack([m.sum(), (h * m).sum(), (h * h * m).sum()]) for h, m in halves)
    parts = torch.cat([ppo.whiten(h, m, reduce=lambda local: sums) for h, m in halves])
    torch.testing.assert_close(parts, whole)
    assert not torch.allclose(torch.cat([ppo.whiten(h, m) for h, m in halves]), whole)


def value_loss_and_grad(value: float, old_value: float, ret: float, clip: float = 0.2):
    v = torch.tensor([[value]], requires_grad=True)
    loss, clipfrac = ppo.compute_value_loss(
        v, torch.tensor([[old_value]]), torch.tensor([[ret]]), torch.ones(1, 1), num_tokens=1.0, value_clip_eps=clip
    )
    loss.backward()
    return loss.item(), clipfrac.item(), v.grad.item()


def test_value_loss_unclipped_branch():
    # V moved 0.5 away from V_old toward the return: the clipped prediction (0.2) is further from the
    # return 1.0 than V (0.5), so the larger error is the clipped one ... and it carries no gradient.
    loss, clipfrac, grad = value_loss_and_grad(value=0.5, old_value=0.0, ret=1.0)
    assert loss == pytest.approx(0.5 * 0.8**2) and clipfrac == 1.0 and grad == 0.0
    # Inside the clip range the two errors agree: loss 1/2 (V - R)^2, gradient V - R.
    loss, clipfrac, grad = value_loss_and_grad(value=0.1, old_value=0.0, ret=1.0)
    assert loss == pytest.approx(0.5 * 0.9**2) and clipfrac == 0.0 and grad == pytest.approx(-0.9)


def test_value_loss_clipped_branch_only_blocks_moves_that_make_the_error_worse():
    # V moved 0.5 away from V_old and past the return: the unclipped error (V - R = 0.5) is the larger
    # one, so it is kept, with its gradient.
    loss, clipfrac, grad = value_loss_and_grad(value=0.5, old_value=0.0, ret=0.0)
    assert loss == pytest.approx(0.5 * 0.5**2) and clipfrac == 0.0 and grad == pytest.approx(0.5)


def test_value_loss_gradcheck():
    torch.manual_seed(0)
    v = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    old, ret = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    mask = (torch.rand(3, 5) > 0.3).double()
    assert torch.autograd.gradcheck(lambda x: ppo.compute_value_loss(x, old, ret, mask, 7.0, 0.2)[0], (v,))


def test_kl_penalty_on_every_token_and_score_on_the_last_real_one():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.5, -0.5, -3.0], [-0.8, -1.0, 0.0, -3.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1.0, 1, 0, 0]])
    scores = torch.tensor([1.0, 0.5])
    rewards, kl = ppo.compute_rewards(scores, torch.tensor([False, False]), old, ref, mask, beta=0.1)
    k1 = torch.tensor([[0.2, -0.5, 0.0, 0.0], [-0.2, 0.0, 0.0, 0.0]])  # log pi_old - log pi_ref, masked
    torch.testing.assert_close(kl, k1)
    expected = -0.1 * k1
    expected[0, 2] += 1.0  # the third token ends completion 0
    expected[1, 1] += 0.5
    torch.testing.assert_close(rewards, expected)
    assert not rewards.requires_grad  # the KL penalty is part of the reward: no gradient flows through it


def test_eos_trick_replaces_the_score_of_a_cut_off_completion():
    zeros, mask = torch.zeros(2, 3), torch.ones(2, 3)
    truncated = torch.tensor([False, True])
    rewards, _ = ppo.compute_rewards(torch.tensor([1.0, 1.0]), truncated, zeros, zeros, mask, 0.1, no_eos_score=-1.0)
    torch.testing.assert_close(rewards[:, -1], torch.tensor([1.0, -1.0]))
    rewards, _ = ppo.compute_rewards(torch.tensor([1.0, 1.0]), truncated, zeros, zeros, mask, 0.1, no_eos_score=None)
    torch.testing.assert_close(rewards[:, -1], torch.tensor([1.0, 1.0]))


def test_adaptive_kl_coefficient_moves_toward_the_target():
    assert ppo.update_kl_coef(0.05, observed_kl=2.0, target_kl=1.0, num_sequences=256) > 0.05
    assert ppo.update_kl_coef(0.05, observed_kl=0.5, target_kl=1.0, num_sequences=256) < 0.05
    assert ppo.update_kl_coef(0.05, observed_kl=1.0, target_kl=1.0, num_sequences=256) == 0.05
    # The proportional error is clipped at +-20%: KL 10x the target moves beta as much as 1.2x does.
    assert ppo.update_kl_coef(0.05, 10.0, 1.0, 256) == pytest.approx(0.05 * (1 + 0.2 * 256 / 10000))
    assert ppo.update_kl_coef(0.05, 10.0, 1.0, 256) == pytest.approx(ppo.update_kl_coef(0.05, 1.2, 1.0, 256))


def test_policy_loss_clips_and_is_a_global_token_mean():
    # PPO's clipped objective (arXiv:1707.06347, Eq. 7), eps 0.2: A = +1, r = 1.3 -> min(1.3, 1.2), the clipped
    # term, zero gradient; A = -1, r = 0.7 -> min(-0.7, -0.8) = -0.8, clipped at 0.8, zero gradient.
    logprobs = torch.log(torch.tensor([[1.3, 0.7]])).requires_grad_()
    zeros, ones = torch.zeros(1, 2), torch.ones(1, 2)
    loss, metrics = ppo.compute_loss(
        logprobs, zeros, torch.tensor([[1.0, -1.0]]), zeros, zeros, zeros, ones, num_tokens=4.0, vf_coef=0.0
    )
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 4)  # divided by the step's 4 tokens, not these 2
    assert logprobs.grad.abs().max().item() == 0.0 and all_reduce_mean(metrics)["policy/clipfrac"] == 1.0


def test_critic_values_are_read_from_the_hidden_state_before_each_response_token():
    """Values of the response tokens of a left-padded batch equal those of each row run alone, unpadded."""
    from transformers import AutoModel

    from harness import DEFAULT_MODEL, load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    critic = ppo.Critic(AutoModel.from_pretrained(DEFAULT_MODEL))
    torch.nn.init.normal_(critic.value_head.weight)
    ids = torch.tensor([[tokenizer.pad_token_id, 5, 6, 7, 8, 9], [4, 5, 6, 7, 8, 3]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        batched = critic(ids, mask, prompt_length=3)  # (2, 3): responses are the last 3 columns
        alone = critic(ids[:1, 1:], mask[:1, 1:], prompt_length=2)
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)
    hidden = critic.backbone(input_ids=ids[1:], attention_mask=mask[1:]).last_hidden_state  # (1, 6, H)
    torch.testing.assert_close(batched[1], critic.value_head(hidden[0, 2:5]).squeeze(-1), atol=1e-5, rtol=1e-5)


def test_adaptive_kl_run_and_bad_target(tmp_path):
    ppo.main(
        ppo.Args(
            num_steps=3,
            prompts_per_step=4,
            group_size=2,
            eval_every=0,
            target_kl=1e-4,
            output_dir=str(tmp_path),
            run_name="adaptive",
        )
    )
    metrics = read_metrics(tmp_path / "adaptive")
    beta, kl = [m["algo/beta"] for m in metrics], [m["algo/kl"] for m in metrics]
    assert beta[0] == 0.05 and kl[0] == 0.0  # step 0 samples from the reference itself
    for step in range(2):  # each step's KL sets the next step's coefficient (8 completions per step)
        assert beta[step + 1] == pytest.approx(ppo.update_kl_coef(beta[step], kl[step], 1e-4, 8), rel=1e-6)
    assert beta[1] < beta[0]  # KL 0 is below target
    with pytest.raises(UsageError, match="--target-kl -1.0: must be positive"):
        ppo.main(ppo.Args(num_steps=1, target_kl=-1.0, output_dir=str(tmp_path), run_name="bad"))
    assert not (tmp_path / "bad").exists()


@pytest.fixture(scope="module")
def reward_model_folder(tmp_path_factory):
    """A random tiny sequence-classification reward model that shares the default model's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from harness import DEFAULT_MODEL, load_tokenizer

    folder = tmp_path_factory.mktemp("rm") / "rm"
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(DEFAULT_MODEL, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    load_tokenizer(DEFAULT_MODEL).save_pretrained(folder)
    return folder


def test_reward_model_scores_are_the_rewards(tmp_path, monkeypatch, reward_model_folder):
    """Two steps with --reward-model: the scores PPO turns into rewards are the reward model's scores of
    each prompt + completion (+ EOS), each computed here alone, without padding; the critic starts from
    the reward model's backbone."""
    from transformers import AutoModelForSequenceClassification

    from common import format_prompt
    from harness import load_tokenizer

    seen, real = [], ppo.compute_rewards

    def spy(scores, truncated, *args, **kwargs):
        seen.append((scores.clone(), truncated.clone()))
        return real(scores, truncated, *args, **kwargs)

    texts, real_generate = [], ppo.generate

    def generate_spy(*args, **kwargs):
        rollout = real_generate(*args, **kwargs)
        texts.append(rollout.texts)
        return rollout

    monkeypatch.setattr(ppo, "compute_rewards", spy)
    monkeypatch.setattr(ppo, "generate", generate_spy)
    args = ppo.Args(
        num_steps=2,
        prompts_per_step=2,
        group_size=2,
        eval_every=0,
        reward_model=str(reward_model_folder),
        output_dir=str(tmp_path),
        run_name="rm",
    )
    ppo.main(args)
    metrics = read_metrics(tmp_path / "rm")
    assert len(metrics) == 2 and "reward/model" in metrics[0] and "reward/correct" in metrics[0]

    rm = AutoModelForSequenceClassification.from_pretrained(reward_model_folder).eval()
    tokenizer = load_tokenizer(reward_model_folder)
    from common import prompt_batch
    from harness import builtin_splits

    train_set, _ = builtin_splits()
    for step, ((scores, truncated), completions) in enumerate(zip(seen, texts)):
        batch = prompt_batch(train_set, step, 2, 0, 1, args.seed)
        prompts = [e["prompt"] for e in batch for _ in range(2)]
        expected = []
        for prompt, completion, cut in zip(prompts, completions, truncated.tolist()):
            text = format_prompt(tokenizer, prompt, True) + completion + ("" if cut else tokenizer.eos_token)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                expected.append(rm(input_ids=ids).logits[0, 0].item())
        torch.testing.assert_close(scores.cpu(), torch.tensor(expected), atol=1e-5, rtol=1e-5)
        assert metrics[step]["reward/model"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)


def test_a_critic_that_does_not_share_the_tokenizer_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path / "other"
    vocab = {"<s>": 0, "</s>": 1, "a": 2}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="a",
    )
    LlamaForCausalLM(
        LlamaConfig(vocab_size=3, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with pytest.raises(UsageError, match="--critic-model .*its tokenizer differs from --model's"):
        ppo.main(ppo.Args(num_steps=1, critic_model=str(folder), output_dir=str(tmp_path), run_name="bad"))
    assert not (tmp_path / "bad").exists()


def test_chat_prompts_with_a_reward_model_without_a_chat_template_stop(tmp_path, reward_model_folder):
    """The reward model reads prompt + completion through its own tokenizer's chat template: prompts given as chat
    messages need one, as the policy's do (else `format_prompt` would add text to a list at the first step)."""
    import json
    import shutil

    from harness import load_tokenizer

    folder = tmp_path / "rm"
    shutil.copytree(reward_model_folder, folder)
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = None
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    row = {"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}
    (tmp_path / "chat.jsonl").write_text((json.dumps(row) + "\n") * 8)
    with pytest.raises(UsageError, match="--reward-model .*: its tokenizer has no chat template for the prompts' chat"):
        ppo.main(
            ppo.Args(
                num_steps=1,
                dataset=str(tmp_path / "chat.jsonl"),
                eval_size=2,
                reward_model=str(folder),
                output_dir=str(tmp_path / "runs"),
                run_name="bad",
            )
        )
    assert not (tmp_path / "runs").exists()
