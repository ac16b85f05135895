"""Bad input: every row below ends with one line naming the flag, file or path and what to do, a non-zero
exit, and nothing written that would block a rerun. The table in docs/bad_input.md is generated from
these rows (`PYTHONPATH=. python tests/test_bad_input.py > docs/bad_input.md`) and checked against them here."""

import importlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import grpo
import harness
from common import UsageError
from conftest import ROOT, default_sigint, read_metrics, run
from harness import cli

# (input, grpo.py's arguments, or another file's after its name, the start of the message). Each stops
# at start-up. "{tmp}" is the test's folder, where `make_inputs` writes the bad files; runs go to
# {tmp}/runs unless a row says.
AT_START_UP = [
    ("`--max-new-tokens 0`", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (
        "`--temperature 0`",
        ["--temperature", "0"],
        "--temperature 0.0: must be >= 0.01 (the log-probs divide the logits",
    ),
    ("a negative `--learning-rate`", ["--learning-rate", "-1e-4"], "--learning-rate -0.0001: must be > 0"),
    ("`--learning-rate inf`", ["--learning-rate", "inf"], "--learning-rate inf: must be a finite number"),
    ("`--target-kl nan` (ppo.py)", ["ppo.py", "--target-kl", "nan"], "--target-kl nan: must be a finite number"),
    ("`--beta inf`", ["--beta", "inf"], "--beta inf: must be a finite number"),
    (
        "`--no-eos-score inf` (ppo.py)",
        ["ppo.py", "--no-eos-score", "inf"],
        "--no-eos-score inf: must be a finite number",
    ),
    ("`--num-steps 0`", ["--num-steps", "0"], "--num-steps 0: must be >= 1 (0 would save the untrained model"),
    ("a negative `--num-steps`", ["--num-steps", "-3"], "--num-steps -3: must be >= 1"),
    ("`--eval-size -5`", ["--eval-size", "-5"], "--eval-size -5: must be >= 0"),
    (
        "`--eval-size 0` with `--dataset` (evaluation on)",
        ["--dataset", "{tmp}/train.jsonl", "--eval-size", "0"],
        "--eval-size 0 leaves nothing to evaluate every --eval-every 20 steps: pass --eval-every 0",
    ),
    (
        "`--eval-size 20000` on the built-in task",
        ["--eval-size", "20000"],
        "--eval-size 20000: the built-in task has 10000 prompts, so none would be left to train on",
    ),
    ("`--keep-checkpoints -1`", ["--keep-checkpoints", "-1"], "--keep-checkpoints -1: must be >= 0"),
    ("`--dist-timeout 0`", ["--dist-timeout", "0"], "--dist-timeout 0.0: must be > 0 (minutes)"),
    ("`--correction-cap 0.5`", ["--correction-cap", "0.5"], "--correction-cap 0.5: must be >= 1"),
    (
        "a negative `--off-policy-steps`",
        ["--off-policy-steps", "-1"],
        "--off-policy-steps -1: must be >= 0 (0: each rollout sampled by the policy as it is)",
    ),
    (
        "`--anchor behaviour` with a rollout correction",
        ["--anchor", "behaviour", "--rollout-correction", "tis"],
        "--rollout-correction tis weighs each token by pi_old / pi_sampler, which is 1 with --anchor behaviour",
    ),
    (
        "`--anchor behaviour` with demonstrations (gvpo.py)",
        ["gvpo.py", "--anchor", "behaviour", "--demos-per-group", "2"],
        "--demos-per-group 2: must be 0 with --anchor behaviour (a demonstration has no sampler log-probs",
    ),
    ("`--vllm-gpu-memory 1.5`", ["--vllm-gpu-memory", "1.5"], "--vllm-gpu-memory 1.5: must be in (0, 1]"),
    ("`--lora-rank -1`", ["--lora-rank", "-1"], "--lora-rank -1: must be >= 0 (0: full fine-tuning)"),
    ("`--lora-alpha 0`", ["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha 0.0: must be > 0"),
    (
        "`--lora-targets` that match no module",
        ["--lora-rank", "8", "--lora-targets", "qproj"],
        "--lora-targets qproj: Target modules {'qproj'} not found in the base model",
    ),
    (
        "`--lora-targets` of a kind peft cannot adapt",
        ["--lora-rank", "8", "--lora-targets", "input_layernorm"],
        "--lora-targets input_layernorm: Target module Qwen3RMSNorm((128,), eps=1e-06) is not supported",
    ),
    ("non-UTF-8 bytes in a JSONL file", ["--dataset", "{tmp}/latin1.jsonl"], "latin1.jsonl:2: not UTF-8"),
    (
        "real text (capitals, other scripts) with the default tiny model: `--model` forgotten",
        ["--dataset", "{tmp}/words.jsonl", "--eval-size", "4"],
        ": its tokenizer cannot encode the training data"
        " (WordLevel error: Missing [UNK] token from the vocabulary). Pass a --model",
    ),
    ("`--run-name ../x`", ["--run-name", "../x"], "--run-name '../x': must be a folder name under --output-dir"),
    ("`--run-name` an absolute path", ["--run-name", "/tmp/x"], "--run-name '/tmp/x': must be a folder name"),
    (
        "`--task chain` with `--dataset`",
        ["--task", "chain", "--dataset", "{tmp}/train.jsonl"],
        "--task chain is a built-in dataset: pass --task or --dataset, not both.",
    ),
    (
        "`--demos-per-group 8` with `--group-size 8` (gvpo.py)",
        ["gvpo.py", "--demos-per-group", "8"],
        "--demos-per-group 8: must be in [0, --group-size 8) (each group samples at least one completion)",
    ),
    ("`--clip-eps 1.5`", ["--clip-eps", "1.5"], "--clip-eps 1.5: must be in (0, 1)"),
    ("`--max-gen-rounds 0` (dapo.py)", ["dapo.py", "--max-gen-rounds", "0"], "--max-gen-rounds 0: must be >= 1"),
    ("`--is-eps-low 2` (cispo.py)", ["cispo.py", "--is-eps-low", "2"], "--is-eps-low 2.0: must be in [0, 1]"),
    ("`--beta 0` (gvpo.py)", ["gvpo.py", "--beta", "0"], "--beta 0.0: must be > 0 (the implicit reward is beta"),
    ("`--target-kl 0` (gvpo.py)", ["gvpo.py", "--target-kl", "0"], "--target-kl 0.0: must be > 0 nats per completion"),
    ("`--tau-neg 0` (sapo.py)", ["sapo.py", "--tau-neg", "0"], "--tau-neg 0.0: must be > 0"),
    ("`--delta 0` (dppo.py)", ["dppo.py", "--divergence", "kl", "--delta", "0"], "--delta 0.0: must be > 0"),
    ("`--gamma 1.5` (ppo.py)", ["ppo.py", "--gamma", "1.5"], "--gamma 1.5: must be in [0, 1]"),
    (
        "a `--dataset` folder holding a loading script",
        ["--dataset", "{tmp}/script_data"],
        "script_data': cannot load it (RuntimeError: Dataset scripts are no longer supported",
    ),
    (
        "every prompt (or every answer) empty: a field that names the wrong column",
        ["--dataset", "{tmp}/empty_prompts.jsonl", "--eval-size", "4"],
        "empty_prompts.jsonl': every prompt is empty. Name the field that holds the prompts with --prompt-field",
    ),
    (
        "`--eval-split test` with a JSONL `--dataset`: no splits, so the held-out rows would be the training rows",
        ["--dataset", "{tmp}/train.jsonl", "--eval-split", "test"],
        "train.jsonl' is a JSONL file, which has no splits: "
        "the held-out rows would be the training rows. Pass --eval-dataset with a file of held-out rows, or leave "
        "--eval-split out to hold out the last --eval-size rows.",
    ),
    (
        "`--split validation` with a JSONL `--dataset`",
        ["--dataset", "{tmp}/train.jsonl", "--split", "validation"],
        "train.jsonl' is a JSONL file, which has no splits. Leave --split out, or pass a dataset that has them.",
    ),
    (
        "`--eval-dataset` the same file as `--dataset`",
        ["--dataset", "{tmp}/train.jsonl", "--eval-dataset", "{tmp}/train.jsonl"],
        "train.jsonl': the held-out rows would be the training rows. Pass --eval-dataset with "
        "other rows, another --eval-split, or neither (the last --eval-size rows are held out).",
    ),
    (
        "a prompt that is an empty list of messages",
        ["--dataset", "{tmp}/chat.jsonl", "--prompt-field", "none"],
        "chat.jsonl:1: field none: no messages (an empty list). Fix the row, or name another field "
        "with --prompt-field.",
    ),
    (
        "a chat message without `role` or `content`",
        ["--dataset", "{tmp}/chat.jsonl", "--prompt-field", "no_role"],
        "chat.jsonl:1: field no_role: message 1 must be {'role': text, 'content': text}, got "
        "{'content': '1+1'}. Fix the "
        "row, or name another field with --prompt-field.",
    ),
    (
        "a chat message whose content is not text (content parts)",
        ["--dataset", "{tmp}/chat.jsonl", "--prompt-field", "parts"],
        "chat.jsonl:1: field parts: message 1 must be {'role': text, 'content': text}, got {'role': 'user', "
        "'content': [{'type': 'text', 'text': '1+1'}]}.",
    ),
    (
        "a dotted `--answer-field` that a row lacks",
        ["--dataset", "{tmp}/chat.jsonl", "--answer-field", "reward_model.answer"],
        "chat.jsonl:1: missing field reward_model.answer (reward_model has ground_truth, style). "
        "Name the field with --answer-field.",
    ),
    (
        "chat-message prompts with `--no-chat-template`",
        ["--dataset", "{tmp}/chat.jsonl", "--no-chat-template"],
        "chat.jsonl:1: field prompt: chat messages, which need a chat template; --no-chat-template turns it "
        "off. Leave --no-chat-template out, or give them as text.",
    ),
    (
        "`--system-prompt` with `--no-chat-template`",
        ["--system-prompt", "be brief", "--no-chat-template"],
        "--system-prompt 'be brief': a system message needs the chat template; --no-chat-template turns it off.",
    ),
    (
        "`--seed 99999999999999999999999`",
        ["--seed", "99999999999999999999999"],
        "--seed 99999999999999999999999: must be in [0, 2**63)",
    ),
    ("`--temperature 1e-45`", ["--temperature", "1e-45"], "--temperature 1e-45: must be >= 0.01"),
    (
        "`--max-tokens-per-micro-batch 0`",
        ["--max-tokens-per-micro-batch", "0"],
        "--max-tokens-per-micro-batch 0: must be >= 1 (or left out: no limit)",
    ),
    (
        "a `--reward-fn` that returns a dict",
        ["--reward-fn", "{tmp}/user_rewards.py:as_dict"],
        "must return a list of one finite float per completion (2), got {0: 1.0, 1: 1.0}",
    ),
    (
        "a `--reward-fn` that empties the list it was given",
        ["--reward-fn", "{tmp}/user_rewards.py:emptied"],
        "must return a list of one finite float per completion (2), got []",
    ),
    ("an `--env` file that does not exist", ["--env", "{tmp}/nowhere.py:Env"], "nowhere.py:Env': cannot import '"),
    (
        "an `--env` class its file does not have",
        ["--env", "{tmp}/user_rewards.py:Game"],
        "user_rewards.py' has no class 'Game'.",
    ),
    (
        "an `--env` class without a `step` method",
        ["--env", "{tmp}/user_rewards.py:NoStep"],
        "user_rewards.py:NoStep: class: must have a step(action) method, got <class '",
    ),
    ("`--max-turns 0`", ["--task", "guess", "--max-turns", "0"], "--max-turns 0: must be >= 1 (1: single-turn)"),
    (
        "`--max-turns 3` without an environment",
        ["--max-turns", "3"],
        "--max-turns 3: turns after the first answer an environment's observation. Pass --env file.py:Class",
    ),
    (
        "`--reward-model` with an environment (ppo.py)",
        ["ppo.py", "--task", "guess", "--reward-model", "{tmp}"],
        ": must be left out with --env and --task guess (single-turn: an environment scores its episodes)",
    ),
    (
        "`--demos-per-group` with an environment (gvpo.py)",
        ["gvpo.py", "--task", "guess", "--demos-per-group", "2"],
        "--demos-per-group 2: must be 0 with --env and --task guess (an episode has no demonstration)",
    ),
]

# Inputs found later, each with its own test below: (input, the start of the message).
LATER = {
    "shapes": (
        "same weight names with other shapes at `--resume`",
        "cannot restore it: Size mismatch between saved torch.Size",
    ),
    "ctrl-c": ("Ctrl-C", "stopped (Ctrl-C). Last checkpoint: "),
    "os": (
        "what the OS refuses: `--output-dir` a file (or under one, or not writable), a `--run-name` too long",
        "error: [Errno 20] Not a directory: ",
    ),
    "shard": ("a 0-byte or raw-pickle shard of the resumable state", "cannot restore it: "),
    "full": (
        "a full disk while `--resume latest` cuts `metrics.jsonl` back to the checkpoint's step",
        "[Errno 28] No space left on device",
    ),
    "full save": (
        "a full disk while a step checkpoint or `final/` is written (the checkpoint's folder, its size and "
        "the space free)",
        "error: cannot write ",
    ),
    "exit": (
        "a `--reward-fn` that calls `sys.exit(0)`",
        "called sys.exit(0). A reward function must return its values",
    ),
    "env": (
        "an `--env` whose `__init__`, `reset` or `step` raises, or that gives a value of the wrong kind (`stop`, "
        "`reset()`'s first message or its length, `step()`'s observation, reward or `done`): "
        "tests/test_multiturn.py, the rules in docs/environments.md",
        "--env ",
    ),
}

# Inputs that are handled rather than refused: (input, what happens), each with its test below.
HANDLED = [
    (
        "a `--model` that needs custom code (`auto_map`), even answered 'y' on standard input",
        "transformers refuses it: every load passes `trust_remote_code=False`, and nothing from the folder runs",
    ),
    (
        "a `--model` folder whose pickled `pytorch_model.bin` holds more than tensors",
        "transformers refuses it (`torch.load(weights_only=True)`): nothing in it runs",
    ),
    (
        "a module of the grader's name (`sympy.py`, ...) in the working directory of a run on math data",
        "not imported: Python puts the script's folder first on the import path, not the working directory "
        "(only a `--reward-fn module:function` is imported from it)",
    ),
    (
        "a run killed after logging a step, before its first checkpoint, run again with the same name",
        "starts over in its folder; what it logged is kept in `metrics.jsonl.old`",
    ),
    (
        "`--resume latest` in a copied or moved repository, on the default model",
        "goes on: the default model's new path is printed among the changed flags",
    ),
    (
        "control characters (ANSI escapes) in a flag value of `checkpoint.json`",
        "printed escaped (`repr`) in the 'flags changed' line",
    ),
    (
        "a `--reward-fn` that hangs",
        "no deadline: it runs in the training process, where it may hold a model or a connection. Under torchrun "
        "the other ranks stop after `--dist-timeout`; on one process, Ctrl-C stops it. Give its own calls a timeout",
    ),
]


def make_inputs(tmp: Path) -> None:
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(20)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "words.jsonl").write_text(
        "".join(json.dumps({"prompt": f"What is {a} + 1? Réponds.", "answer": str(a + 1)}) + "\n" for a in range(20))
    )
    (tmp / "latin1.jsonl").write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xe9", "answer": "1"}\n')
    (tmp / "script_data").mkdir()
    (tmp / "script_data" / "script_data.py").write_text(f"open({str(tmp / 'code-ran')!r}, 'w')\n")
    (tmp / "empty_prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": "", "answer": "1"}) + "\n" for _ in range(20))
    )
    (tmp / "user_rewards.py").write_text(USER_REWARDS)
    chat = {
        "prompt": [{"role": "user", "content": "1+1"}],
        "no_role": [{"content": "1+1"}],
        "answer": "2",
        "none": [],
        "parts": [{"role": "user", "content": [{"type": "text", "text": "1+1"}]}],
        "reward_model": {"ground_truth": "2", "style": "rule"},
    }
    (tmp / "chat.jsonl").write_text((json.dumps(chat) + "\n") * 20)


