"""grpo.py end to end: smoke runs, data-parallel equivalence, bad input, faults, and learning."""

import importlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo
from common import UsageError
from conftest import ALGORITHMS, read_metrics, run
from harness import DEFAULT_MODEL

pytestmark = pytest.mark.slow  # whole runs in subprocesses and the learning runs: `-m 'not slow'` skips them

FAST = ["--num-steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0"]


def test_smoke_two_steps(tmp_path):
    result = run(
        [
            "grpo.py",
            *FAST,
            "--eval-every",
            "1",
            "--eval-size",
            "8",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "smoke",
            "--save-every",
            "1",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "smoke")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in [
        "reward/mean",
        "reward/std",
        "reward/correct",
        "response/length_mean",
        "response/truncated_frac",
        "loss/policy",
        "loss/kl",
        "policy/entropy",
        "policy/approx_kl",
        "policy/clipfrac",
        "policy/grad_norm",
        "perf/step_s",
        "perf/gen_s",
        "perf/tokens_per_s",
        "perf/peak_mem_gb",
        "eval/accuracy",
        "eval/accuracy_greedy",
    ]:
        assert key in metrics[0], key
    # Progress on each step line: step/total, the elapsed time, and an ETA while steps are left.
    clock = r"\d+:\d\d:\d\d"
    assert re.search(rf"^step    0/2 \| reward/mean .* \| {clock} elapsed, ETA {clock}$", result.stdout, re.M)
    assert re.search(rf"^step    1/2 \| reward/mean .* \| {clock} elapsed$", result.stdout, re.M)
    for name in ["step_1", "step_2", "final"]:
        assert (tmp_path / "smoke" / name / "model.safetensors").exists()
    assert not list((tmp_path / "smoke").glob("*.tmp"))


def test_torchrun_two_ranks_smoke(tmp_path):
    result = run(
        ["grpo.py", *FAST, "--eval-every", "2", "--output-dir", str(tmp_path), "--run-name", "ddp"],
        cwd=tmp_path,
        torchrun=2,
    )
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "ddp")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert 0 <= metrics[-1]["eval/accuracy"] <= 1
    assert result.stdout.count("step    1/2 |") == 1  # rank 0 logs, rank 1 is quiet
    assert result.stderr.count("Loading weights: 100%") == 2  # and only rank 0 shows the policy's and reference's


def test_fsdp_two_ranks_smoke(tmp_path):
    """--fsdp on 2 ranks: sampling where the ranks' completions end at different steps, an evaluation
    whose shards need different numbers of batches (513 prompts: 257 and 256, batches of 256), and a
    final checkpoint gathered from the shards that loads with from_pretrained."""
    from transformers import AutoModelForCausalLM

    result = run(
        [
            "grpo.py",
            *FAST[:6],
            "--eval-every",
            "2",
            "--eval-size",
            "513",
            "--fsdp",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "fsdp",
        ],
        cwd=tmp_path,
        torchrun=2,
    )
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "fsdp")
    assert [m["step"] for m in metrics] == [0, 1, 2] and 0 < metrics[-1]["eval/accuracy"] < 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "final")
    assert model.config.architectures == ["Qwen3ForCausalLM"]
    initial = load_file(Path(DEFAULT_MODEL) / "model.safetensors")
    assert max_relative_difference(initial, load_file(tmp_path / "fsdp" / "final" / "model.safetensors")) > 1e-4


def test_fsdp_generation_waits_for_the_slowest_rank(tmp_path):
    """Under FSDP every forward is collective: when one rank's completions end first, it keeps stepping
    with the other (synced_gpus), so the collective that follows generation meets its partner."""
    result = run(["tests/fsdp_generate.py"], cwd=tmp_path, torchrun=2, timeout=600)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["length"] < ranks[1]["length"]  # the ranks really finished at different steps
    assert ranks[0]["total"] == ranks[1]["total"] == ranks[0]["length"] + ranks[1]["length"]


