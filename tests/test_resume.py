"""Resume after a crash, for every algorithm file: a run killed with SIGKILL in the middle of a save and
resumed with --resume latest ends with the same weights and metrics, bitwise, as the run that was never
stopped; a half-written checkpoint is never picked up; a bad --resume stops at start-up. And the run
folder: claimed by one run at a time, never deleted from; resuming an earlier checkpoint starts a new one."""

import errno
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo
import harness
from common import UsageError
from conftest import ALGORITHMS, ROOT, default_sigint, read_metrics, run

pytestmark = pytest.mark.slow  # kill-and-resume runs in subprocesses: `-m 'not slow'` skips them

# Each file's own resumable state is exercised: DAPO's draw counter, GVPO's replayed groups (with their
# rollout-correction weights; episodes of --task guess, so their masks with holes, returns and turns too, in a game
# whose rewards draw from `random` and NumPy: their seeds and states; its beta adapted by --target-kl, doubled at
# every step by so small a target), PPO's critic and adaptive beta.
EXTRA = {
    "gvpo": [
        "--reuse-steps",
        "1",
        "--rollout-correction",
        "tis",
        "--task",
        "guess",
        "--target-kl",
        "1e-6",
        "--env",
        f"{ROOT / 'tests' / 'random_guess.py'}:RandomGuess",
    ],
    "ppo": ["--target-kl", "0.01"],
}

# Loaded before the run's own imports (Python imports `sitecustomize` at start-up): the second call of
# safetensors' save_file (HANG_IN=save: the second checkpoint's exported weights) or of `common.evaluate`
# (HANG_IN=evaluate) announces itself and hangs, so that the test can stop the run there.
HANG_ON_SECOND_CALL = """
import os, pathlib, time
import common, safetensors.torch
owner, name = {"evaluate": (common, "evaluate"), "save": (safetensors.torch, "save_file")}[os.environ["HANG_IN"]]
real, calls = getattr(owner, name), []
def hang_on_second_call(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        pathlib.Path(os.environ["HANG_STARTED"]).touch()
        time.sleep(600)
    return real(*args, **kwargs)
setattr(owner, name, hang_on_second_call)
"""


def stopped_in_second_call(args: list[str], tmp_path: Path, hang_in: str, stop: int) -> tuple[int, str]:
    """Run `args` as a user starts it, with HANG_ON_SECOND_CALL, and send it `stop` where it hangs: (its exit
    code, its standard error)."""
    hook, started = tmp_path / "hook", tmp_path / "hang-started"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG_ON_SECOND_CALL)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / args[0]), *args[1:]],
        cwd=tmp_path,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "HANG_IN": hang_in, "HANG_STARTED": str(started)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=default_sigint,
    )
    deadline = time.time() + 300
    while proc.poll() is None and not started.exists() and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(stop)
    stderr = proc.communicate()[1]
    return proc.returncode, stderr


def args_for(algo: str, tmp_path, name: str) -> list[str]:
    return [
        f"{algo}.py",
        "--num-steps",
        "8",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "3",
        "--eval-size",
        "16",
        "--save-every",
        "2",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        *EXTRA.get(algo, []),
    ]