USER_REWARDS = """
def as_dict(prompts, completions, answers):
    return {i: 1.0 for i in range(len(completions))}

def emptied(prompts, completions, answers):
    completions.clear()
    return []

class NoStep:
    def __init__(self, row):
        pass
    def act(self, action):
        return None, 1.0, True
"""


def make_custom_code_model(folder: Path, marker: Path) -> None:
    """The tiny model, its config naming an architecture transformers does not have and, in `auto_map`, a
    Python file beside it that would define it: loading it would run that file, which leaves `marker`."""
    shutil.copytree(harness.DEFAULT_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mine", auto_map={"AutoConfig": "mine.MineConfig", "AutoModelForCausalLM": "mine.Mine"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "mine.py").write_text(
        f"open({str(marker)!r}, 'w')\nfrom transformers import Qwen3Config\n"
        "class MineConfig(Qwen3Config):\n    model_type = 'mine'\n"
    )


class Payload:
    """Unpickling this runs a shell command that leaves a file behind: the proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def make_pickled_model(folder: Path, marker: Path) -> None:
    """The tiny model with its weights as a pickled `pytorch_model.bin` that also holds a payload."""
    import torch
    from safetensors.torch import load_file

    shutil.copytree(harness.DEFAULT_MODEL, folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**weights, "extra": Payload(marker)}, folder / "pytorch_model.bin")


@pytest.mark.parametrize("what, argv, message", AT_START_UP, ids=[row[0] for row in AT_START_UP])
def test_bad_input_stops_at_start_up_with_one_line(tmp_path, what, argv, message):
    make_inputs(tmp_path)
    module = importlib.import_module(argv[0][:-3]) if argv[0].endswith(".py") else grpo
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv if not arg.endswith(".py")]
    if "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "runs")]
    with pytest.raises(UsageError) as stop:
        module.main(cli(module.Args, args=argv))
    assert "\n" not in str(stop.value)  # one line
    assert message in str(stop.value)
    assert not (tmp_path / "runs").exists()  # nothing written
    assert not (tmp_path / "code-ran").exists()  # no code from a data folder ran


def small(tmp_path: Path, *more: str, steps: int = 4) -> list[str]:
    return [
        "grpo.py",
        "--num-steps",
        str(steps),
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--output-dir",
        str(tmp_path / "runs"),
        *more,
    ]


def test_resume_into_weights_of_other_shapes_stops(tmp_path):
    """The same --model path, now holding a model whose weights have the same names and other shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tmp_path / "model"
    shutil.copytree(harness.DEFAULT_MODEL, model)
    args = small(tmp_path, "--model", str(model), "--run-name", "r", "--save-every", "2")
    grpo.main(
        cli(grpo.Args, args=small(tmp_path, "--model", str(model), "--run-name", "r", "--save-every", "2", steps=2)[1:])
    )
    config = AutoConfig.from_pretrained(model, intermediate_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    with pytest.raises(UsageError) as stop:
        grpo.main(cli(grpo.Args, args=[*args[1:], "--resume", "latest"]))
    assert f"--resume {tmp_path / 'runs' / 'r' / 'step_2'}: {LATER['shapes'][1]}" in str(stop.value)
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "r")] == [0, 1]  # the run as it was