def test_ranks_share_prompts_only_all_together(tmp_path):
    """A DDP or FSDP model's forward is collective, so a micro-batch's prompt runs once only where every
    rank's rows repeat a prompt (tests/shared_prompts_ranks.py: rank 0's do, rank 1's do not); then each samples
    (2 rows of each prompt, and 1): no mismatched collective, and each rank's log-probs and the averaged gradient
    are those of one process running every row whole."""
    from shared_prompts_ranks import PROMPTS, rows

    from common import get_logprobs
    from harness import load_model, load_tokenizer

    result = run(["tests/shared_prompts_ranks.py"], cwd=tmp_path, torchrun=2, timeout=600)
    assert result.returncode == 0, result.stderr
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in (0, 1)]
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "float32", torch.device("cpu"), tokenizer)
    expected = []
    for prompts in PROMPTS:
        ids, mask, P = rows(tokenizer, prompts)
        for i in range(len(ids)):  # one row at a time: nothing shared
            logprobs, _ = get_logprobs(model, ids[i : i + 1], mask[i : i + 1], P, 1.0)
            (logprobs.sum() / 2).backward()  # DDP and FSDP average the ranks' gradients
            expected.append(logprobs[0].tolist())
    grad_norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()
    for mode in ("ddp", "fsdp"):
        got = [row for figures in ranks for row in figures[mode]["logprobs"]]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)
        for figures in ranks:
            assert figures[mode]["grad_norm"] == pytest.approx(grad_norm, rel=1e-5), mode
    assert [len(figures["fsdp"]["texts"]) for figures in ranks] == [4, 2]


# A run's last lines on each rank: a collective on tensors it then drops, output still buffered, an exit
# hook that stands for Python's interpreter teardown.
LAST_LINES = """
import atexit
import torch.distributed as dist
from harness import cleanup_distributed, setup_distributed
rank, world_size, _ = setup_distributed()
table = [None] * world_size
dist.all_gather_object(table, rank)
atexit.register(print, f"rank {rank}: interpreter teardown", flush=True)
print(f"rank {rank}: done")
cleanup_distributed()
"""


def test_a_cpu_run_on_several_ranks_ends_without_interpreter_teardown(tmp_path):
    """gloo's worker threads outlive destroy_process_group where anything still holds the group (after
    FSDP, torch's DTensor caches hold its device mesh), and one still releasing the last collective's
    tensors needs the GIL; during Python's teardown that aborts the process ('terminate called without an
    active exception', exit code -6: without the guard, 3 of 6 two-rank runs of an FSDP checkpoint save
    and resume beside a busy process; with it, 0 of 6). So on CPU cleanup_distributed
    ends the process once the group is gone: exit code 0, the output flushed, and no teardown (no exit
    hook runs)."""
    script = tmp_path / "last_lines.py"
    script.write_text(LAST_LINES)
    result = run([str(script)], cwd=tmp_path, torchrun=2, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout  # the ranks share the pipe: their lines may interleave
    assert out.count("rank 0: done") == out.count("rank 1: done") == 1 and "teardown" not in out, out


def one_step(tmp_path: Path, algo: str, name: str, dataset: Path, extra: list[str], torchrun: int = 0):
    """One rollout (2 optimizer updates) with sampling pinned per prompt; returns (new weights, metrics).
    On 1 process the run is tests/pinned_run.py's, in this process (no Python start-up and imports, ~8 s);
    on ranks, the script under torchrun."""
    from pinned_run import pinned_generate

    from harness import cli

    flags = [
        "--dataset",
        str(dataset),
        "--eval-size",
        "4",
        "--num-steps",
        "1",
        "--prompts-per-step",
        "8",
        "--group-size",
        "4",
        "--eval-every",
        "0",
        "--output-dir",
        str(tmp_path),
        "--run-name",
        name,
        "--learning-rate",
        "1e-3",
        *extra,
    ]
    if torchrun:
        result = run(["tests/pinned_run.py", algo, *flags], cwd=Path(__file__).parent.parent, torchrun=torchrun)
        assert result.returncode == 0, result.stderr
    else:
        module = importlib.import_module(algo)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "generate", pinned_generate)  # what tests/pinned_run.py does
            module.main(cli(module.Args, args=flags))
    return load_file(tmp_path / name / "final" / "model.safetensors"), read_metrics(tmp_path / name)[0]


