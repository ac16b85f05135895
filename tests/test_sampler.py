"""The sampler draws from softmax(logits / T) of the policy, the distribution every loss here assumes,
whatever a checkpoint's generation_config.json holds; the trainer's log-probs reproduce that
distribution (soft-capped and scaled logits, dropout off in every form); every file logs the gap.

The sampler's distribution is measured independently of common.py's record of it: from transformers'
own record of the logits the model gave (`output_logits`, before any logits processor) and of the scores
its greedy step took the tokens from (`output_scores`, after every processor: one-hot at the token
`Sampler` drew, when nothing ran after it); `Sampler`'s draw itself is checked against softmax by counting."""

import json
import math
import shutil

import pytest
import torch

from common import UsageError, format_prompt, generate, get_logprobs, sampler_logprob_gap
from conftest import ALGORITHMS, read_metrics
from harness import DEFAULT_MODEL, load_model, load_tokenizer

PROMPTS = ("1+2", "45+67", "99+9", "3+30")
CPU = torch.device("cpu")

# Every field transformers would otherwise merge from the checkpoint into sampling, set to change it.
HOSTILE_GENERATION_CONFIG = {
    "repetition_penalty": 1.1,
    "min_p": 0.1,
    "no_repeat_ngram_size": 2,
    "min_new_tokens": 3,
    "top_k": 20,
    "top_p": 0.8,
    "temperature": 0.7,
    "do_sample": False,
}


def generate_with_sampler_scores(model, tokenizer, prompts, group_size, max_new_tokens, temperature):
    """common.generate, plus log p(token) under softmax(logits / T) of the logits transformers recorded: (rollout,
    (B, L)). Checks that the step took each token from scores that allow only that token, so that nothing
    after the sampler changed the draw."""
    real, seen = model.generate, {}

    def generate_recording(*args, **kwargs):
        out = real(*args, **kwargs, output_logits=True, output_scores=True, return_dict_in_generate=True)
        seen.update(logits=out.logits, scores=out.scores)
        return out.sequences

    model.generate = generate_recording
    try:
        rollout = generate(model, tokenizer, prompts, group_size, max_new_tokens, temperature)
    finally:
        del model.generate
    L = rollout.response_mask.shape[1]
    response = rollout.input_ids[:, rollout.prompt_length :]
    mask = rollout.response_mask.bool()
    scores = torch.stack(seen["scores"][:L], 1)  # (B, L, V): small models only
    one_hot = (scores.argmax(-1) == response) & (torch.isinf(scores).sum(-1) == scores.shape[-1] - 1)
    assert one_hot[mask].all()
    logits = torch.stack(seen["logits"][:L], 1).float() / temperature
    sampled = logits.log_softmax(-1).gather(-1, response[..., None]).squeeze(-1)
    return rollout, torch.where(mask, sampled, 0.0)


def check_sampler_matches_trainer(model, tokenizer, temperature: float):
    """The sampler's log-prob of every sampled token equals the trainer's (1e-4) and what generate records (1e-5)."""
    torch.manual_seed(0)
    prompts = [format_prompt(tokenizer, p, True) for p in PROMPTS]
    rollout, sampler = generate_with_sampler_scores(model, tokenizer, prompts, 8, 8, temperature)
    trainer, _ = get_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, temperature)
    mask = rollout.response_mask.bool()
    gap = (sampler - trainer)[mask].abs()
    assert gap.max() <= 1e-4, f"max {gap.max():.4g}, mean {gap.mean():.4g}"
    recorded = (rollout.sampler_logprobs - sampler)[mask].abs()
    assert recorded.max() <= 1e-5, recorded.max()
    return rollout


def test_the_sampler_draws_from_the_softmax_of_the_scores_over_the_temperature():
    """400,000 draws at once from logits whose softmax at T = 0.5 is (0.64, 0.24, 0.087, 0.032, 0.012, 0):
    each token's count is within 5 standard deviations of 400,000 p, the -inf token is never drawn, and
    the recorded log-prob is log p of the drawn token. A draw from the logits without the temperature,
    (0.43, 0.26, 0.16, 0.096, 0.058), is 100+ standard deviations off."""
    from common import Sampler

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -math.inf])
    probs = (logits / 0.5).softmax(-1)
    torch.manual_seed(0)
    sampler, n = Sampler(0.5), 400_000
    scores = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1).clone())
    tokens = scores.argmax(-1)
    assert (scores.gather(-1, tokens[:, None]) == 0).all() and (torch.isinf(scores).sum(-1) == 5).all()
    counts = torch.bincount(tokens, minlength=6).double()
    sd = (n * probs * (1 - probs)).sqrt().clamp(min=1e-9)
    assert ((counts - n * probs).abs() <= 5 * sd).all(), (counts / n, probs)
    assert counts[5] == 0
    torch.testing.assert_close(sampler.logprobs[0], probs.log()[tokens].float())


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    """The default model, with a generation_config.json that sets every sampling field to change sampling."""
    return default_model_with(tmp_path_factory.mktemp("hostile"), "generation_config.json", HOSTILE_GENERATION_CONFIG)


