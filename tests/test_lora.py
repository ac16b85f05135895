"""--lora-rank: LoRA adapters (peft) trained instead of the whole model. Hu et al., "LoRA: Low-Rank
Adaptation of Large Language Models", arXiv:2106.09685: an adapted weight is W + (alpha / r) B A, with A
(r x in) random, B (out x r) zero at the start, so the adapted model starts as the base model, and only A
and B are trained. The reference model is then the policy with its adapters off (no second copy); step
checkpoints hold the adapters and their optimizer state; final/ holds the merged model, which loads
anywhere, and the adapters in final/adapter/ for PeftModel.from_pretrained."""

import copy
import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import format_prompt, generate, get_logprobs
from conftest import ALGORITHMS, read_metrics, run
from harness import DEFAULT_MODEL, add_lora, cli, load_model, load_reference, load_tokenizer, plain_weights

peft = pytest.importorskip("peft")  # tests/requirements.txt installs it
CPU = torch.device("cpu")
LORA = ["--lora-rank", "8", "--lora-alpha", "16"]


def lora_policy(seed: int = 0):
    """The default model with rank-8 adapters whose B is random (not peft's zeros), so that they change it."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = add_lora(load_model(DEFAULT_MODEL, "float32", CPU, tokenizer), 8, 16.0, "all-linear")
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model, tokenizer


def test_without_peft_the_flag_says_how_to_install_it(monkeypatch):
    import sys

    from common import UsageError

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(UsageError, match="^--lora-rank needs peft: pip install peft$"):
        add_lora(torch.nn.Linear(2, 2), 8, 16.0, "all-linear")
    assert add_lora(model := torch.nn.Linear(2, 2), 0, 16.0, "all-linear") is model  # rank 0: not needed


def test_only_the_adapters_train_and_they_start_at_zero():
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = add_lora(load_model(DEFAULT_MODEL, "float32", CPU, tokenizer), 8, 16.0, "all-linear")
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}
    assert len({name.rsplit(".lora_", 1)[0] for name in trained}) == 2 * 7  # q k v o gate up down, 2 layers
    assert all((p == 0).all() for name, p in model.named_parameters() if "lora_B" in name)
    assert not any("lm_head" in name for name in trained)  # all-linear: the transformer blocks only


def test_plain_weights_are_peft_merge_and_unload():
    model, _ = lora_policy()
    ours = dict(plain_weights(model))
    theirs = copy.deepcopy(model).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6)
    assert not torch.equal(
        ours["model.layers.0.self_attn.q_proj.weight"],
        model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
    )


def test_the_reference_is_the_base_model_without_a_copy():
    """load_reference with LoRA: the policy with its adapters off, a function; it gives the log-probs of the model
    as loaded, while the policy's own differ."""
    model, tokenizer = lora_policy()
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67", "99+9")]
    rollout = generate(model, tokenizer, prompts, 4, 8, 1.0)
    args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0)
    adapters_off = load_reference(None, model, tokenizer, CPU)  # args: read only without LoRA
    base = load_model(DEFAULT_MODEL, "float32", CPU, tokenizer)
    with torch.no_grad():
        expected, _ = get_logprobs(base, *args)
        reference, _ = get_logprobs(adapters_off, *args)
        policy, _ = get_logprobs(model, *args)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-6)
    assert (policy - expected).abs().max() > 1e-2
    assert not isinstance(adapters_off, torch.nn.Module) and vars(adapters_off).keys() == {"module"}  # no weights
    assert adapters_off.module is model


def lora_run(tmp_path: Path, algo: str, name: str, *flags: str, torchrun: int = 0) -> Path:
    """A short LoRA run of `algo`: in this process (one rank), or launched by torchrun on `torchrun` ranks."""
    args = [
        *LORA,
        "--num-steps",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--learning-rate",
        "2e-3",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        *flags,
    ]
    if not torchrun:
        module = importlib.import_module(algo)
        module.main(cli(module.Args, args=args))
        return tmp_path / name
    result = run([f"{algo}.py", *args], cwd=tmp_path, torchrun=torchrun)
    assert result.returncode == 0, result.stderr
    return tmp_path / name


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's own call
def test_what_a_lora_run_leaves(tmp_path):
    """Step checkpoints: the adapters and their optimizer state, no model weights. final/: the merged
    model, which plain transformers loads, and adapter/, which peft loads onto the base model: the two give
    the same log-probs."""
    from transformers import AutoModelForCausalLM

    folder = lora_run(tmp_path, "grpo", "r", "--save-every", "1")
    assert not (folder / "step_1" / "model.safetensors").exists()
    state = {k for f in (folder / "step_1" / "training_state").glob("*.safetensors") for k in load_file(f)}
    assert state and all(".lora_" in k for k in state), sorted(state)[:4]  # adapters and their Adam moments
    base = sum(p.numel() for p in load_file(Path(DEFAULT_MODEL) / "model.safetensors").values())
    adapters = sum(
        v.numel() for f in (folder / "step_1" / "training_state").glob("*.safetensors") for v in load_file(f).values()
    )
    assert adapters < 0.3 * base  # rank 8 of a 128-wide model: the adapters and 2 moments, ~27%

    result = run(["grpo.py", "--model", str(folder / "step_1"), "--output-dir", str(tmp_path)], cwd=tmp_path)
    assert (
        result.returncode == 2
        and "a step checkpoint of a LoRA run holds its adapters (adapter/), not a model. "
        "Go on with --resume, or start from the run's final/"
        in result.stderr
    ), result.stderr

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    merged = AutoModelForCausalLM.from_pretrained(folder / "final")
    adapted = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL), folder / "final" / "adapter"
    )
    prompts = [format_prompt(tokenizer, p, True) for p in ("1+2", "45+67")]
    rollout = generate(merged, tokenizer, prompts, 4, 8, 1.0)
    args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0)
    with torch.no_grad():
        torch.testing.assert_close(get_logprobs(merged, *args)[0], get_logprobs(adapted, *args)[0], rtol=0, atol=1e-5)
        original = get_logprobs(AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL), *args)[0]
    assert (original - get_logprobs(merged, *args)[0]).abs().max() > 1e-4  # the adapters were trained