def max_relative_difference(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / a[k].norm()).item() for k in a)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_two_ranks_and_micro_batches_give_the_same_update(tmp_path, mixed_dataset, algo, monkeypatch):
    """The same global batch gives the same new weights with 1 process, 2 DDP ranks, micro-batches of 8 rows or of
    at most 220 tokens (--max-tokens-per-micro-batch: rows sorted by length), or 2 FSDP ranks (relative difference
    <= 1e-5), and the same gradient norm (which Adam's scale invariance would hide: a normaliser off by a constant
    factor changes the gradient norm, not Adam's step). Every metric logged but perf/ is the same to 1e-4: each is
    weighted by what it averages over the step's micro-batches and ranks, not a mean of micro-batch means.

    The 220-token budget takes whole groups (their prompts, 24 tokens, are longer than their responses, 3 or 4: a
    group's prompt runs once) and cuts rank 0's four (of 27, 28, 27 and 28 positions a row) into 3 micro-batches,
    rank 1's (all 28) into 4 (checked below on the batch itself): the ranks must still run as many (FSDP's forwards
    and DDP's gradient sync are collective; a hang fails at --dist-timeout) without changing the step.

    FSDP for grpo.py and ppo.py only: its lines (sharding, the update, the clip) are the shared ones, which
    tests/test_files.py keeps identical in every file, and ppo.py's critic the only sharded module of its own;
    each file's own normaliser over ranks is checked on DDP, which averages gradients as FSDP does."""
    import common

    initial = load_file(Path(DEFAULT_MODEL) / "model.safetensors")
    base, base_m = one_step(tmp_path, algo, "one", mixed_dataset, ["--micro-batch-size", "32"])
    assert max_relative_difference(initial, base) > 1e-3  # the step really moved the weights
    assert base_m.get("algo/kept_groups_frac", 1.0) == 1.0  # every group of the batch is trained on
    budget, ranks = ["--max-tokens-per-micro-batch", "220", "--dist-timeout", "2"], ["--micro-batch-size", "16"]
    cuts = set()  # with the budget, how many micro-batches rank 0's rows and rank 1's take, each rank alone

    def micro_batches(rows, mask, P, **limits):
        if limits["max_tokens"] is not None:
            cuts.add(tuple(len(common.micro_batches(rows[r * 16 : r * 16 + 16], mask, P, **limits)) for r in (0, 1)))
        return common.micro_batches(rows, mask, P, **limits)

    monkeypatch.setattr(importlib.import_module(algo), "micro_batches", micro_batches)  # in the 1-process runs
    fsdp = [("fsdp", [*ranks, "--fsdp", *budget], 2)] if algo in ("grpo", "ppo") else []
    for name, extra, torchrun in [
        ("ddp", [*ranks, *budget], 2),
        ("micro", ["--micro-batch-size", "8"], 0),
        ("budget", budget, 0),
        *fsdp,
    ]:
        new, m = one_step(tmp_path, algo, name, mixed_dataset, extra, torchrun)
        print(json.dumps({"algo": algo, "mode": name, "max_relative_difference": max_relative_difference(base, new)}))
        assert max_relative_difference(base, new) <= 1e-5, name
        assert m.keys() == base_m.keys(), name
        for key in [key for key in m if not key.startswith("perf/")]:  # (the sampler's log-prob gap, ~1e-6, is
            assert m[key] == pytest.approx(base_m[key], rel=1e-4, abs=1e-5, nan_ok=True), (name, key)  # rounding)
    assert cuts == {(3, 4)}