def without_timings(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


def small_run(tmp_path, name: str, **overrides) -> grpo.Args:
    settings = dict(
        num_steps=6,
        prompts_per_step=4,
        group_size=4,
        eval_every=0,
        save_every=2,
        output_dir=str(tmp_path),
        run_name=name,
    )
    return grpo.Args(**{**settings, **overrides})


def main_in_process(args: list[str]) -> None:
    """`python <file>.py args...` run in this process: the same `main`, without a Python start-up and imports
    (~8 s of each run here). Bitwise the same as the subprocess: one thread in both (tests/conftest.py)."""
    import importlib

    module = importlib.import_module(args[0].removesuffix(".py"))
    module.main(harness.cli(module.Args, args=args[1:]))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_killed_and_resumed_run_matches_the_uninterrupted_run(tmp_path, algo):
    main_in_process(args_for(algo, tmp_path, "whole"))

    # The same run as a user starts it, killed with SIGKILL while it writes its step-4 checkpoint.
    args = args_for(algo, tmp_path, "killed")
    code, _ = stopped_in_second_call(args, tmp_path, "save", signal.SIGKILL)
    assert code == -signal.SIGKILL, "the run ended before it could be killed"
    assert (tmp_path / "killed" / "step_4.tmp").is_dir() and not (tmp_path / "killed" / "step_4").exists()
    assert not (tmp_path / "killed" / "final").exists()
    # A crash in the middle of a save leaves only a .tmp folder: it must never be resumed from.
    (tmp_path / "killed" / "step_8.tmp").mkdir()
    (tmp_path / "killed" / "step_8.tmp" / "training_state.pt").write_bytes(b"half-written")

    main_in_process([*args, "--resume", "latest"])
    whole, resumed = (
        load_file(tmp_path / "whole" / "final" / "model.safetensors"),
        load_file(tmp_path / "killed" / "final" / "model.safetensors"),
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)  # bitwise
    assert without_timings(read_metrics(tmp_path / "killed")) == without_timings(read_metrics(tmp_path / "whole"))


def test_resume_on_another_number_of_ranks_is_refused(tmp_path):
    args = [
        "grpo.py",
        "--num-steps",
        "1",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--save-every",
        "1",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "one",
    ]
    main_in_process(args)  # 1 rank
    result = run([*args, "--resume", "latest"], cwd=tmp_path, torchrun=2)
    assert result.returncode != 0
    assert "written by 1 rank(s), resumed on 2. Resume with --nproc_per_node=1" in result.stderr


@pytest.mark.parametrize(
    "resume, message",
    [
        ("latest", "--resume latest: no checkpoint under"),
        ("nowhere/step_4", "--resume nowhere/step_4: not a resumable checkpoint"),
    ],
)
def test_bad_resume_stops_before_any_work(tmp_path, resume, message):
    args = grpo.Args(
        num_steps=1,
        prompts_per_step=4,
        group_size=4,
        eval_every=0,
        output_dir=str(tmp_path / "runs"),
        run_name="bad",
        resume=resume,
    )
    with pytest.raises(UsageError, match=message):
        grpo.main(args)
    assert not (tmp_path / "runs").exists()


def test_a_new_run_never_appends_to_another_runs_folder(tmp_path):
    """The same --run-name again without --resume stops at start-up, naming --resume latest where there is a
    checkpoint to go on from; the first run's metrics stay as they were."""
    args = grpo.Args(
        num_steps=1, prompts_per_step=4, group_size=4, eval_every=0, output_dir=str(tmp_path), run_name="same"
    )
    grpo.main(args)
    metrics = (tmp_path / "same" / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match="--run-name same: .* already holds a run. Choose another --run-name"):
        grpo.main(args)  # finished, with final/ and no step checkpoint
    assert (tmp_path / "same" / "metrics.jsonl").read_text() == metrics
    args = grpo.Args(**{**vars(args), "run_name": "saved", "save_every": 1})
    grpo.main(args)
    with pytest.raises(UsageError, match="--run-name saved: .* already holds a run. Continue it with --resume latest"):
        grpo.main(args)


# DDP on 2 ranks: test_a_run_on_two_nodes_trains_saves_and_resumes (grpo.py, one rank on each of two launchers)
@pytest.mark.parametrize("algo, mode", [("grpo", "fsdp"), ("ppo", "fsdp")])
def test_two_rank_run_resumed_from_a_checkpoint_matches(tmp_path, algo, mode):
    """On 2 ranks each rank restores its own RNG state (its own sampling stream), and under FSDP only
    its own shards of the weights and optimizer state (PPO: of the policy and the critic): a copy of a
    finished run, cut back to its step-4 checkpoint and resumed, ends where the original ended, bitwise."""
    import shutil

    args = [
        f"{algo}.py",
        "--num-steps",
        "6",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "3",
        "--eval-size",
        "16",
        "--save-every",
        "2",
        "--output-dir",
        str(tmp_path),
        *EXTRA.get(algo, []),
    ]
    args += ["--fsdp"] if mode == "fsdp" else []
    assert run([*args, "--run-name", "whole"], cwd=tmp_path, torchrun=2).returncode == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for name in ["final", "step_6"]:
        shutil.rmtree(tmp_path / "cut" / name)
    assert {p.name for p in (tmp_path / "cut" / "step_4").glob("rank_*")} == {f"rank_{r}.safetensors" for r in (0, 1)}
    result = run([*args, "--run-name", "cut", "--resume", "latest"], cwd=tmp_path, torchrun=2)
    assert result.returncode == 0, result.stderr
    whole, resumed = (
        load_file(tmp_path / "whole" / "final" / "model.safetensors"),
        load_file(tmp_path / "cut" / "final" / "model.safetensors"),
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "whole"))
    if mode == "fsdp":  # each rank wrote its own shards
        assert {p.name.split("-model-")[0] for p in (tmp_path / "cut" / "step_4" / "training_state").iterdir()} == {
            "shard-00001",
            "shard-00002",
        }