def adapters(folder: Path) -> dict:
    return load_file(folder / "final" / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow
def test_two_ranks_micro_batches_and_fsdp_give_the_same_adapters(tmp_path, mixed_dataset):
    """As test_runs.test_two_ranks_and_micro_batches_give_the_same_update, for the adapters: 1 process,
    2 DDP ranks, 4 micro-batches, 2 FSDP ranks, and gradient checkpointing give the same trained adapters."""
    from test_runs import max_relative_difference, one_step

    one_step(tmp_path, "grpo", "one", mixed_dataset, [*LORA, "--micro-batch-size", "32"])
    base = adapters(tmp_path / "one")
    assert max(v.abs().max().item() for k, v in base.items() if "lora_B" in k) > 0  # B moved from zero
    for name, extra, torchrun in [
        ("ddp", ["--micro-batch-size", "16"], 2),
        ("micro", ["--micro-batch-size", "8"], 0),
        ("fsdp", ["--micro-batch-size", "8", "--fsdp"], 2),
        ("ckpt", ["--micro-batch-size", "32", "--gradient-checkpointing"], 0),
    ]:
        one_step(tmp_path, "grpo", name, mixed_dataset, [*LORA, *extra], torchrun)
        difference = max_relative_difference(base, adapters(tmp_path / name))
        print(json.dumps({"mode": name, "max_relative_difference": difference}))
        assert difference <= 1e-5, name


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one", "ddp", "fsdp"])
def test_a_lora_run_resumed_from_a_checkpoint_matches(tmp_path, mode):
    """Cut back to its step-2 checkpoint (adapters, optimizer state, RNG) and resumed, a LoRA run ends with
    the adapters and metrics of the run that went through, bitwise. It evaluates at steps 0 and 3: with FSDP, greedy
    single completions (peft's generate, which skips the root's FSDP hooks) before any other forward and after."""
    import shutil

    from test_resume import without_timings

    flags = [
        "--num-steps",
        "4",
        "--save-every",
        "2",
        "--eval-every",
        "3",
        "--eval-size",
        "4",
        *(["--fsdp"] if mode == "fsdp" else []),
    ]
    torchrun = 0 if mode == "one" else 2
    lora_run(tmp_path, "grpo", "whole", *flags, torchrun=torchrun)
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    for name in ["final", "step_4"]:
        shutil.rmtree(tmp_path / "cut" / name)
    lora_run(tmp_path, "grpo", "cut", *flags, "--resume", "latest", torchrun=torchrun)
    whole, resumed = adapters(tmp_path / "whole"), adapters(tmp_path / "cut")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert without_timings(read_metrics(tmp_path / "cut")) == without_timings(read_metrics(tmp_path / "whole"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo, flags",
    [(algo, []) for algo in ALGORITHMS] + [("gvpo", ["--reuse-steps", "1"])],
    ids=ALGORITHMS + ["gvpo-reuse"],
)
def test_every_file_trains_with_lora(tmp_path, algo, flags):
    """Two steps of each file with adapters (PPO's critic trains in full, GVPO may replay groups); where the
    file has a reference model (GRPO's KL, PPO's KL reward) it is the policy with its adapters off, so the
    KL of the first update (one per step here) is 0."""
    folder = lora_run(
        tmp_path, algo, "r", "--eval-every", "2", "--eval-size", "16", "--updates-per-rollout", "1", *flags
    )
    metrics = read_metrics(folder)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    if "loss/kl" in metrics[0]:
        assert metrics[0]["loss/kl"] == pytest.approx(0, abs=1e-6)
    assert (folder / "final" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_grpo_learns_the_default_task_with_lora(tmp_path):
    """As test_runs.test_learns_the_default_task, training rank-8 adapters at --learning-rate 2e-3 (10x full
    fine-tuning's: the adapters start at zero and are few) for 20 steps. Measured (seed 1): 0.386 -> 0.626 at
    step 50, 0.68 at step 100; with 1 thread (2026-12-05, tests/conftest.py) 0.502 / 0.536 / 0.594 / 0.626 at
    steps 10 / 20 / 30 / 50: +0.15 at step 20."""
    result = run(
        [
            "grpo.py",
            *LORA,
            "--learning-rate",
            "2e-3",
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
    assert result.returncode == 0, result.stderr
    evals = [m for m in read_metrics(tmp_path / "learn") if "eval/accuracy" in m]
    start, end = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(json.dumps({"start": start, "end": end, "greedy": [e["eval/accuracy_greedy"] for e in evals]}))
    assert end - start >= 0.12, (start, end)
