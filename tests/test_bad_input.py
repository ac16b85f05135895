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

import common
import grpo
from common import UsageError, cli
from conftest import ROOT, read_metrics, run

# (input, grpo.py's arguments, or another file's after its name, the start of the message). Each stops
# at start-up. "{tmp}" is the test's folder, where `make_inputs` writes the bad files; runs go to
# {tmp}/runs unless a row says.
AT_START_UP = [
    ("`--max-new-tokens 0`", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    ("`--temperature 0`", ["--temperature", "0"],
     "--temperature 0.0: must be >= 0.01 (the log-probs divide the logits"),
    ("a negative `--learning-rate`", ["--learning-rate", "-1e-4"], "--learning-rate -0.0001: must be > 0"),
    ("`--num-steps 0`", ["--num-steps", "0"], "--num-steps 0: must be >= 1 (0 would save the untrained model"),
    ("a negative `--num-steps`", ["--num-steps", "-3"], "--num-steps -3: must be >= 1"),
    ("`--eval-size -5`", ["--eval-size", "-5"], "--eval-size -5: must be >= 0"),
    ("`--eval-size 0` with `--dataset` (evaluation on)", ["--dataset", "{tmp}/train.jsonl", "--eval-size", "0"],
     "--eval-size 0 leaves nothing to evaluate every --eval-every 20 steps: pass --eval-every 0"),
    ("`--eval-size 20000` on the built-in task", ["--eval-size", "20000"],
     "--eval-size 20000: the built-in task has 10000 prompts, so none would be left to train on"),
    ("`--keep-checkpoints -1`", ["--keep-checkpoints", "-1"], "--keep-checkpoints -1: must be >= 0"),
    ("`--dist-timeout 0`", ["--dist-timeout", "0"], "--dist-timeout 0.0: must be > 0 (minutes)"),
    ("`--correction-cap 0.5`", ["--correction-cap", "0.5"], "--correction-cap 0.5: must be >= 1"),
    ("`--vllm-gpu-memory 1.5`", ["--vllm-gpu-memory", "1.5"], "--vllm-gpu-memory 1.5: must be in (0, 1]"),
    ("`--lora-rank -1`", ["--lora-rank", "-1"], "--lora-rank -1: must be >= 0 (0: full fine-tuning)"),
    ("`--lora-alpha 0`", ["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha 0.0: must be > 0"),
    ("`--lora-targets` that match no module", ["--lora-rank", "8", "--lora-targets", "qproj"],
     "--lora-targets qproj: Target modules {'qproj'} not found in the base model"),
    ("`--lora-targets` of a kind peft cannot adapt", ["--lora-rank", "8", "--lora-targets", "input_layernorm"],
     "--lora-targets input_layernorm: Target module Qwen3RMSNorm((128,), eps=1e-06) is not supported"),
    ("non-UTF-8 bytes in a JSONL file", ["--dataset", "{tmp}/latin1.jsonl"], "latin1.jsonl:2: not UTF-8"),
    ("a prompt with a character the tokenizer cannot encode", ["--dataset", "{tmp}/capitals.jsonl", "--eval-size", "4"],
     "training data, row 5: the tokenizer of --model cannot encode 'W'"),
    ("`--output-dir` is a file", ["--output-dir", "{tmp}/a_file"], "a_file is a file, not a folder. Pass a folder"),
    ("`--output-dir` under a file", ["--output-dir", "{tmp}/a_file/runs"], "a_file is a file, not a folder"),
    ("`--output-dir` not writable", ["--output-dir", "{tmp}/read_only/runs"], "read_only is not writable by this user"),
    ("`--run-name ../x`", ["--run-name", "../x"], "--run-name '../x': must be a folder name under --output-dir"),
    ("`--run-name` an absolute path", ["--run-name", "/tmp/x"], "--run-name '/tmp/x': must be a folder name"),
    ("`--clip-eps 1.5`", ["--clip-eps", "1.5"], "--clip-eps 1.5: must be in (0, 1)"),
    ("`--max-gen-rounds 0` (dapo.py)", ["dapo.py", "--max-gen-rounds", "0"], "--max-gen-rounds 0: must be >= 1"),
    ("`--is-eps-low 2` (cispo.py)", ["cispo.py", "--is-eps-low", "2"], "--is-eps-low 2.0: must be in [0, 1]"),
    ("`--beta 0` (gvpo.py)", ["gvpo.py", "--beta", "0"], "--beta 0.0: must be > 0 (the implicit reward is beta"),
    ("`--gamma 1.5` (ppo.py)", ["ppo.py", "--gamma", "1.5"], "--gamma 1.5: must be in [0, 1]"),
    ("a truncated safetensors file", ["--model", "{tmp}/truncated"],
     "truncated': cannot read its weights (Error while deserializing header"),
    ("`config.json` not a JSON object", ["--model", "{tmp}/config_list"],
     "config_list': its config.json is a JSON list, not a JSON object"),
    ("a `--model` folder whose config asks to run code from the folder (`auto_map`)", ["--model", "{tmp}/custom_code"],
     "custom_code': it needs code from the model's folder or repository (auto_map), and code from a model is never "
     "run here"),
    ("a `--model` folder whose pickled weights hold more than tensors", ["--model", "{tmp}/pickled_bin"],
     "pickled_bin': its weights file holds pickled data other than tensors"),
    ("a chat template that fails to render", ["--model", "{tmp}/bad_template"],
     "the chat template of --model cannot render a prompt (TemplateError: no template here)"),
    ("a `--dataset` folder holding a loading script", ["--dataset", "{tmp}/script_data"],
     "script_data': cannot load it (RuntimeError: Dataset scripts are no longer supported"),
    ("every prompt empty, without a chat template",
     ["--dataset", "{tmp}/empty_prompts.jsonl", "--eval-size", "4", "--no-chat-template"],
     "training data: all 16 prompts are empty"),
    ("a JSONL line nested 200,000 deep", ["--dataset", "{tmp}/deep.jsonl"], "deep.jsonl:1: not valid JSON (nested "
     "too deep)"),
    ("a JSONL number of 5,000 digits", ["--dataset", "{tmp}/long_number.jsonl"],
     "long_number.jsonl:1: not valid JSON (a number of more than 4300 digits)"),
    ("`--seed 99999999999999999999999`", ["--seed", "99999999999999999999999"],
     "--seed 99999999999999999999999: must be in [0, 2**63)"),
    ("a `--run-name` of 300 characters", ["--run-name", "x" * 300],
     "--run-name: 300 bytes, longer than the 255 that a folder name may have here"),
    ("`--temperature 1e-45`", ["--temperature", "1e-45"], "--temperature 1e-45: must be >= 0.01"),
    ("`--beta inf`", ["--beta", "inf"], "--beta inf: must be a finite number"),
    ("`--target-kl nan` (ppo.py)", ["ppo.py", "--target-kl", "nan"], "--target-kl nan: must be a finite number"),
    ("`--no-eos-score inf` (ppo.py)", ["ppo.py", "--no-eos-score", "inf"], "--no-eos-score inf: must be a finite "
     "number"),
    ("a `--reward-fn` that returns a dict", ["--reward-fn", "{tmp}/user_rewards.py:as_dict"],
     "must return a list of one finite float per completion (2), got {0: 1.0, 1: 1.0}"),
    ("a `--reward-fn` that empties the list it was given", ["--reward-fn", "{tmp}/user_rewards.py:emptied"],
     "must return a list of one finite float per completion (2), got []"),
]

# Inputs found later, each with its own test below: (input, the start of the message).
LATER = {
    "shapes": ("same weight names with other shapes at `--resume`",
               "cannot restore it: Size mismatch between saved torch.Size"),
    "ctrl-c": ("Ctrl-C", "stopped (Ctrl-C). Last checkpoint: "),
    "timeout": ("a rank that stops answering, or a very slow `--reward-fn` on one rank",
                "waited more than --dist-timeout 0.2 minutes for another rank"),
    "round-trip": ("a tokenizer that does not give the prompts back (a warning; the run goes on)",
                   "warning: the tokenizer of --model (TokenizersBackend) does not give the prompts back"),
    "link": ("a symbolic link in the run folder (`config.json`, `metrics.jsonl`, `.run.lock`, even dangling)",
             "is a symbolic link: a run folder holds none (a write through it would land elsewhere)"),
    "fifo": ("`metrics.jsonl` a FIFO (or a device, or a hard link) in a run folder of this project",
             "is not a plain file of its own (a link, or a device): a run folder holds none"),
    "foreign": ("`--output-dir`/`--run-name` a folder that holds files this project did not write",
                "holds files that are not a run's of this project (config.json)"),
    "metrics": ("a bad complete line in `metrics.jsonl` (not JSON, a list, no step, NUL or non-UTF-8 bytes)",
                "metrics.jsonl:2: not a line this project writes"),
    "info": ("a damaged `checkpoint.json` (a field missing, the config a list, the step '3' or 2.5)",
             "checkpoint.json is damaged"),
    "outside": ("a shard of the resumable state that is a link (to a file outside the checkpoint)",
                "cannot restore it: training_state/<shard>: a link"),
    "shard": ("a 0-byte or raw-pickle shard",
              "cannot restore it: training_state/<shard>: not a complete safetensors file"),
    "full": ("a full disk while `--resume latest` cuts `metrics.jsonl` back to the checkpoint's step",
             "metrics.jsonl: cannot write the lines before step 4 (No space left on device"),
    "exit": ("a `--reward-fn` that calls `sys.exit(0)`",
             "called sys.exit(0). A reward function must return its values"),
}

# Inputs that are handled rather than refused: (input, what happens), each with its test below.
HANDLED = [
    ("a `--model` that needs custom code, answered 'y' on standard input",
     "the code is not run: every load passes `trust_remote_code=False`"),
    ("a `json.py` (or any module) in the working directory of a run on math data",
     "not imported: the math grader's process runs with `python -I` (isolated)"),
    ("a run killed after logging a step, before its first checkpoint, run again with the same name",
     "starts over in its folder; what it logged is kept in `metrics.jsonl.old`"),
    ("`--resume latest` in a copied or moved repository, on the default model",
     "goes on: the default model is recorded as `tiny_model`, relative to the repository"),
    ("control characters (ANSI escapes) in a flag value of `checkpoint.json`",
     "printed escaped (`repr`) in the 'flags changed' line"),
    ("a `--reward-fn` that hangs",
     "no deadline: it runs in the training process, where it may hold a model or a connection. Under torchrun "
     "the other ranks stop after `--dist-timeout`; on one process, Ctrl-C stops it. Give its own calls a timeout"),
]


def make_inputs(tmp: Path) -> None:
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(20)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "latin1.jsonl").write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xe9", "answer": "1"}\n')
    rows[5]["prompt"] = "What is 8*8? Put the final answer in \\boxed{}."  # capitals, '\', '{': unknown to it
    (tmp / "capitals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "a_file").write_text("")
    (tmp / "read_only").mkdir()
    (tmp / "read_only").chmod(0o555)
    shutil.copytree(common.DEFAULT_MODEL, tmp / "truncated")
    weights = (tmp / "truncated" / "model.safetensors").read_bytes()
    (tmp / "truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    shutil.copytree(common.DEFAULT_MODEL, tmp / "config_list")
    (tmp / "config_list" / "config.json").write_text("[1, 2]")
    make_custom_code_model(tmp / "custom_code", tmp / "code-ran")
    make_pickled_model(tmp / "pickled_bin", tmp / "code-ran")
    shutil.copytree(common.DEFAULT_MODEL, tmp / "bad_template")
    (tmp / "bad_template" / "chat_template.jinja").write_text("{{ raise_exception('no template here') }}")
    (tmp / "script_data").mkdir()
    (tmp / "script_data" / "script_data.py").write_text(f"open({str(tmp / 'code-ran')!r}, 'w')\n")
    (tmp / "empty_prompts.jsonl").write_text("".join(json.dumps({"prompt": "", "answer": "1"}) + "\n"
                                                     for _ in range(20)))
    (tmp / "deep.jsonl").write_text("[" * 200_000 + "]" * 200_000 + "\n")
    (tmp / "long_number.jsonl").write_text('{"prompt": "1+1", "answer": ' + "9" * 5000 + "}\n")
    (tmp / "user_rewards.py").write_text(USER_REWARDS)


USER_REWARDS = """
def as_dict(prompts, completions, answers):
    return {i: 1.0 for i in range(len(completions))}

def emptied(prompts, completions, answers):
    completions.clear()
    return []
"""


def make_custom_code_model(folder: Path, marker: Path) -> None:
    """The tiny model, its config naming an architecture transformers does not have and, in `auto_map`, a
    Python file beside it that would define it: loading it would run that file, which leaves `marker`."""
    shutil.copytree(common.DEFAULT_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mine", auto_map={"AutoConfig": "mine.MineConfig", "AutoModelForCausalLM": "mine.Mine"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "mine.py").write_text(f"open({str(marker)!r}, 'w')\nfrom transformers import Qwen3Config\n"
                                    "class MineConfig(Qwen3Config):\n    model_type = 'mine'\n")


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

    shutil.copytree(common.DEFAULT_MODEL, folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**weights, "extra": Payload(marker)}, folder / "pytorch_model.bin")


@pytest.mark.parametrize("what, argv, message", AT_START_UP, ids=[row[0] for row in AT_START_UP])
def test_bad_input_stops_at_start_up_with_one_line(tmp_path, what, argv, message):
    if "not writable" in what and os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    make_inputs(tmp_path)
    module = importlib.import_module(argv[0][:-3]) if argv[0].endswith(".py") else grpo
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv if not arg.endswith(".py")]
    if "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "runs")]
    with pytest.raises(UsageError) as stop:
        module.main(cli(module.Args, args=argv))
    assert "\n" not in str(stop.value)  # one line
    assert message in str(stop.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "read_only" / "runs").exists()  # nothing written
    assert not (tmp_path / "code-ran").exists()  # no code from a model or data folder ran


def small(tmp_path: Path, *more: str, steps: int = 4) -> list[str]:
    return ["grpo.py", "--num-steps", str(steps), "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
            "--output-dir", str(tmp_path / "runs"), *more]


def test_resume_into_weights_of_other_shapes_stops(tmp_path):
    """The same --model path, now holding a model whose weights have the same names and other shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tmp_path / "model"
    shutil.copytree(common.DEFAULT_MODEL, model)
    args = small(tmp_path, "--model", str(model), "--run-name", "r", "--save-every", "2")
    grpo.main(cli(grpo.Args, args=small(tmp_path, "--model", str(model), "--run-name", "r", "--save-every", "2",
                                             steps=2)[1:]))
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
    args = small(tmp_path, "--run-name", "stopped", "--save-every", "2",
                 "--reward-fn", f"{tmp_path / 'slow.py'}:reward", steps=6)
    proc = subprocess.Popen([sys.executable, str(ROOT / args[0]), *args[1:]], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
    result = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "stopped")] == list(range(6))


SLOW_ON_RANK_1 = """
import os, time
def reward(prompts, completions, answers):
    if len(completions) > 2 and os.environ["RANK"] == "1":  # not the start-up check of 2 rows: the first rollout
        time.sleep(900)
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_named_after_dist_timeout(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_ON_RANK_1)
    start = time.time()
    result = run(small(tmp_path, "--reward-fn", f"{tmp_path / 'slow.py'}:reward", "--dist-timeout", "0.2"),
                 cwd=tmp_path, torchrun=2)
    assert result.returncode != 0
    assert f"error: rank 0 {LATER['timeout'][1]}" in result.stderr, result.stderr[-3000:]
    assert time.time() - start < 600  # stopped by the timeout (12 s), not by the slow rank finishing (900 s)


def test_a_tokenizer_that_does_not_round_trip_is_named(tmp_path, capsys):
    """A word-level tokenizer that maps the space to its unknown token: '1 + 1' comes back as '1<unk>+<unk>1'."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = common.load_tokenizer(common.DEFAULT_MODEL)
    vocab = {token: i for token, i in tokenizer.get_vocab().items() if token != " "}
    vocab.setdefault("<unk>", max(vocab.values()) + 1)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    other = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token)
    common.check_round_trip(other, [{"prompt": "12+3"}, {"prompt": "1 + 1"}])
    out = capsys.readouterr().out
    assert out.startswith(LATER["round-trip"][1]) and "'1 + 1' comes back as '1<unk>+<unk>1'" in out
    common.check_round_trip(tokenizer, [{"prompt": "1 + 1"}])  # the shipped tokenizer: silent
    assert capsys.readouterr().out == ""


def test_eval_size_0_without_evaluation_trains_on_every_row(tmp_path):
    make_inputs(tmp_path)
    argv = small(tmp_path, "--dataset", str(tmp_path / "train.jsonl"), "--eval-size", "0", "--run-name", "all")
    grpo.main(cli(grpo.Args, args=argv[1:]))
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "all")] == [0, 1, 2, 3]


def test_non_finite_metrics_are_written_as_null(tmp_path):
    (tmp_path / "run").mkdir()
    logger = common.Logger(tmp_path / "run", None, {}, rank=0)
    logger.log(0, {"loss/policy": float("nan"), "policy/grad_norm": float("inf"), "reward/mean": 0.5})
    logger.close()
    line = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert json.loads(line) == {"step": 0, "loss/policy": None, "policy/grad_norm": None, "reward/mean": 0.5}


def test_healthy_runs_print_no_alarming_noise(tmp_path, capfd):
    """ppo.py's critic backbone from an untied causal LM (its unused LM head used to print a LOAD REPORT
    table), and dapo.py's statistics of a step where dynamic sampling kept no group (a std() warning)."""
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    import dapo
    import ppo

    untied = tmp_path / "untied"
    model = AutoModelForCausalLM.from_pretrained(common.DEFAULT_MODEL, tie_word_embeddings=False)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(untied)
    common.load_tokenizer(common.DEFAULT_MODEL).save_pretrained(untied)
    never = tmp_path / "never.jsonl"  # every answer is wrong: every group has zero variance and is filtered out
    never.write_text("".join(json.dumps({"prompt": f"{a}+{a}", "answer": "never"}) + "\n" for a in range(10, 40)))
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ppo.main(cli(ppo.Args, args=small(tmp_path, "--model", str(untied), steps=1)[1:]))
        dapo.main(cli(dapo.Args, args=small(tmp_path, "--dataset", str(never), "--eval-size", "4",
                                                 "--max-gen-rounds", "1", steps=1)[1:]))
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "UNEXPECTED" not in out + err
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
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() and not p.is_symlink() else b""
            for p in sorted(folder.rglob("*"))}