def default_model_with(parent, file: str, changes: dict):
    """A copy of the default model in `parent`, its JSON `file` updated with `changes`."""
    folder = parent / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / file).write_text(json.dumps({**json.loads((folder / file).read_text()), **changes}))
    return folder


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_a_checkpoint_generation_config_does_not_change_the_sampled_distribution(hostile_model, temperature):
    """transformers would merge a checkpoint's repetition_penalty, min_p, no_repeat_ngram_size and
    min_new_tokens into sampling (a max gap of ~8 nats at T = 1); the sampled distribution must stay
    softmax(logits / T), with a gap of ~3e-6 as for a neutral config."""
    tokenizer = load_tokenizer(str(hostile_model))
    model = load_model(str(hostile_model), "float32", CPU, tokenizer)
    rollout = check_sampler_matches_trainer(model, tokenizer, temperature)
    assert len(set(rollout.texts)) > len(PROMPTS)  # sampled, although the checkpoint says do_sample false
    assert model.generation_config.repetition_penalty == 1.1  # the checkpoint's own config, kept for saving


def test_greedy_ignores_the_checkpoint_generation_config_too(hostile_model):
    plain_tokenizer = load_tokenizer(DEFAULT_MODEL)
    plain = load_model(DEFAULT_MODEL, "float32", CPU, plain_tokenizer)
    tokenizer = load_tokenizer(str(hostile_model))
    model = load_model(str(hostile_model), "float32", CPU, tokenizer)
    prompts = [format_prompt(tokenizer, p, True) for p in PROMPTS]
    expected = generate(plain, plain_tokenizer, prompts, 1, 8, 1.0, greedy=True)
    got = generate(model, tokenizer, prompts, 1, 8, 1.0, greedy=True)
    assert got.texts == expected.texts
    assert (got.sampler_logprobs == 0).all()  # greedy: each token had probability 1


def random_model(folder, architecture: str, tokenizer):
    """A tiny random model whose forward transforms the LM head's logits, with logits spread wide enough
    for the transform to matter (the LM head scaled up)."""
    import transformers

    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    own = {
        "Gemma2": dict(head_dim=32, final_logit_softcapping=30.0),
        "Cohere": dict(logit_scale=0.0625),
        "Granite": dict(logits_scaling=8.0),
    }[architecture]
    config = getattr(transformers, f"{architecture}Config")(**shape, **own)
    torch.manual_seed(0)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    with torch.no_grad():
        model.lm_head.weight.mul_({"Gemma2": 300.0, "Cohere": 3000.0, "Granite": 1000.0}[architecture])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("architecture", ["Gemma2", "Cohere", "Granite"])