SLOW_STEPS = """
import time
def reward(prompts, completions, answers):
    time.sleep(0.5)  # every step takes >= 0.5 s: a Ctrl-C sent when step_2 appears comes long before the end
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_ctrl_c_says_where_to_resume_and_the_command_works(tmp_path):
    """The run is slowed by its reward (>= 0.5 s a step), so the Ctrl-C lands well before its end."""
    (tmp_path / "slow.py").write_text(SLOW_STEPS)
    args = small(
        tmp_path, "--run-name", "stopped", "--save-every", "2", "--reward-fn", f"{tmp_path / 'slow.py'}:reward", steps=6
    )
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / args[0]), *args[1:]],
        cwd=tmp_path,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_sigint,
    )
    deadline = time.time() + 900
    while not (tmp_path / "runs" / "stopped" / "step_2").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode != 0
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(LATER["ctrl-c"][1]) and "Traceback" not in stderr, stderr
    command = line.split("Go on from it with: ")[1]
    assert command.endswith("--resume latest")
    result = subprocess.run(
        command,
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "stopped")] == list(range(6))


def test_eval_size_0_without_evaluation_trains_on_every_row(tmp_path):
    make_inputs(tmp_path)
    argv = small(tmp_path, "--dataset", str(tmp_path / "train.jsonl"), "--eval-size", "0", "--run-name", "all")
    grpo.main(cli(grpo.Args, args=argv[1:]))
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "all")] == [0, 1, 2, 3]


def test_non_finite_metrics_are_written_as_null(tmp_path):
    (tmp_path / "run").mkdir()
    logger = harness.Logger(tmp_path / "run", {}, rank=0)
    logger.log(0, {"loss/policy": float("nan"), "policy/grad_norm": float("inf"), "reward/mean": 0.5})
    logger.close()
    line = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 0, "loss/policy": None, "policy/grad_norm": None, "reward/mean": 0.5}


def test_healthy_runs_print_no_alarming_noise(tmp_path, capfd):
    """dapo.py's statistics of a step where dynamic sampling kept no group (a std() warning)."""
    import warnings

    import dapo

    never = tmp_path / "never.jsonl"  # every answer is wrong: every group has zero variance and is filtered out
    never.write_text("".join(json.dumps({"prompt": f"{a}+{a}", "answer": "never"}) + "\n" for a in range(10, 40)))
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dapo.main(
            cli(
                dapo.Args,
                args=small(tmp_path, "--dataset", str(never), "--eval-size", "4", "--max-gen-rounds", "1", steps=1)[1:],
            )
        )
    out, err = capfd.readouterr()
    assert not re.search(r"warning", err, re.IGNORECASE), err