def test_an_off_policy_run_resumed_from_a_checkpoint_matches(tmp_path):
    """--off-policy-steps 2: a checkpoint carries the weights the next two steps sample with (step_4's: those after
    steps 2 and 3), so a copy of a finished run, cut back to step_4 and resumed, samples step 4 with the weights after
    step 2 as the run did, and ends where it ended, bitwise."""
    import shutil

    args = [*args_for("grpo", tmp_path, "whole"), "--off-policy-steps", "2"]
    main_in_process(args)
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for name in ["final", "step_6", "step_8"]:
        shutil.rmtree(tmp_path / "cut" / name)
    main_in_process([*args, "--run-name", "cut", "--resume", "latest"])
    whole, resumed = (
        load_file(tmp_path / "whole" / "final" / "model.safetensors"),
        load_file(tmp_path / "cut" / "final" / "model.safetensors"),
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "whole"))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def on_two_nodes(args: list[str], cwd) -> list[subprocess.CompletedProcess]:
    """`args` as on two machines: two torchrun launchers of one process each (--nnodes=2 --nproc_per_node=1)
    that find each other through a c10d rendezvous on localhost, as a multi-node job's do on its first node."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{free_port()}",
        "--rdzv-id=two-nodes",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [*launcher, str(ROOT / args[0]), *args[1:]],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    return [subprocess.CompletedProcess(proc.args, proc.wait(timeout=1800), *proc.communicate()) for proc in procs]


def test_a_run_on_two_nodes_trains_saves_and_resumes(tmp_path):
    """Two launchers (nodes) of one rank each: the run trains and checkpoints each rank's state, and a copy
    cut back to its step-2 checkpoint, resumed on two nodes, ends where the original ended, bitwise."""
    import shutil

    args = [
        "grpo.py",
        "--num-steps",
        "4",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "2",
        "--eval-size",
        "16",
        "--save-every",
        "2",
        "--output-dir",
        str(tmp_path),
    ]
    results = on_two_nodes([*args, "--run-name", "whole"], cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert {p.name for p in (tmp_path / "whole" / "step_2").glob("rank_*")} == {f"rank_{r}.safetensors" for r in (0, 1)}
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for name in ["final", "step_4"]:
        shutil.rmtree(tmp_path / "cut" / name)
    results = on_two_nodes([*args, "--run-name", "cut", "--resume", "latest"], cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    whole, resumed = (
        load_file(tmp_path / "whole" / "final" / "model.safetensors"),
        load_file(tmp_path / "cut" / "final" / "model.safetensors"),
    )
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "whole"))


class Payload:
    """Unpickling this runs a shell command that leaves a file behind: the proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize(
    "planted", ["rank_0.safetensors", "training_state/model-00001-of-00024.safetensors", "training_state/.metadata"]
)
def test_a_planted_pickle_in_a_checkpoint_is_never_unpickled(tmp_path, planted):
    """A pickle in place of a checkpoint's files stops the resume, and as DCP's pickled metadata file (which its
    safetensors reader never opens) changes nothing; its payload never runs."""
    grpo.main(small_run(tmp_path, "victim", num_steps=2))
    for path in (tmp_path / "victim" / "step_2").rglob("*"):
        assert not path.is_file() or path.read_bytes()[:2] not in (b"\x80\x02", b"\x80\x04", b"PK"), path
    marker = tmp_path / "code-ran"
    target = tmp_path / "victim" / "step_2" / planted
    assert target.exists() or planted.endswith(".metadata")  # the tiny model's state: 24 weights, 24 files
    target.write_bytes(pickle.dumps(Payload(marker), protocol=2))
    if planted.endswith(".metadata"):
        grpo.main(small_run(tmp_path, "victim", num_steps=4, resume="latest"))
    else:
        with pytest.raises(UsageError, match=r"--resume .*step_2: cannot restore it: "):
            grpo.main(small_run(tmp_path, "victim", num_steps=4, resume="latest"))
    assert not marker.exists()


