"""Resume after a crash, for every algorithm file: a run killed with SIGKILL mid-training and resumed
with --resume latest ends with the same weights and metrics, bitwise, as the run that was never
stopped; a half-written checkpoint is never picked up; a bad --resume stops at start-up."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import grpo
from conftest import ALGORITHMS, ROOT, read_metrics, run

# Each file's own resumable state is exercised: DAPO's draw counter, GVPO's replayed groups, PPO's
# critic and adaptive beta.
EXTRA = {"gvpo": ["--reuse-steps", "1"], "ppo": ["--target-kl", "0.01"]}


def args_for(algo: str, tmp_path, name: str) -> list[str]:
    return [f"{algo}.py", "--num-steps", "8", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "3",
            "--eval-size", "16", "--save-every", "2", "--output-dir", str(tmp_path), "--run-name", name,
            *EXTRA.get(algo, [])]


def without_timings(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_killed_and_resumed_run_matches_the_uninterrupted_run(tmp_path, algo):
    result = run(args_for(algo, tmp_path, "whole"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    # The same run, killed with SIGKILL once it has logged step 3 (a checkpoint exists, training is under way).
    args = args_for(algo, tmp_path, "killed")
    proc = subprocess.Popen([sys.executable, str(ROOT / args[0]), *args[1:]], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics_file, deadline = tmp_path / "killed" / "metrics.jsonl", time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if metrics_file.exists() and any(json.loads(line)["step"] >= 3 for line in metrics_file.read_text().split("\n")
                                         if line.endswith("}")):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "final").exists()
    # A crash in the middle of a save leaves only a .tmp folder: it must never be resumed from.
    (tmp_path / "killed" / "step_8.tmp").mkdir()
    (tmp_path / "killed" / "step_8.tmp" / "training_state.pt").write_bytes(b"half-written")

    result = run([*args, "--resume", "latest"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    whole, resumed = load_file(tmp_path / "whole" / "final" / "model.safetensors"), \
        load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)  # bitwise
    assert without_timings(read_metrics(tmp_path / "killed")) == without_timings(read_metrics(tmp_path / "whole"))


def test_resume_on_another_number_of_ranks_is_refused(tmp_path):
    args = ["grpo.py", "--num-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
            "--save-every", "2", "--output-dir", str(tmp_path), "--run-name", "one"]
    assert run(args, cwd=tmp_path).returncode == 0
    result = run([*args, "--resume", "latest"], cwd=tmp_path, torchrun=2)
    assert result.returncode != 0
    assert "written by 1 rank(s), resumed on 2. Resume with --nproc_per_node=1" in result.stderr


@pytest.mark.parametrize("resume, message", [
    ("latest", "--resume latest: no checkpoint under"),
    ("nowhere/step_4", "--resume nowhere/step_4: not a resumable checkpoint"),
])
def test_bad_resume_stops_before_any_work(tmp_path, resume, message):
    args = grpo.Args(num_steps=1, prompts_per_step=4, group_size=4, eval_every=0, output_dir=str(tmp_path / "runs"),
                     run_name="bad", resume=resume)
    with pytest.raises(SystemExit, match=message):
        grpo.main(args)
    assert not (tmp_path / "runs").exists()


def test_a_new_run_never_appends_to_another_runs_folder(tmp_path):
    """The same --run-name again without --resume stops at start-up; the first run's metrics stay as they were."""
    args = grpo.Args(num_steps=1, prompts_per_step=4, group_size=4, eval_every=0, output_dir=str(tmp_path),
                     run_name="same")
    grpo.main(args)
    metrics = (tmp_path / "same" / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="--run-name same: .* already holds a run. Continue it with --resume latest"):
        grpo.main(args)
    assert (tmp_path / "same" / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_rank_run_resumed_from_a_checkpoint_matches(tmp_path, mode):
    """On 2 ranks each rank restores its own RNG state (its own sampling stream), and under FSDP its
    shards of the gathered weights and optimizer state: a copy of a finished run, cut back to its
    step-4 checkpoint and resumed, ends where the original ended, bitwise."""
    import shutil

    args = ["grpo.py", "--num-steps", "6", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "3",
            "--eval-size", "16", "--save-every", "2", "--output-dir", str(tmp_path)]
    args += ["--fsdp"] if mode == "fsdp" else []
    assert run([*args, "--run-name", "whole"], cwd=tmp_path, torchrun=2).returncode == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for name in ["final", "step_6"]:
        shutil.rmtree(tmp_path / "cut" / name)
    assert {p.name for p in (tmp_path / "cut" / "step_4").glob("rank_*.pt")} == {"rank_0.pt", "rank_1.pt"}
    result = run([*args, "--run-name", "cut", "--resume", "latest"], cwd=tmp_path, torchrun=2)
    assert result.returncode == 0, result.stderr
    whole, resumed = load_file(tmp_path / "whole" / "final" / "model.safetensors"), \
        load_file(tmp_path / "cut" / "final" / "model.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "whole"))
