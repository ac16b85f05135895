"""Off-policy by design: with --off-policy-steps K the rollout of step t is sampled by the policy's weights after step
t-K (the initial weights for t <= K), as an asynchronous trainer's sampler lags K optimizer steps behind; with
--anchor behaviour the loss's pi_old is the sampler's log-probs, with no pass that recomputes them. K = 0 keeps
nothing and changes nothing. (The vLLM engine's version of the first check is in test_vllm.py; a resume in
test_resume.py; 2 ranks in test_runs.py.)"""

import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
import harness
from common import Rollout, SamplerWeights, get_logprobs
from conftest import read_metrics
from harness import DEFAULT_MODEL, cli, load_model, load_tokenizer

K = 2
# Five steps of grpo.py, each saving the weights after it (step_<n>/): rollouts sampled 0, 1, 2, 2 and 2 steps behind
RUN = [
    "--num-steps",
    "5",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--eval-every",
    "0",
    "--save-every",
    "1",
    "--off-policy-steps",
    str(K),
]
TOLERANCE = 1e-5  # model.generate's log-probs against a forward of the same weights, both float32 (measured: ~2e-7)


def training_rollouts(module, monkeypatch) -> list[Rollout]:
    """Each training rollout the file samples (an evaluation samples one completion a prompt, training a group)."""
    rollouts, real_generate = [], module.generate

    def recording(model, tokenizer, prompts, group_size, *args, **kwargs):
        rollout = real_generate(model, tokenizer, prompts, group_size, *args, **kwargs)
        if group_size > 1:
            rollouts.append(rollout)
        return rollout

    monkeypatch.setattr(module, "generate", recording)
    return rollouts