def resume(tmp_path: Path, checkpoint: str = "latest", *more: str, steps: int = 8, module=grpo):
    argv = small(tmp_path, "--run-name", "r", "--save-every", "2", "--resume", checkpoint, *more, steps=steps)[1:]
    return module.main(cli(module.Args, args=argv))


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl"])
@pytest.mark.parametrize("how", ["latest", "step_2"])
def test_a_link_in_the_run_folder_is_never_written_through(tmp_path, finished_run, name, how):
    run_dir = copy_run(finished_run, tmp_path)
    outside = tmp_path / "someone_elses_file"
    outside.write_bytes((run_dir / name).read_bytes())
    (run_dir / name).unlink()
    (run_dir / name).symlink_to(outside)
    before = listing(run_dir)
    with pytest.raises(UsageError) as stop:
        resume(tmp_path, "latest" if how == "latest" else str(run_dir / "step_2"))
    assert f"{run_dir / name} {LATER['link'][1]}" in str(stop.value) and "\n" not in str(stop.value)
    assert outside.read_bytes() == (finished_run / name).read_bytes()
    assert listing(run_dir) == before


def test_a_dangling_lock_link_creates_nothing_outside(tmp_path):
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / ".run.lock").symlink_to(tmp_path / "created_outside")
    with pytest.raises(UsageError, match=re.escape(f"{common.RUN_LOCK} {LATER['link'][1]}")):
        grpo.main(cli(grpo.Args, args=small(tmp_path, "--run-name", "r", steps=1)[1:]))
    assert not (tmp_path / "created_outside").exists()