def test_off_policy_steps_on_two_ranks_give_the_same_updates(tmp_path, mixed_dataset):
    """--off-policy-steps 2 over 3 steps (step 2 sampled by the initial weights, trained from those after 2 steps): 1
    process, 2 DDP ranks and 2 FSDP ranks (each keeping and swapping in its own shards, the gathered ones dropped) end
    with the same weights, to the 1e-5 of one step; and not those of K = 0, so the runs do sample behind."""
    behind = ["--num-steps", "3", "--off-policy-steps", "2"]
    base, _ = one_step(tmp_path, "grpo", "one", mixed_dataset, ["--micro-batch-size", "32", *behind])
    on_policy, _ = one_step(tmp_path, "grpo", "k0", mixed_dataset, ["--micro-batch-size", "32", "--num-steps", "3"])
    assert max_relative_difference(base, on_policy) > 1e-4
    ranks = ["--micro-batch-size", "16", "--dist-timeout", "2", *behind]
    for name, extra in [("ddp", ranks), ("fsdp", [*ranks, "--fsdp"])]:
        new, _ = one_step(tmp_path, "grpo", name, mixed_dataset, extra, torchrun=2)
        assert max_relative_difference(base, new) <= 1e-5, name


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_gradient_checkpointing_gives_the_same_update(tmp_path, mixed_dataset, algo):
    """Recomputing activations in the backward pass changes memory, not the step (ppo.py: the critic's too).

    Under checkpointing transformers drops the KV cache, so each row runs whole (a plain micro-batch runs a
    prompt its rows share once: the same sums in another order, compared in float64 in test_common). So the
    reference is a plain run whose rows run whole too, at micro-batches of one row: the checkpointed run
    matches it to 1e-6 at the same micro-batches (the same sums), and at micro-batches of 16, where only
    the order in which gradients accumulate differs, to the 1e-5 of
    test_two_ranks_and_micro_batches_give_the_same_update."""
    keys = ["policy/grad_norm", "algo/value_grad_norm"] if algo == "ppo" else ["policy/grad_norm"]
    base, base_m = one_step(tmp_path, algo, "plain1", mixed_dataset, ["--micro-batch-size", "1"])
    for micro_batch_size, tolerance in [("1", 1e-6), ("16", 1e-5)]:
        new, m = one_step(
            tmp_path,
            algo,
            f"ckpt{micro_batch_size}",
            mixed_dataset,
            ["--micro-batch-size", micro_batch_size, "--gradient-checkpointing"],
        )
        assert max_relative_difference(base, new) <= tolerance, micro_batch_size
        for key in keys:
            assert m[key] == pytest.approx(base_m[key], rel=tolerance), (micro_batch_size, key)


# --- bad input: one clear message, before any training work, nothing written ---------------------


def main_fails(tmp_path, message: str, **overrides):
    args = grpo.Args(
        **{
            "num_steps": 1,
            "prompts_per_step": 4,
            "group_size": 4,
            "eval_every": 0,
            "output_dir": str(tmp_path / "runs"),
            "run_name": "bad",
            **overrides,
        }
    )
    with pytest.raises(UsageError, match=message):
        grpo.main(args)
    assert not (tmp_path / "runs").exists()  # nothing was written


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_bad_model(tmp_path):
    main_fails(tmp_path, r"--model './no/such/model': cannot load it", model="./no/such/model")
    main_fails(tmp_path, r"--model .*cannot load", model=str(tmp_path))  # a folder, but no model in it


def test_bad_dataset(tmp_path):
    main_fails(
        tmp_path,
        "train.jsonl:2: not valid JSON",
        dataset=write(tmp_path / "train.jsonl", '{"prompt": "a", "answer": "b"}\nnot json\n'),
    )
    main_fails(
        tmp_path, "train.jsonl:1: missing field answer", dataset=write(tmp_path / "train.jsonl", '{"prompt": "a"}\n')
    )
    main_fails(tmp_path, "has no examples", dataset=write(tmp_path / "train.jsonl", ""))
    main_fails(tmp_path, "no such file", dataset=str(tmp_path / "missing.jsonl"))
    main_fails(
        tmp_path,
        "too few to hold out --eval-size",
        dataset=write(tmp_path / "train.jsonl", '{"prompt": "a", "answer": "b"}\n' * 3),
    )