def largest_gap(weights: Path | str, rollout) -> float:
    """max |log-prob under `weights` (a checkpoint folder) - the sampler's| over the rollout's response tokens."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(str(weights), "float32", torch.device("cpu"), tokenizer)
    ids, mask, P = rollout["input_ids"], rollout["attention_mask"], int(rollout["prompt_length"])
    logprobs = get_logprobs(model, ids, mask, P, 1.0, entropy=False)[0]
    return ((logprobs - rollout["sampler_logprobs"]).abs() * rollout["response_mask"]).max().item()


def check_sampled_k_steps_behind(run_dir: Path, rollouts: list[dict], tolerance: float) -> None:
    """Step t's rollout has the log-probs of the weights after step max(t - K, 0) (step_<n>/; step 0: the initial
    model), and not those of the policy at step t (after step t) where the two differ."""
    assert len(rollouts) == 5
    for t, rollout in enumerate(rollouts):
        due = max(t - K, 0)
        assert largest_gap(run_dir / f"step_{due}" if due else DEFAULT_MODEL, rollout) <= tolerance, t
        if t > 0:  # the policy at step t samples otherwise: the check can tell
            assert largest_gap(run_dir / f"step_{t}", rollout) > 100 * tolerance, t
    steps = [m for m in read_metrics(run_dir) if m["step"] < len(rollouts)]  # not the final evaluation's line
    assert [m["policy/off_policy_steps"] for m in steps] == [0, 1, 2, 2, 2]


@pytest.fixture(scope="module")
def behind_run(tmp_path_factory):
    """RUN, evaluating before steps 0, 2 and 4 and after the last, under --anchor behaviour (which weights sample does
    not depend on the anchor; behaviour's staleness metrics do need checking): (its folder, its training rollouts,
    the weights each evaluation saw)."""
    tmp_path, evaluated = tmp_path_factory.mktemp("behind"), []
    with pytest.MonkeyPatch.context() as monkeypatch:
        rollouts, real_evaluate = training_rollouts(grpo, monkeypatch), grpo.evaluate

        def evaluate(model, *args, **kwargs):
            evaluated.append(model.get_input_embeddings().weight.detach().clone())
            return real_evaluate(model, *args, **kwargs)

        monkeypatch.setattr(grpo, "evaluate", evaluate)
        flags = [*RUN, "--eval-every", "2", "--eval-size", "8", "--anchor", "behaviour", "--beta", "0"]
        grpo.main(cli(grpo.Args, args=[*flags, "--output-dir", str(tmp_path), "--run-name", "r"]))
    return tmp_path / "r", rollouts, evaluated


def test_the_rollout_of_step_t_is_sampled_by_the_weights_after_step_t_minus_k(behind_run):
    """And each evaluation (before steps 0, 2 and 4, and after the last) uses the policy as it is then."""
    run_dir, rollouts, evaluated = behind_run
    check_sampled_k_steps_behind(run_dir, [vars(r) for r in rollouts], TOLERANCE)
    for step, weights in zip([0, 2, 4, 5], evaluated, strict=True):  # the weights after `step` steps
        folder = run_dir / f"step_{step}" if step else Path(DEFAULT_MODEL)
        assert torch.equal(weights, load_file(folder / "model.safetensors")["model.embed_tokens.weight"]), step


def test_under_behaviour_the_gap_measures_the_staleness(behind_run):
    """With --anchor behaviour pi_old is the sampler's, so a gap against pi_old would be 0 however stale the rollout:
    the gap logged is the policy's at the update's start (pass 1's log-probs) against the sampler's, the largest
    as a forward of step_<t>'s weights gives it (test_behaviour_runs_no_old_log_prob_pass_and_its_ratio_is_over_the_
    sampler: none logged where no pass gives those log-probs)."""
    run_dir, rollouts, _ = behind_run
    steps = [m for m in read_metrics(run_dir) if "policy/sampler_logprob_gap_max" in m]
    assert [m["step"] for m in steps] == [0, 1, 2, 3, 4]
    for t, (m, rollout) in enumerate(zip(steps, rollouts, strict=True)):
        weights = run_dir / f"step_{t}" if t else DEFAULT_MODEL  # the policy at step t's start
        assert m["policy/sampler_logprob_gap_max"] == pytest.approx(largest_gap(weights, vars(rollout)), abs=1e-5), t
        assert (m["policy/sampler_logprob_gap_max"] > 100 * TOLERANCE) == (t > 0), t  # sampled by other weights
        assert (m["policy/sampler_ratio_ess"] < 1 - 1e-6) == (t > 0), t


@pytest.mark.parametrize("algo", ["gvpo", "ppo", "rloo"])
def test_every_file_measures_the_staleness_under_behaviour(tmp_path, algo):
    """The files whose lines here are their own (the others share grpo.py's, which test_files.py keeps identical):
    gvpo logs the gap on its fresh rows; ppo and rloo, whose KL reward needs pi_old before the update, take it from
    the sampler under behaviour, so pass 1 still gives the policy's log-probs. Step 1, sampled 1 step behind: a gap,
    an ESS < 1."""
    module = importlib.import_module(algo)
    flags = [*RUN, "--num-steps", "2", "--save-every", "0", "--off-policy-steps", "1", "--anchor", "behaviour"]
    flags += ["--beta", "0.05"] if algo == "rloo" else []  # with a reference model, as ppo.py's default
    module.main(cli(module.Args, args=[*flags, "--output-dir", str(tmp_path), "--run-name", "r"]))
    step_1 = next(m for m in read_metrics(tmp_path / "r") if m["step"] == 1)
    assert step_1["policy/sampler_logprob_gap_max"] > 100 * TOLERANCE and step_1["policy/sampler_ratio_ess"] < 1 - 1e-6


def test_a_resume_keeps_the_versions_on_the_host(behind_run, monkeypatch):
    """A checkpoint's K versions come back to the host, not to the GPU the algorithm's other state goes to: K copies
    of the trained weights there at once would not fit beside the model (here the GPU is the meta device)."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    policy = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    optimizer = torch.optim.AdamW(policy.parameters())
    monkeypatch.setattr(harness, "current_device", lambda: torch.device("meta"))
    step, state = harness.load_checkpoint(behind_run[0] / "step_3", {"policy": policy}, optimizer, 0)
    assert step == 3 and len(state["sampler_weights"]) == K
    assert {t.device.type for version in state["sampler_weights"] for t in version} == {"cpu"}
    names = [name for name, p in policy.named_parameters() if p.requires_grad]
    for version, after in zip(state["sampler_weights"], [1, 2], strict=True):  # steps 3 and 4 sample with these
        saved = load_file(behind_run[0] / f"step_{after}" / "model.safetensors")
        assert all(torch.equal(t, saved[name]) for name, t in zip(names, version, strict=True)), after


def test_k_0_keeps_nothing_and_leaves_the_weights_alone(monkeypatch):
    """The default: no copy of the weights, nothing in the checkpoint's state, the policy samples as it is."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    state = {}
    weights = SamplerWeights(model, 0, state)
    monkeypatch.setattr(SamplerWeights, "load", lambda *_: pytest.fail("K = 0 put other weights into the policy"))
    monkeypatch.setattr(torch.Tensor, "to", lambda *_, **__: pytest.fail("K = 0 copied a weight"))
    for step in range(3):
        with weights.behind(step):
            pass
    assert state == {} and weights.versions == [] and weights.steps_behind == 0


def test_the_versions_kept_are_the_latest_k_and_the_policy_gets_its_own_back():
    """The bookkeeping, on a one-weight model whose version is its value: step t samples with version max(t - K, 0),
    the policy holds version t again after the block, and between steps the K latest are kept (checkpoints hold
    them); resumed with a smaller K, the newest are kept."""
    model = torch.nn.Linear(1, 1, bias=False)
    state = {}
    weights = SamplerWeights(model, K, state)
    for step in range(5):
        model.weight.data.fill_(step)  # the weights after step t - 1: version t
        with weights.behind(step):
            assert model.weight.item() == max(step - K, 0)
        assert model.weight.item() == step and weights.steps_behind == min(step, K)
        assert [v[0].item() for v in state["sampler_weights"]] == list(range(max(step - K + 1, 0), step + 1))
    fewer = SamplerWeights(model, 1, state)  # resumed with K = 1: versions 3 and 4 kept; step 5 samples with 4
    model.weight.data.fill_(5)
    with fewer.behind(5):
        assert model.weight.item() == 4
    assert [v[0].item() for v in state["sampler_weights"]] == [5]


def test_behaviour_runs_no_old_log_prob_pass_and_its_ratio_is_over_the_sampler(tmp_path, monkeypatch):
    """--anchor behaviour, K steps behind: pi_old is the sampler's log-probs, row for row, and no forward recomputes
    them (with 2 minibatches, where recompute needs a pass before the update); --anchor recompute runs that pass, and
    after step 0 its pi_old is the policy's, not the stale sampler's, so the check can tell."""
    calls, real_loss, real_pass = {}, grpo.compute_loss, common.rollout_logprobs
    for anchor in ("behaviour", "recompute"):
        rollouts = training_rollouts(grpo, monkeypatch)
        passes, olds = [], []

        def compute_loss(logprobs, old_logprobs, *args, **kwargs):
            olds.append((len(rollouts) - 1, old_logprobs.clone()))
            return real_loss(logprobs, old_logprobs, *args, **kwargs)

        def rollout_logprobs(model, *args, **kwargs):
            passes.append(model)
            return real_pass(model, *args, **kwargs)

        monkeypatch.setattr(grpo, "compute_loss", compute_loss)
        monkeypatch.setattr(grpo, "rollout_logprobs", rollout_logprobs)
        flags = [
            *RUN,
            "--num-steps",
            "3",
            "--save-every",
            "0",
            "--num-minibatches",
            "2",
            "--beta",
            "0",
            "--anchor",
            anchor,
        ]
        grpo.main(cli(grpo.Args, args=[*flags, "--output-dir", str(tmp_path), "--run-name", anchor]))
        rows = [(t, row) for t, old in olds for row in old if t > 0]  # steps 1 and 2, sampled 1 and 2 steps behind
        sampled = [{tuple(row.tolist()) for row in r.sampler_logprobs} for r in rollouts]
        calls[anchor] = (len(passes), sum(tuple(row.tolist()) in sampled[t] for t, row in rows), len(rows))
        logged = [m for m in read_metrics(tmp_path / anchor) if "step" in m and m["step"] < 3]
        calls[anchor] += ({"policy/sampler_logprob_gap" in m for m in logged},)
    # 2 steps x 2 passes x 16 rows, each the sampler's; and no gap logged: no pass gave the policy's log-probs
    assert calls["behaviour"] == (0, 2 * 2 * 16, 2 * 2 * 16, {False})
    assert calls["recompute"][0] == 3 and calls["recompute"][1] == 0  # a pass a step; no row the sampler's
    assert calls["recompute"][3] == {True}