def test_transformed_logits_are_scored_as_sampled(tmp_path, architecture):
    """Gemma2 soft-caps its logits (cap * tanh(z / cap)) before the sampler divides by T, Cohere multiplies
    them by logit_scale, Granite divides them by logits_scaling: the trainer's log-probs must apply each
    transform before the temperature, as the sampler does (the cap applied after it: a gap of ~2.3 nats)."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    folder = random_model(tmp_path / architecture, architecture, tokenizer)
    model = load_model(folder, "float32", CPU, load_tokenizer(folder))
    check_sampler_matches_trainer(model, load_tokenizer(folder), 0.7)


def test_an_unknown_logit_transform_stops_at_load(tmp_path, monkeypatch):
    """A forward that changes the LM head's logits in a way get_logprobs does not reproduce would train on
    another distribution than the one sampled: load_model refuses it, naming the flag."""
    import transformers

    real = transformers.Qwen3ForCausalLM.forward

    def doubled(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "forward", doubled)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    with pytest.raises(UsageError, match=r"--model .*its forward changes the LM head's logits"):
        load_model(DEFAULT_MODEL, "float32", CPU, tokenizer)


@pytest.fixture(scope="module")
def attention_dropout_model(tmp_path_factory):
    """The default model with attention_dropout 0.1 in its config (applied functionally in train mode)."""
    return default_model_with(tmp_path_factory.mktemp("dropout"), "config.json", {"attention_dropout": 0.1})


def falcon_with_attention_dropout(folder) -> str:
    """A tiny random Falcon with attention and hidden dropout 0.1: it reads hidden_dropout from the config
    at every forward (Qwen3 copies attention_dropout into the module at init)."""
    from transformers import FalconConfig, FalconForCausalLM

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    config = FalconConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_dropout=0.1,
        hidden_dropout=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    FalconForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("architecture", ["Qwen3", "Falcon"])
def test_attention_dropout_is_off_in_train_mode(tmp_path, attention_dropout_model, architecture):
    """--gradient-checkpointing puts the policy in train mode, where dropout rates from the config are applied
    functionally (no nn.Dropout module to switch off): it must be zeroed there too, or two passes over the
    same batch differ (by up to ~7 nats at Qwen3's attention_dropout 0.1)."""
    folder = str(attention_dropout_model) if architecture == "Qwen3" else falcon_with_attention_dropout(tmp_path)
    tokenizer = load_tokenizer(folder)
    model = load_model(folder, "float32", CPU, tokenizer)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.train()
    torch.manual_seed(0)
    r = generate(model, tokenizer, [format_prompt(tokenizer, p, True) for p in PROMPTS], 4, 8, 1.0)
    first, _ = get_logprobs(model, r.input_ids, r.attention_mask, r.prompt_length, 1.0)
    second, _ = get_logprobs(model, r.input_ids, r.attention_mask, r.prompt_length, 1.0)
    assert torch.equal(first, second), (first - second).abs().max()


def test_attention_dropout_does_not_change_the_update(tmp_path, mixed_dataset, attention_dropout_model):
    """One rollout step with --gradient-checkpointing (train mode) equals the step without it. Micro-batches
    of one row: each row runs whole with and without checkpointing (where transformers drops the KV cache,
    and so the prompt a micro-batch's rows share, common.response_hidden_states), so the two do the same
    sums."""
    from test_runs import max_relative_difference, one_step

    model = ["--model", str(attention_dropout_model), "--micro-batch-size", "1"]
    base, base_m = one_step(tmp_path, "grpo", "plain", mixed_dataset, model)
    new, m = one_step(tmp_path, "grpo", "ckpt", mixed_dataset, [*model, "--gradient-checkpointing"])
    assert max_relative_difference(base, new) <= 1e-6
    assert m["policy/grad_norm"] == pytest.approx(base_m["policy/grad_norm"], rel=1e-6)


def test_gap_metric_is_a_mean_and_a_max_over_response_tokens():
    sampler = torch.tensor([[-1.0, -2.0, -5.0], [-0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-1.1, -2.0, 9.0], [-0.2, 7.0, 0.0]])  # 9.0 and 7.0 sit outside the mask
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    gap = sampler_logprob_gap(sampler, trainer, mask)
    assert gap["policy/sampler_logprob_gap"] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert gap["policy/sampler_logprob_gap_max"] == pytest.approx(0.3)


# Every file's CLI run logs the sampler gap at float rounding: test_runs.test_learns_the_default_task checks it
# on each file's learning run.


@pytest.mark.parametrize(
    "algo, flags, policy_passes",
    [
        ("grpo", [], 0),
        ("grpo", ["--num-minibatches", "2"], 1),  # the second optimizer step of a pass runs on updated weights
        *[
            pytest.param(
                algo, [], 1 if algo == "ppo" else 0, marks=pytest.mark.slow
            )  # PPO's KL reward needs them first
            for algo in ALGORITHMS
            if algo != "grpo"
        ],
        pytest.param("ppo", ["--beta", "0"], 0, marks=pytest.mark.slow),
        pytest.param("rloo", ["--beta", "0.05"], 1, marks=pytest.mark.slow),  # RLOO's too, with one (default beta 0)
    ],
)
def test_the_first_pass_gives_the_old_logprobs(tmp_path, monkeypatch, algo, flags, policy_passes):
    """With one optimizer step per pass, the first pass runs on the sampling weights, so its forward gives the
    old log-probs and no no-grad pass of the policy is needed. The logged sampler gap is computed from them:
    a wrong or missing one (zeros) would put it at the log-probs' size, ~1, not ~1e-6."""
    import importlib

    from harness import cli

    module, calls = importlib.import_module(algo), []
    real = module.rollout_logprobs

    def recording(model, *args, **kwargs):
        calls.append(any(p.requires_grad for p in model.parameters()))  # the policy; the reference model is frozen
        return real(model, *args, **kwargs)

    monkeypatch.setattr(module, "rollout_logprobs", recording)
    module.main(
        cli(
            module.Args,
            args=[
                "--num-steps",
                "2",
                "--prompts-per-step",
                "4",
                "--group-size",
                "4",
                "--eval-every",
                "0",
                "--output-dir",
                str(tmp_path),
                "--run-name",
                "r",
                *flags,
            ],
        )
    )
    assert sum(calls) == 2 * policy_passes, calls  # over the 2 steps
    for m in read_metrics(tmp_path / "r"):
        assert m["policy/sampler_logprob_gap_max"] <= 1e-4, m