def test_bad_batch_sizes(tmp_path):
    main_fails(tmp_path, "--micro-batch-size must divide", micro_batch_size=3)
    main_fails(tmp_path, "--micro-batch-size must divide", micro_batch_size=32)  # larger than the batch
    main_fails(tmp_path, "--num-minibatches must divide", num_minibatches=3)
    main_fails(tmp_path, r"--group-size 1: must be >= 2 \(a group advantage needs 2 completions\)", group_size=1)


def test_fsdp_needs_ranks(tmp_path):
    main_fails(tmp_path, "--fsdp shards the model over ranks: launch with torchrun", fsdp=True)


def test_bad_reward_fn(tmp_path):
    module = tmp_path / "rewards.py"
    module.write_text(
        "def boom(p, c, a):\n    raise ValueError('bad')\ndef short(p, c, a):\n    return [0.0]\n"
        "def none(p, c, a):\n    return None\ndef nan(p, c, a):\n    return [float('nan')] * len(c)\n"
    )
    main_fails(tmp_path, "cannot import", reward_fn="no_such_module_abc:fn")
    main_fails(tmp_path, "raised ValueError: bad", reward_fn=f"{module}:boom")
    main_fails(tmp_path, "one finite float per completion", reward_fn=f"{module}:short")
    main_fails(tmp_path, "got None", reward_fn=f"{module}:none")
    main_fails(tmp_path, r"got \[nan, nan\]", reward_fn=f"{module}:nan")


