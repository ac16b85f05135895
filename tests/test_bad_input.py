"""Bad input: every row below ends with one line naming the flag, file or path and what to do, a non-zero
exit, and nothing written that would block a rerun. The table in docs/bad_input.md is generated from
these rows (`PYTHONPATH=. python tests/test_bad_input.py > docs/bad_input.md`) and checked against them here."""

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import data
import grpo
import models
import runs
from common import UsageError, cli
from conftest import ROOT, read_metrics, run

# (input, grpo.py's arguments, or another file's after its name, the start of the message). Each stops
# at start-up. "{tmp}" is the test's folder, where `make_inputs` writes the bad files; runs go to
# {tmp}/runs unless a row says.
AT_START_UP = [
    ("`--max-new-tokens 0`", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    ("`--temperature 0`", ["--temperature", "0"], "--temperature 0.0: must be > 0 (the log-probs divide the logits"),
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
}


def make_inputs(tmp: Path) -> None:
    rows = [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(20)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "latin1.jsonl").write_bytes(b'{"prompt": "1+1", "answer": "2"}\n{"prompt": "\xe9", "answer": "1"}\n')
    rows[5]["prompt"] = "What is 8*8? Put the final answer in \\boxed{}."  # capitals, '\', '{': unknown to it
    (tmp / "capitals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "a_file").write_text("")
    (tmp / "read_only").mkdir()
    (tmp / "read_only").chmod(0o555)
    shutil.copytree(models.DEFAULT_MODEL, tmp / "truncated")
    weights = (tmp / "truncated" / "model.safetensors").read_bytes()
    (tmp / "truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    shutil.copytree(models.DEFAULT_MODEL, tmp / "config_list")
    (tmp / "config_list" / "config.json").write_text("[1, 2]")


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


def small(tmp_path: Path, *more: str, steps: int = 4) -> list[str]:
    return ["grpo.py", "--num-steps", str(steps), "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0",
            "--output-dir", str(tmp_path / "runs"), *more]


def test_resume_into_weights_of_other_shapes_stops(tmp_path):
    """The same --model path, now holding a model whose weights have the same names and other shapes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = tmp_path / "model"
    shutil.copytree(models.DEFAULT_MODEL, model)
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

    tokenizer = models.load_tokenizer(models.DEFAULT_MODEL)
    vocab = {token: i for token, i in tokenizer.get_vocab().items() if token != " "}
    vocab.setdefault("<unk>", max(vocab.values()) + 1)
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    other = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token)
    data.check_round_trip(other, [{"prompt": "12+3"}, {"prompt": "1 + 1"}])
    out = capsys.readouterr().out
    assert out.startswith(LATER["round-trip"][1]) and "'1 + 1' comes back as '1<unk>+<unk>1'" in out
    data.check_round_trip(tokenizer, [{"prompt": "1 + 1"}])  # the shipped tokenizer: silent
    assert capsys.readouterr().out == ""


def test_eval_size_0_without_evaluation_trains_on_every_row(tmp_path):
    make_inputs(tmp_path)
    argv = small(tmp_path, "--dataset", str(tmp_path / "train.jsonl"), "--eval-size", "0", "--run-name", "all")
    grpo.main(cli(grpo.Args, args=argv[1:]))
    assert [m["step"] for m in read_metrics(tmp_path / "runs" / "all")] == [0, 1, 2, 3]


def test_non_finite_metrics_are_written_as_null(tmp_path):
    (tmp_path / "run").mkdir()
    logger = runs.Logger(tmp_path / "run", {}, rank=0)
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
    model = AutoModelForCausalLM.from_pretrained(models.DEFAULT_MODEL, tie_word_embeddings=False)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(untied)
    models.load_tokenizer(models.DEFAULT_MODEL).save_pretrained(untied)
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


def docs_table() -> str:
    lines = ["| input | message (its start) |", "|---|---|"]
    for what, argv, message in AT_START_UP:
        lines.append(f"| {what} | `{message} ...` |")
    for what, message in LATER.values():
        lines.append(f"| {what} | `{message} ...` |")
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