# --- The run folder, checkpoints and what a run is given, each as an attacker or a careless user would ---


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6 (runs/r); each test works on a copy."""
    out = tmp_path_factory.mktemp("finished")
    grpo.main(cli(grpo.Args, args=small(out, "--run-name", "r", "--save-every", "2", steps=6)[1:]))
    return out / "runs" / "r"


def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished_run, tmp_path / "runs" / "r", symlinks=True)
    return tmp_path / "runs" / "r"


def listing(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        for p in sorted(folder.rglob("*"))
    }


def resume(tmp_path: Path, checkpoint: str = "latest", *more: str, steps: int = 8, module=grpo):
    argv = small(tmp_path, "--run-name", "r", "--save-every", "2", "--resume", checkpoint, *more, steps=steps)[1:]
    return module.main(cli(module.Args, args=argv))


def a_shard(checkpoint: Path) -> Path:
    return sorted((checkpoint / harness.TRAINING_STATE).glob("*.safetensors"))[0]


@pytest.mark.parametrize("damage", ["empty", "raw pickle"])
def test_a_damaged_shard_is_named_with_its_cause(tmp_path, finished_run, damage):
    run_dir = copy_run(finished_run, tmp_path)
    shard = a_shard(run_dir / "step_6")
    shard.write_bytes(b"" if damage == "empty" else pickle.dumps({"weights": [1.0, 2.0]}))
    with pytest.raises(UsageError) as stop:
        resume(tmp_path)
    message, named = str(stop.value), f"--resume {run_dir / 'step_6'}: {LATER['shard'][1]}"
    assert message.startswith(named) and "\n" not in message
    assert len(message) > len(named) + 10, message  # the cause follows


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    """Killed after logging steps 0 and 1, before any checkpoint: the same command again runs, in that folder."""
    argv = small(tmp_path, "--run-name", "r", steps=2)[1:]
    grpo.main(cli(grpo.Args, args=argv))
    run_dir = tmp_path / "runs" / "r"
    shutil.rmtree(run_dir / "final")  # as if killed before the end
    logged = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match="no checkpoint under .* run it again without --resume"):
        grpo.main(cli(grpo.Args, args=[*argv, "--resume", "latest"]))
    grpo.main(cli(grpo.Args, args=argv))
    assert [m["step"] for m in read_metrics(run_dir)] == [0, 1] and (run_dir / "final").is_dir()
    assert (run_dir / "metrics.jsonl.old").read_text() == logged


@pytest.mark.slow
def test_a_copied_repository_resumes_a_run_of_the_default_model(tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    for path in ROOT.iterdir():
        if path.suffix == ".py" or path.name == "tiny_model":
            (shutil.copytree if path.is_dir() else shutil.copy)(path, first / path.name)
    argv = [str(first / "grpo.py"), *small(tmp_path, "--run-name", "r", "--save-every", "2", steps=2)[1:]]
    subprocess.run([sys.executable, *argv], cwd=tmp_path, check=True, capture_output=True)
    first.rename(tmp_path / "moved")
    argv = [str(tmp_path / "moved" / "grpo.py"), *small(tmp_path, "--run-name", "r", "--resume", "latest", steps=4)[1:]]
    result = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "r")] == [0, 1, 2, 3]


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MB file system of its own (tmpfs), to be filled up; mounting one needs root."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small file system needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk: Path, leave: int = 0) -> None:
    """Take every block of `disk` but `leave` bytes."""
    with open(disk / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass
        os.truncate(filler.fileno(), max(0, filler.tell() - leave))


def test_a_full_disk_during_a_resume_names_the_file_and_keeps_the_metrics(tmp_path, finished_run, small_disk):
    """The cut metrics file is written beside the old one before the old one is moved aside: a full disk stops
    the resume with the OS's one line, metrics.jsonl as it was; with space again the resume goes on."""
    shutil.copytree(finished_run, small_disk / "runs" / "r")
    run_dir = small_disk / "runs" / "r"
    shutil.rmtree(run_dir / "step_6")  # as if killed after logging step 5: the resume cuts steps 4 and 5 off
    shutil.rmtree(run_dir / "final")
    logged = (run_dir / "metrics.jsonl").read_bytes()
    fill(small_disk)  # every block of the disk taken
    argv = small(small_disk, "--run-name", "r", "--save-every", "2", "--resume", "latest", steps=8)
    with pytest.raises(UsageError, match=re.escape(LATER["full"][1])):
        grpo.main(cli(grpo.Args, args=argv[1:]))
    assert (run_dir / "metrics.jsonl").read_bytes() == logged
    (small_disk / "filler").unlink()
    grpo.main(cli(grpo.Args, args=argv[1:]))
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(8))