def test_two_runs_started_together_with_one_name(tmp_path):
    """Both start at once: one claims the folder and runs, the other stops at start-up; one run's metrics."""
    args = [
        "grpo.py",
        "--num-steps",
        "3",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "same",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / args[0]), *args[1:]],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(proc.wait(timeout=1800), proc.stderr.read()) for proc in procs]
    assert sorted(code for code, _ in results) == [0, 2], results  # 2: a usage error, one line
    loser = next(err for code, err in results if code)
    assert "in use by another run" in loser or "already holds a run" in loser, loser
    assert [m["step"] for m in read_metrics(tmp_path / "same")] == [0, 1, 2]


def test_two_runs_started_together_without_a_run_name_each_get_a_folder(tmp_path):
    """A sweep from a script starts runs in the same second: the default name (file, seed, time) had no more
    to tell them apart, so the second stopped, told to choose a --run-name it never passed."""
    args = [
        "grpo.py",
        "--num-steps",
        "1",
        "--prompts-per-step",
        "4",
        "--group-size",
        "2",
        "--eval-every",
        "0",
        "--output-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / args[0]), *args[1:]],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(proc.wait(timeout=1800), proc.stderr.read()) for proc in procs]
    assert [code for code, _ in results] == [0, 0], results
    assert len([p for p in tmp_path.glob("grpo__1__*") if (p / "final").is_dir()]) == 2


def test_resuming_an_earlier_checkpoint_starts_a_new_run_folder(tmp_path):
    """step_2 of a 6-step run is not its newest checkpoint: the resumed run goes on in a new folder, which
    starts with the run's metrics before step 2, and leaves that run as it was; --run-name of that run is
    refused."""
    grpo.main(small_run(tmp_path, "run"))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()}
    logged = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match="already holds a run. Continue it with --resume latest, or choose another"):
        grpo.main(small_run(tmp_path, "run", num_steps=3, resume=str(tmp_path / "run" / "step_2")))
    grpo.main(small_run(tmp_path, None, num_steps=3, resume=str(tmp_path / "run" / "step_2")))
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()} == before
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == logged
    new = [p for p in tmp_path.iterdir() if p.name != "run"]
    assert len(new) == 1 and (new[0] / "final").is_dir(), new
    assert [m["step"] for m in read_metrics(new[0])] == [0, 1, 2]
    assert harness.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "step_6"


def test_a_checkpoint_named_by_a_relative_path_continues_its_run(tmp_path, monkeypatch):
    """--resume r/step_2 from the folder that holds r, with --output-dir an absolute path: the same run."""
    monkeypatch.chdir(tmp_path)
    grpo.main(small_run(tmp_path, "r", num_steps=2))
    grpo.main(small_run(tmp_path, "r", num_steps=3, resume="r/step_2"))
    assert [m["step"] for m in read_metrics(tmp_path / "r")] == [0, 1, 2]