def test_bad_input_message_from_the_command_line(tmp_path):
    """What a user sees: exit status 2 (as for a malformed flag) and one line naming the flag, no traceback."""
    result = run(["grpo.py", "--micro-batch-size", "7"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --micro-batch-size must divide the sequences per rank and minibatch (got 256 and 7)"
    ]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    calls = []

    def nan_from_step_two(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) > 1 else loss), metrics

    real = grpo.compute_loss
    monkeypatch.setattr(grpo, "compute_loss", nan_from_step_two)
    args = grpo.Args(
        num_steps=3,
        prompts_per_step=4,
        group_size=4,
        updates_per_rollout=1,
        eval_every=0,
        save_every=1,
        output_dir=str(tmp_path),
        run_name="nan",
    )
    with pytest.raises(UsageError, match=r"step 1: non-finite gradient norm .* Last checkpoint: .*step_1"):
        grpo.main(args)
    weights = load_file(tmp_path / "nan" / "step_1" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (tmp_path / "nan" / "final").exists() and not (tmp_path / "nan" / "step_2").exists()


# --- learning -----------------------------------------------------------------------------------


# Steps each file takes to lift held-out sampled accuracy by >= 0.12 with a margin. Measured (2026-12-05, 2 cores,
# 1 thread a run, seed 1; tests/conftest.py), accuracy from 0.386 at step 0, at steps 10 / 20 / 30 / 50:
# grpo 0.532 / 0.560 / 0.594 / 0.618, dapo 0.512 / 0.544 / 0.596 / 0.658, cispo 0.490 / 0.538 / 0.558 / 0.620,
# drgrpo 0.516 / 0.554 / 0.580 / 0.638, gspo 0.510 / 0.564 / 0.596 / 0.624, ppo 0.528 / 0.558 / 0.618 / 0.660:
# 20 steps, a rise of 0.15-0.18. gvpo 0.426 / 0.470 / 0.550 / 0.570 and rloo 0.472 / 0.486 / 0.490 / 0.572
# (their advantages are not divided by the group's std: smaller steps): 50 steps, +0.18 and +0.19. Measured
# (2026-12-06, the same way) at steps 10 / 20 / 30 / 40 / 50: dppo 0.500 / 0.524 / 0.556 / 0.588 / 0.632: 30 steps,
# +0.17; sapo 0.484 / 0.478 / 0.532 / 0.526 / 0.586 (the slowest of the clipped-or-gated files over 200 steps too:
# docs/benchmarks.md): 50 steps, +0.20.
STEPS = {
    "grpo": 20,
    "dapo": 20,
    "cispo": 20,
    "drgrpo": 20,
    "gspo": 20,
    "ppo": 20,
    "gvpo": 50,
    "rloo": 50,
    "dppo": 30,
    "sapo": 50,
}
REUSE = ("gvpo", ["--reuse-steps", "1"], 100)


@pytest.mark.parametrize(
    "algo, flags, steps", [(a, [], STEPS[a]) for a in ALGORITHMS] + [REUSE], ids=ALGORITHMS + ["gvpo-reuse"]
)
def test_learns_the_default_task(tmp_path, algo, flags, steps):
    """20-50 steps (STEPS) on the default model and task lift held-out sampled accuracy from ~0.39 to 0.54-0.57.
    Each evaluation scores 500 prompts once: its standard error is about 0.022, so the difference of
    two has ~0.031; a rise of 0.12 is about 4 of those, far outside evaluation noise.

    The run as a user types it also logs, at every step, the sampler guard of completions that the policy
    sampled itself: a gap of float rounding (measured <= 2e-6 here), never above 1e-4.

    GVPO replaying the previous step's groups (--reuse-steps 1, its other flags the defaults) trains each group
    at two steps, one pass at each: as often as on-policy. Measured (2026-12-01, 2 cores, AMD EPYC), rise in
    held-out sampled accuracy at steps 50 / 100 / 200, seeds 1 / 2 / 3: +0.13 / +0.22 / +0.21, +0.17 / +0.24 /
    +0.41, +0.15 / +0.27 / +0.29; with two passes a step (the default before the passes were counted over the
    steps) only +0.09, +0.06, +0.13 at step 200, the run oscillating. Hence 100 steps."""
    result = run(
        [
            f"{algo}.py",
            "--num-steps",
            str(steps),
            "--eval-every",
            str(steps),
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "learn",
            "--seed",
            "1",
            *flags,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "learn")
    evals = [m for m in metrics if "eval/accuracy" in m]
    start, end = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(json.dumps({"start": start, "end": end, "greedy": [e["eval/accuracy_greedy"] for e in evals]}))
    assert end - start >= 0.12, (start, end)
    trained = [m for m in metrics if "policy/sampler_logprob_gap" in m]
    assert len(trained) == steps  # every step's line (the last line is the final evaluation)
    for m in trained:
        assert 0 <= m["policy/sampler_logprob_gap"] <= m["policy/sampler_logprob_gap_max"] <= 1e-4, m


def tiny_llama_without_pad_token(folder: Path, hidden_size: int = 32) -> int:
    """A random tiny Llama (2 heads) whose tokenizer (one character a token) has no pad token and no chat
    template, saved to `folder`; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", *"0123456789+= "])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert tokenizer.pad_token is None and not tokenizer.chat_template
    return len(vocab)


def test_another_architecture_without_pad_token_or_chat_template(tmp_path, fixed_length_dataset):
    """The same code path on a different Hugging Face model: a random tiny Llama whose tokenizer has no
    pad token (one is added and the embeddings grow) and no chat template, on a JSONL dataset."""
    folder = tmp_path / "llama"
    vocab_size = tiny_llama_without_pad_token(folder)
    result = run(
        [
            "grpo.py",
            "--model",
            str(folder),
            "--dataset",
            str(fixed_length_dataset),
            "--eval-size",
            "8",
            "--eval-every",
            "1",
            *FAST[:6],
            "--output-dir",
            str(tmp_path / "runs"),
            "--run-name",
            "llama",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "runs" / "llama")
    assert metrics[-1]["step"] == 2 and "eval/accuracy" in metrics[-1]
    final = load_file(tmp_path / "runs" / "llama" / "final" / "model.safetensors")
    assert final["model.embed_tokens.weight"].shape[0] == vocab_size  # the vocabulary as it was