@pytest.mark.parametrize("save_every, written", [(1, "step_1"), (0, "final")])
def test_a_full_disk_during_a_save_is_one_line_naming_the_folder_and_the_space(small_disk, save_every, written):
    """DCP's writer gathers the OS's error into a CheckpointException, and safetensors' Rust code raises its own
    SafetensorError: each was a traceback. Now one OSError (one line from __main__) naming the checkpoint, what it
    takes and what is free; the half-written folder is removed."""
    fill(small_disk, leave=256 * 1024)  # room for config.json and metrics.jsonl, not for the tiny model's 1.6 MB
    argv = small(small_disk, "--run-name", "r", "--save-every", str(save_every), steps=1)
    with pytest.raises(OSError) as stopped:
        grpo.main(cli(grpo.Args, args=argv[1:]))
    message = str(stopped.value)
    assert message.startswith(f"cannot write {small_disk / 'runs' / 'r' / written}: ") and "\n" not in message
    assert re.search(
        r"No space left on device.*a checkpoint here takes about \d+\.\d MiB; 0\.\d MiB are free", message
    ), message
    assert not list((small_disk / "runs" / "r").glob(f"{written}*"))
    assert LATER["full save"][1] == "error: " + message[: len(LATER["full save"][1]) - len("error: ")]