def test_resume_never_deletes_what_it_did_not_write(tmp_path):
    """A checkpoint copied out of its run, next to the user's own files: the resumed run writes into a
    new run folder under --output-dir, and the user's files stay as they were."""
    import shutil

    grpo.main(small_run(tmp_path / "runs", "run", num_steps=2))
    models = tmp_path / "models"
    shutil.copytree(tmp_path / "runs" / "run" / "step_2", models / "step_2")
    (models / "final").mkdir()
    (models / "final" / "keep.bin").write_bytes(b"mine")
    (models / "config.json").write_text("{}")
    grpo.main(small_run(tmp_path / "runs", None, num_steps=4, resume=str(models / "step_2")))
    assert (models / "final" / "keep.bin").read_bytes() == b"mine"
    assert (models / "config.json").read_text() == "{}"
    assert sorted(p.name for p in models.iterdir()) == ["config.json", "final", "step_2"]
    new = [p for p in (tmp_path / "runs").iterdir() if p.name != "run"]
    assert len(new) == 1 and (new[0] / "final").is_dir(), new
    assert [m["step"] for m in read_metrics(new[0])] == [2, 3]  # models/ holds no metrics of steps 0 and 1


def test_a_checkpoint_of_another_algorithm_is_refused_and_changed_flags_are_printed(tmp_path, capsys):
    import shutil

    import dapo

    dapo.main(
        dapo.Args(
            num_steps=2,
            prompts_per_step=4,
            group_size=4,
            eval_every=0,
            save_every=2,
            output_dir=str(tmp_path),
            run_name="d",
        )
    )
    with pytest.raises(UsageError, match="written by dapo.py, resumed by grpo.py. Resume it with dapo.py"):
        grpo.main(small_run(tmp_path, "g", num_steps=4, resume=str(tmp_path / "d" / "step_2")))

    grpo.main(small_run(tmp_path, "g", num_steps=2))
    same_shape = tmp_path / "other_model"
    shutil.copytree(harness.DEFAULT_MODEL, same_shape)
    capsys.readouterr()
    grpo.main(small_run(tmp_path, "g", num_steps=3, resume="latest", learning_rate=1e-4, model=str(same_shape)))
    assert (
        "flags changed since the checkpoint: --model "
        f"{harness.DEFAULT_MODEL!r} -> {str(same_shape)!r}, "
        "--num-steps 2 -> 3, --learning-rate 0.0002 -> 0.0001" in capsys.readouterr().out
    )


FAIL_AFTER_THE_PROBE = """
calls = []
def reward(prompts, completions, answers):
    calls.append(1)
    if len(calls) > 1:  # the start-up check of the function passes; the first rollout fails
        raise RuntimeError("the reward server is down")
    return [0.0] * len(completions)
"""


def test_a_start_that_fails_before_step_0_does_not_block_a_rerun(tmp_path):
    (tmp_path / "flaky.py").write_text(FAIL_AFTER_THE_PROBE)
    args = [
        "grpo.py",
        "--num-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--output-dir",
        str(tmp_path / "runs"),
        "--run-name",
        "again",
    ]
    failed = run([*args, "--reward-fn", f"{tmp_path / 'flaky.py'}:reward"], cwd=tmp_path)
    assert failed.returncode != 0 and "the reward server is down" in failed.stderr
    result = run(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "again")] == [0, 1]


def fail_second_weights_write(monkeypatch):
    """The second save_pretrained (the step-4 checkpoint) writes half its file and then finds the disk full."""
    import transformers.modeling_utils

    real, calls = transformers.modeling_utils.safe_save_file, []

    def safe_save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            with open(filename, "wb") as file:
                file.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", safe_save_file)