def test_a_metrics_file_that_is_not_a_plain_file_is_refused_without_blocking(tmp_path):
    """A FIFO as metrics.jsonl in a run folder of this project (reading it would wait for a writer forever)."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / common.RUN_LOCK).touch()
    os.mkfifo(run_dir / "metrics.jsonl")
    result = run(small(tmp_path, "--run-name", "r", steps=1), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert f"{run_dir / 'metrics.jsonl'} {LATER['fifo'][1]}" in result.stderr.splitlines()[-1]


def test_a_folder_holding_someone_elses_files_is_not_taken(tmp_path):
    app = tmp_path / "v" / "app"
    app.mkdir(parents=True)
    (app / "config.json").write_text('{"port": 8080}')
    argv = small(tmp_path, "--output-dir", str(tmp_path / "v"), "--run-name", "app", steps=1)[1:]
    with pytest.raises(UsageError, match=re.escape(f"{app} {LATER['foreign'][1]}")):
        grpo.main(cli(grpo.Args, args=argv))
    assert [p.name for p in app.iterdir()] == ["config.json"] and (app / "config.json").read_text() == '{"port": 8080}'


def a_shard(checkpoint: Path) -> Path:
    return sorted((checkpoint / common.TRAINING_STATE).glob("*.safetensors"))[0]


def test_a_shard_that_is_a_link_is_refused(tmp_path, finished_run):
    run_dir = copy_run(finished_run, tmp_path)
    shard = a_shard(run_dir / "step_6")
    shutil.copy(shard, tmp_path / "elsewhere.safetensors")
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere.safetensors")  # what is read could only come from outside
    with pytest.raises(UsageError, match=re.escape(f"step_6: {LATER['outside'][1]}".replace("<shard>", shard.name))):
        resume(tmp_path)


@pytest.mark.parametrize("damage", ["empty", "raw pickle"])
def test_a_damaged_shard_is_named_with_its_cause(tmp_path, finished_run, damage):
    run_dir = copy_run(finished_run, tmp_path)
    shard = a_shard(run_dir / "step_6")
    shard.write_bytes(b"" if damage == "empty" else pickle.dumps({"weights": [1.0, 2.0]}))
    with pytest.raises(UsageError) as stop:
        resume(tmp_path)
    message, named = str(stop.value), LATER["shard"][1].replace("<shard>", shard.name)
    assert named in message and "\n" not in message
    assert len(message.split(named)[1]) > 10, message  # the cause follows


def test_a_run_killed_before_its_first_checkpoint_starts_over(tmp_path):
    """Killed after logging steps 0 and 1, before any checkpoint: the same command again runs, in that folder."""
    argv = small(tmp_path, "--run-name", "r", steps=2)[1:]
    grpo.main(cli(grpo.Args, args=argv))
    run_dir = tmp_path / "runs" / "r"
    shutil.rmtree(run_dir / "final")  # as if killed before the end
    logged = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(UsageError, match="no checkpoint under .* Run it again without --resume: it starts over"):
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


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b'{"x": 1}', b'{"step": "1"}', b"\x00\x00", b"\xff"],
                         ids=["not-json", "list", "no-step", "step-text", "nul", "0xff"])
def test_a_bad_metrics_line_stops_a_resume_with_one_line(tmp_path, finished_run, line):
    run_dir = copy_run(finished_run, tmp_path)
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_bytes(lines[0] + line + b"\n" + b"".join(lines[1:]))
    before = listing(run_dir)
    for checkpoint in ("latest", str(run_dir / "step_4")):
        with pytest.raises(UsageError, match=re.escape(f"{run_dir / 'metrics.jsonl'}:2: not a line this project")):
            resume(tmp_path, checkpoint)
    with pytest.raises(UsageError, match="already holds a run"):  # a new run of that name: the usual refusal
        grpo.main(cli(grpo.Args, args=small(tmp_path, "--run-name", "r", steps=1)[1:]))
    assert listing(run_dir) == before


@pytest.mark.parametrize("damage", ["no algorithm", "no model", "no step", "no world_size", "config a list",
                                    "step '3'", "step 2.5", "not an object"])
def test_a_damaged_checkpoint_info_stops_before_anything_moves(tmp_path, finished_run, damage):
    run_dir = copy_run(finished_run, tmp_path)
    info_file = run_dir / "step_2" / common.CHECKPOINT_INFO
    info = json.loads(info_file.read_text())
    key = damage.split()[1]
    if damage.startswith("no "):
        del (info["config"] if key == "model" else info)[key]
    elif damage == "config a list":
        info["config"] = list(info["config"])
    elif damage.startswith("step "):
        info["step"] = json.loads(key.replace("'", '"'))
    else:
        info = [info]
    info_file.write_text(json.dumps(info))
    before = listing(run_dir)
    with pytest.raises(UsageError) as stop:
        resume(tmp_path, str(run_dir / "step_2"))
    assert f"{info_file.parent}/{LATER['info'][1]}" in str(stop.value) and "\n" not in str(stop.value)
    assert listing(run_dir) == before


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MB file system of its own (tmpfs), to be filled up; mounting one needs root."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small file system needs root")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_during_a_resume_leaves_the_folder_as_it_was(tmp_path, finished_run, small_disk):
    shutil.copytree(finished_run, small_disk / "runs" / "r")
    run_dir = small_disk / "runs" / "r"
    shutil.rmtree(run_dir / "step_6")  # as if killed after logging step 5: the resume cuts steps 4 and 5 off
    shutil.rmtree(run_dir / "final")
    with open(small_disk / "filler", "wb", buffering=0) as filler:  # every block of the disk taken
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass
    before = listing(run_dir)
    argv = small(small_disk, "--run-name", "r", "--save-every", "2", "--resume", "latest", steps=8)
    with pytest.raises(UsageError, match=re.escape(LATER["full"][1])):
        grpo.main(cli(grpo.Args, args=argv[1:]))
    assert listing(run_dir) == before


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
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --reward-fn '{tmp_path / 'exits.py'}:reward' "
                                                             f"{LATER['exit'][1]}"), result.stderr


def test_control_characters_in_a_checkpoints_flags_are_printed_escaped(tmp_path, finished_run, capsys):
    run_dir = copy_run(finished_run, tmp_path)
    info_file = run_dir / "step_6" / common.CHECKPOINT_INFO
    info = json.loads(info_file.read_text())
    info["config"]["dataset_config"] = "\x1b[2J\x1b[31mall clear"
    info_file.write_text(json.dumps(info))
    capsys.readouterr()
    resume(tmp_path)
    out = capsys.readouterr().out
    assert "--dataset-config '\\x1b[2J\\x1b[31mall clear' -> None" in out and "\x1b" not in out


def test_the_math_grader_does_not_import_from_the_working_directory(tmp_path, monkeypatch):
    from common import MathVerifier

    (tmp_path / "json.py").write_text(f"open({str(tmp_path / 'code-ran')!r}, 'w')\nfrom _json import *\n")
    monkeypatch.chdir(tmp_path)
    verifier = MathVerifier()
    try:
        assert verifier("$\\frac{1}{2}$", "\\boxed{0.5}")
    finally:
        if verifier.child is not None:
            verifier._stop()
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.slow
def test_code_in_a_model_folder_never_runs_even_when_the_answer_is_yes(tmp_path):
    """transformers asks "Do you wish to run the custom code?" when trust_remote_code is left unset."""
    make_custom_code_model(tmp_path / "custom_code", tmp_path / "code-ran")
    argv = small(tmp_path, "--model", str(tmp_path / "custom_code"), steps=1)
    result = subprocess.run([sys.executable, str(ROOT / argv[0]), *argv[1:]], cwd=tmp_path, input="y\n" * 10,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and not (tmp_path / "code-ran").exists(), result.stderr
    assert AT_START_UP_MESSAGES["custom_code"] in result.stderr


AT_START_UP_MESSAGES = {argv[1].rsplit("/", 1)[-1]: message for _, argv, message in AT_START_UP if len(argv) > 1}


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