EXITS = """
calls = []
def reward(prompts, completions, answers):
    calls.append(1)
    if len(calls) == 3:  # the start-up check and step 0 pass
        import sys
        sys.exit(0)
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_a_reward_fn_that_exits_stops_the_run_as_a_failure(tmp_path):
    (tmp_path / "exits.py").write_text(EXITS)
    result = run(small(tmp_path, "--run-name", "r", "--reward-fn", f"{tmp_path / 'exits.py'}:reward"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: --reward-fn '{tmp_path / 'exits.py'}:reward' {LATER['exit'][1]}")
    ), result.stderr


def test_control_characters_in_a_checkpoints_flags_are_printed_escaped(tmp_path, finished_run, capsys):
    run_dir = copy_run(finished_run, tmp_path)
    info_file = run_dir / "step_6" / harness.CHECKPOINT_INFO
    info = json.loads(info_file.read_text())
    info["config"]["dataset_config"] = "\x1b[2J\x1b[31mall clear"
    info_file.write_text(json.dumps(info))
    capsys.readouterr()
    resume(tmp_path)
    out = capsys.readouterr().out
    assert "--dataset-config '\\x1b[2J\\x1b[31mall clear' -> None" in out and "\x1b" not in out


GRADED = "".join(json.dumps({"prompt": f"{a}+1", "answer": "x+1"}) + "\n" for a in range(20))  # math-verify's


@pytest.mark.slow
def test_the_math_grader_imports_nothing_from_the_working_directory(tmp_path):
    """A run on math data (answers that are not plain numbers go to math-verify) in a folder that holds a
    `sympy.py`: Python puts the script's folder first on the import path, not the working directory."""
    (tmp_path / "sympy.py").write_text(f"open({str(tmp_path / 'code-ran')!r}, 'w')\n")
    (tmp_path / "math.jsonl").write_text(GRADED)
    result = run(small(tmp_path, "--dataset", str(tmp_path / "math.jsonl"), "--eval-size", "4", steps=1), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.slow
@pytest.mark.parametrize("make", [make_custom_code_model, make_pickled_model])
def test_code_in_a_model_folder_never_runs_even_when_the_answer_is_yes(tmp_path, make):
    """transformers asks "Do you wish to run the custom code?" when trust_remote_code is left unset; a pickle
    that holds more than tensors would run code when unpickled with torch.load's weights_only off."""
    make(tmp_path / "model", tmp_path / "code-ran")
    argv = small(tmp_path, "--model", str(tmp_path / "model"), steps=1)
    result = subprocess.run(
        [sys.executable, str(ROOT / argv[0]), *argv[1:]],
        cwd=tmp_path,
        input="y\n" * 10,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode != 0 and not (tmp_path / "code-ran").exists(), result.stderr
    assert "trust_remote_code" in result.stderr or "Weights only load failed" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_what_the_os_refuses_is_one_line(tmp_path):
    """No checks in advance of what the OS says itself: --output-dir a file stops with its error and path."""
    (tmp_path / "a_file").write_text("")
    result = run(small(tmp_path, "--output-dir", str(tmp_path / "a_file"), steps=1), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(LATER["os"][1] + repr(str(tmp_path / "a_file"))[:-1])


def docs_table() -> str:
    lines = ["| input | message (its start) |", "|---|---|"]
    for what, argv, message in AT_START_UP:
        lines.append(f"| {what} | `{message} ...` |")
    for what, message in LATER.values():
        lines.append(f"| {what} | `{message} ...` |")
    lines += ["", "Handled rather than refused:", "", "| input | what happens |", "|---|---|"]
    lines += [f"| {what} | {happens} |" for what, happens in HANDLED]
    return "\n".join(lines) + "\n"


DOCS = ROOT / "docs" / "bad_input.md"
DOCS_HEAD = """# Bad input and what the files say

Every row ends with one line naming the flag, file or path and what to do, and a non-zero exit; a
start-up row writes nothing (the run folder is claimed only once the models are loaded), so a rerun
with the input fixed goes ahead. Generated from `tests/test_bad_input.py`, which runs every row
(`PYTHONPATH=. python tests/test_bad_input.py > docs/bad_input.md`).

"""


def test_the_docs_table_is_the_tested_one():
    regenerate = "PYTHONPATH=. python tests/test_bad_input.py > docs/bad_input.md"
    assert DOCS.read_text() == DOCS_HEAD + docs_table(), f"regenerate: {regenerate}"


if __name__ == "__main__":
    print(DOCS_HEAD + docs_table(), end="")