def test_a_failed_write_names_the_path_and_leaves_the_previous_checkpoint_resumable(tmp_path, monkeypatch):
    fail_second_weights_write(monkeypatch)
    with pytest.raises(OSError, match=r"No space left on device: .*step_4.tmp/model.safetensors"):
        grpo.main(small_run(tmp_path, "full"))
    assert sorted(p.name for p in (tmp_path / "full").glob("step_*")) == ["step_2"]  # step_4.tmp removed
    monkeypatch.undo()
    grpo.main(small_run(tmp_path, "full", resume="latest"))
    assert (tmp_path / "full" / "final").is_dir()
    assert [m["step"] for m in read_metrics(tmp_path / "full")] == list(range(6))


def ctrl_c_in_dcp_write(*args, **kwargs):  # DCP catches it in its writer and raises a CheckpointException
    raise KeyboardInterrupt


def ctrl_c_in_write_bytes(*args, **kwargs):  # the rank's own state, written as one file
    raise KeyboardInterrupt


def ctrl_c_in_save_pretrained(*args, **kwargs):  # a plain KeyboardInterrupt, outside DCP and torch.save
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["dcp", "rank state", "save_pretrained"])
def test_ctrl_c_during_a_save_is_a_ctrl_c(tmp_path, monkeypatch, where):
    """A Ctrl-C that lands while the step-4 checkpoint is written stops the run as a Ctrl-C anywhere else
    does (the one-line resume command), not as a failed write, which would send the user looking for a
    disk problem: the half-written step_4.tmp is removed and step_2 stays the latest checkpoint."""
    import torch.distributed.checkpoint as dcp
    import transformers.modeling_utils

    owner, name, interrupted, counted = {
        "dcp": (dcp.HuggingFaceStorageWriter, "write_data", ctrl_c_in_dcp_write, lambda *args: True),
        "rank state": (
            Path,
            "write_bytes",
            ctrl_c_in_write_bytes,
            lambda path, *args: path.name == "rank_0.safetensors",
        ),
        "save_pretrained": (
            transformers.modeling_utils,
            "safe_save_file",
            ctrl_c_in_save_pretrained,
            lambda *args: True,
        ),
    }[where]
    real, calls = getattr(owner, name), []

    def second_save_interrupted(*args, **kwargs):
        calls.extend([1] if counted(*args) else [])
        return interrupted(*args, **kwargs) if counted(*args) and len(calls) == 2 else real(*args, **kwargs)

    monkeypatch.setattr(owner, name, second_save_interrupted)
    with pytest.raises(KeyboardInterrupt):
        grpo.main(small_run(tmp_path, "stopped"))
    assert len(calls) == 2  # stopped in the step-4 save
    assert sorted(p.name for p in (tmp_path / "stopped").iterdir() if p.name.startswith("step_")) == ["step_2"]
    monkeypatch.undo()
    grpo.main(small_run(tmp_path, "stopped", resume="latest"))
    assert [m["step"] for m in read_metrics(tmp_path / "stopped")] == list(range(6))


# Rank 1 finds the disk full when it writes its own state into the step-4 checkpoint.
RANK_1_DISK_FULL = """
import errno, os, pathlib

real, calls = pathlib.Path.write_bytes, []
def write_bytes(path, data):
    if os.environ.get("RANK") == "1" and path.name == "rank_1.safetensors":
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(path, data)
pathlib.Path.write_bytes = write_bytes
"""


def test_a_write_error_on_one_rank_stops_every_rank(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RANK_1_DISK_FULL)
    args = [
        "grpo.py",
        "--num-steps",
        "6",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--save-every",
        "2",
        "--fsdp",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        "full",
    ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*launcher, str(ROOT / args[0]), *args[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"},
        timeout=1800,
    )
    assert result.returncode != 0  # rank 1 stops with the OS's error, and torchrun stops rank 0
    assert "No space left on device: " in result.stderr and "rank_1.safetensors" in result.stderr
    assert [p.name for p in (tmp_path / "full").glob("step_*") if p.is_dir() and p.suffix != ".tmp"] == ["step_2"]
    assert harness.latest_checkpoint(tmp_path / "full") == tmp_path / "full" / "step_2"


def test_a_resume_past_num_steps_stops_naming_the_checkpoints_step(tmp_path):
    """Else it would log a step twice and save the checkpoint's weights as final/ of a shorter run. At
    --num-steps exactly, a resume runs what is left (test_a_run_stopped_in_its_final_evaluation_or_save_...)."""
    grpo.main(small_run(tmp_path, "r", num_steps=4))
    with pytest.raises(UsageError, match="--num-steps 3: .*step_4 is at step 4. Pass --num-steps 4 or more"):
        grpo.main(small_run(tmp_path, "r", num_steps=3, resume=str(tmp_path / "r" / "step_4")))
    assert [m["step"] for m in read_metrics(tmp_path / "r")] == [0, 1, 2, 3]


def test_final_records_its_step_and_a_resume_says_where_it_resumed_from(tmp_path, capsys):
    import json

    grpo.main(small_run(tmp_path, "r", num_steps=4))
    assert json.loads((tmp_path / "r" / "final" / harness.CHECKPOINT_INFO).read_text())["step"] == 4
    capsys.readouterr()
    grpo.main(small_run(tmp_path, "r", num_steps=6, resume="latest"))
    assert f"resumed from {tmp_path / 'r' / 'step_4'}" in capsys.readouterr().out
    assert json.loads((tmp_path / "r" / "final" / harness.CHECKPOINT_INFO).read_text())["step"] == 6


def test_keep_checkpoints_prunes_the_older_ones(tmp_path):
    grpo.main(small_run(tmp_path, "kept", keep_checkpoints=2))
    assert sorted(p.name for p in (tmp_path / "kept").glob("step_*")) == ["step_4", "step_6"]


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A one-step run, uninterrupted: (its folder, its arguments)."""
    out = tmp_path_factory.mktemp("end")
    args = [
        "grpo.py",
        "--num-steps",
        "1",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "1",
        "--eval-size",
        "8",
        "--save-every",
        "1",
        "--output-dir",
        str(out),
        "--run-name",
        "whole",
    ]
    main_in_process(args)
    return out / "whole", args


@pytest.mark.parametrize("hang_in", ["evaluate", "save"])
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_run_stopped_in_its_final_evaluation_or_save_finishes_when_resumed(
    tmp_path, one_step_run, hang_in, stop, capsys
):
    """Stopped after step_1/ (the last step's checkpoint) was written, in the final evaluation or the final/
    save: the resume that Ctrl-C prints (after a kill, the same: --resume latest) runs what is left, the final
    evaluation and final/, and ends as the run that was never stopped, bitwise."""
    whole, args = one_step_run
    args = [*args[:-4], "--output-dir", str(tmp_path), "--run-name", "stopped"]  # the same run, in its own folder
    _, stderr = stopped_in_second_call(args, tmp_path, hang_in, stop)
    assert (tmp_path / "stopped" / "step_1").is_dir() and not (tmp_path / "stopped" / "final").exists()
    if stop == signal.SIGINT:
        command = shlex.split(stderr.split("Go on from it with: ")[1].splitlines()[0])
        assert command[:2] == ["python", str(ROOT / "grpo.py")] and command[-2:] == ["--resume", "latest"], stderr
        args = ["grpo.py", *command[2:]]
    else:
        args = [*args, "--resume", "latest"]
    main_in_process(args)  # in this process: the same flags, without a second start-up
    assert "step    1/1 | eval/accuracy" in capsys.readouterr().out  # the final evaluation, no step trained again
    expected, got = (
        load_file(whole / "final" / "model.safetensors"),
        load_file(tmp_path / "stopped" / "final" / "model.safetensors"),
    )
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert without_timings(read_metrics(tmp_path / "stopped")) == without_timings(read_metrics(whole))
    assert [m["step"] for m in read_metrics(whole)] == [0, 1]
