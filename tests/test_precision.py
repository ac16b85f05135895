"""Right on a GPU by construction, checked on the CPU (torch's bf16 autocast and gloo run what a GPU and nccl run):
what the optimizer trains is held in fp32 whatever --dtype, final/ is written in the checkpoint's own dtype, the
no-grad passes keep one hidden state, a sharded model reaches the ranks as shards, the vLLM engine is sized to the run
and caps nothing, and a rank that cannot see the run folder stops at start-up.

Why fp32 master weights: AdamW's step is about the learning rate (1e-6 in real recipes), and bf16 keeps 8 significant
bits: its values near |w| = 0.02 are 2^-6 * 2^-7 = 1.2e-4 apart, so a bf16 weight rounds every update under 6.1e-5
away: measured on this CPU before the change, 5 steps of grpo.py at lr 1e-6 changed 1.25 % of the bf16 weights and
99.99 % of the fp32 ones."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import grpo
import harness
import ppo
from common import format_prompt
from conftest import ROOT, run
from harness import DEFAULT_MODEL, cli, load_tokenizer

CPU = torch.device("cpu")
SHORT = [
    "--num-steps",
    "2",
    "--save-every",
    "2",
    "--eval-every",
    "0",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--learning-rate",
    "1e-6",
]


def initial_weight(name: str, tiny: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight a run starts from, by its name in the training state: the policy's, the critic's backbone (the
    model without its LM head) and value head (zeros)."""
    if name.startswith("policy."):
        return tiny[name.removeprefix("policy.")]
    if name.startswith("critic.backbone."):
        return tiny["model." + name.removeprefix("critic.backbone.")]
    return torch.zeros(())


def moved(run_dir: Path) -> dict[str, tuple[float, float, torch.dtype]]:
    """For each trained module (policy, critic): the share of its weights that differ from where they started, in the
    dtype they are held in, the mean |change| and that dtype; read from the last step's training state."""
    tiny, state = load_file(Path(DEFAULT_MODEL) / "model.safetensors"), {}
    (step,) = [p for p in run_dir.iterdir() if p.name.startswith("step_")]
    for file in (step / "training_state").glob("*.safetensors"):
        state |= {k.removeprefix("model."): v for k, v in load_file(file).items() if k.startswith("model.")}
    figures = {}
    for module in ("policy", "critic"):
        names = [name for name in state if name.startswith(module + ".")]
        if not names:
            continue
        changed = total = 0
        change = 0.0
        for name in names:
            held = state[name]
            start = initial_weight(name, tiny).to(held.dtype).expand_as(held)
            changed += (held != start).sum().item()
            total += held.numel()
            change += (held.double() - start.double()).abs().sum().item()
        figures[module] = (changed / total, change / total, state[names[0]].dtype)
    return figures


_fp32 = {}


def fp32_figures(algo: str, tmp_path_factory) -> dict:
    """The same run in fp32, once per file: what every trained weight does when nothing rounds it away."""
    if algo not in _fp32:
        out = tmp_path_factory.mktemp(f"{algo}_fp32")
        module = {"grpo": grpo, "ppo": ppo}[algo]
        module.main(cli(module.Args, [*SHORT, "--dtype", "float32", "--output-dir", str(out), "--run-name", "r"]))
        _fp32[algo] = moved(out / "r")
    return _fp32[algo]


@pytest.mark.slow
@pytest.mark.parametrize("algo, ranks", [("grpo", 1), ("ppo", 1), ("grpo", 2), ("ppo", 2)])
def test_bf16_compute_at_lr_1e6_moves_every_trained_weight_as_fp32_does(tmp_path, tmp_path_factory, algo, ranks):
    """--dtype bfloat16 at lr 1e-6: the policy (and ppo's critic) move as in fp32, on one process and 2 DDP ranks;
    the weights are held in fp32 (in the training state), the forward computes in bf16."""
    args = [f"{algo}.py", *SHORT, "--dtype", "bfloat16", "--output-dir", str(tmp_path), "--run-name", "r"]
    if ranks == 1:
        module = {"grpo": grpo, "ppo": ppo}[algo]
        module.main(cli(module.Args, args[1:]))
    else:
        result = run(args, cwd=tmp_path, torchrun=ranks)
        assert result.returncode == 0, result.stderr[-3000:]
    bf16, fp32 = moved(tmp_path / "r"), fp32_figures(algo, tmp_path_factory)
    assert set(bf16) == ({"policy", "critic"} if algo == "ppo" else {"policy"})
    for module, (share, mean, dtype) in bf16.items():
        fp32_share, fp32_mean, _ = fp32[module]
        assert share >= fp32_share - 0.01, (module, share, fp32_share)  # (before #61, the policy's: 0.0125)
        assert 0.5 < mean / fp32_mean < 2, (module, mean, fp32_mean)
        assert dtype == torch.float32, module


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, dtype, flags, stored",
    [
        ("bf16", "float32", [], torch.bfloat16),  # trained in fp32, written as the checkpoint is
        ("bf16", "float32", ["--lora-rank", "4"], torch.bfloat16),  # the merged model too
        ("default", "bfloat16", [], torch.float32),  # an fp32 checkpoint keeps its fp32 weights
    ],
)
def test_final_is_written_in_the_checkpoint_dtype(tmp_path, bf16_model, model, dtype, flags, stored):
    path = str(bf16_model) if model == "bf16" else DEFAULT_MODEL
    grpo.main(
        cli(
            grpo.Args,
            [
                "--model",
                path,
                "--dtype",
                dtype,
                "--num-steps",
                "1",
                "--eval-every",
                "0",
                "--prompts-per-step",
                "4",
                "--group-size",
                "2",
                "--output-dir",
                str(tmp_path),
                "--run-name",
                "r",
                *flags,
            ],
        )
    )
    final = tmp_path / "r" / "final"
    weights = load_file(final / "model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {stored}
    assert json.loads((final / "config.json").read_text())["dtype"] == str(stored).removeprefix("torch.")
    loaded = AutoModelForCausalLM.from_pretrained(final)  # as a user loads it: in its config's dtype
    assert loaded.dtype == stored and not any(".lora_" in name for name in weights)


PEAK = """
import json, sys, torch
from pathlib import Path
from transformers import Qwen3Config, Qwen3ForCausalLM
from common import get_logprobs, peak_memory_gb
layers, hidden, batch, seq = map(int, sys.argv[1:])
torch.manual_seed(0)
config = Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=seq)
model = Qwen3ForCausalLM(config).eval()
ids = torch.randint(0, 64, (batch, seq))
Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory from here on (VmHWM)
base = peak_memory_gb(torch.device("cpu"))
with torch.no_grad():
    get_logprobs(model, ids, torch.ones_like(ids), seq // 2, 1.0, entropy=False)
print((peak_memory_gb(torch.device("cpu")) - base) * 2**30)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the peak is reset through Linux's /proc")
def test_the_no_grad_logprob_pass_keeps_one_hidden_state_not_every_layers(tmp_path):
    """A no-grad log-prob pass (the old and reference log-probs) over 256 x 64 tokens of a model of hidden size 256,
    with 2 and with 24 layers: a hidden state is 16.8 MB in fp32; keeping every layer's (output_hidden_states) adds
    22 x 16.8 = 369 MB to the 24-layer pass's peak; keeping the last alone, nothing: a layer's own temporaries (~240
    MB at this shape) are freed before the next. Measured before #61: 622 MB with 24 layers."""
    batch, seq, hidden = 256, 64, 256
    growth = {}
    for layers in (2, 24):
        result = subprocess.run(
            [sys.executable, "-c", PEAK, *map(str, (layers, hidden, batch, seq))],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        growth[layers] = float(result.stdout.split()[-1])
    one_hidden_state = batch * seq * hidden * 4
    assert growth[24] - growth[2] < 5 * one_hidden_state, {k: v / 2**20 for k, v in growth.items()}


@pytest.mark.slow
def test_under_fsdp_the_ranks_other_than_0_never_hold_the_whole_model(tmp_path):
    """--fsdp on 2 CPU ranks loading a 76M-parameter model (304 MB in fp32): rank 0 reads it, rank 1 builds it on the
    meta device and gets its shard; its peak resident memory grows by its half and a tensor at a time, not the whole
    model (measured: 163 MB, against 303 MB before #61). The shards hold the checkpoint's weights (rank 1's filled
    in, not left as allocated)."""

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path / "model")
    load_tokenizer(DEFAULT_MODEL).save_pretrained(tmp_path / "model")
    size = sum(p.numel() * 4 for p in model.parameters())
    total = sum(p.double().sum().item() for p in model.state_dict().values())  # of every named weight, tied twice
    result = run(["tests/fsdp_load.py", str(tmp_path / "model")], cwd=tmp_path, torchrun=2, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(result.stdout.splitlines()[-1])
    assert ranks[0]["total"] == pytest.approx(total, rel=1e-9)
    assert ranks[1]["growth"] < 0.75 * size, (ranks[1]["growth"] / 2**20, size / 2**20)


STAND_IN_VLLM = '''
"""A stand-in for vLLM (not installed here): records how the engine is built and called."""
calls = []


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class Engine:
    def step(self):
        calls.append(("step",))


class LLM:
    def __init__(self, model, **kwargs):
        calls.append(("LLM", model, kwargs))
        self.llm_engine = Engine()

    def __getattr__(self, name):  # sleep, wake_up, release_kv_cache_memory, collective_rpc, ...
        return lambda *args, **kwargs: calls.append((name, args, kwargs))
'''


@pytest.mark.parametrize("flags", [[], ["--lm-head-fp32"]])
def test_the_vllm_engine_is_sized_to_the_run_and_caps_nothing(tmp_path, monkeypatch, flags):
    """The engine's arguments on a GPU: max_model_len the longest sequence the run makes (its longest prompt, train
    or held out, with the chat template, + --max-new-tokens), not the model's whole context; vLLM 0.34's extensible KV
    cache off (with it, vLLM sets torch.cuda.set_per_process_memory_fraction after warm-up and keeps it while it
    sleeps: the update would get the GPU less the engine's KV cache); --lm-head-fp32 asks for its LM head in fp32."""
    vllm = types.ModuleType("vllm")
    exec(STAND_IN_VLLM, vllm.__dict__)
    monkeypatch.setitem(sys.modules, "vllm", vllm)  # what `import vllm` gets, for this test only
    rows = [{"prompt": "1+2", "answer": "3"}, {"prompt": "12+345+6789", "answer": "7146"}] * 3
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = cli(
        grpo.Args,
        ["--dataset", str(tmp_path / "data.jsonl"), "--eval-size", "1", "--max-new-tokens", "16", "--vllm", *flags],
    )
    harness.check_flags(args)
    tokenizer = harness.load_task(args).tokenizer
    longest = max(len(tokenizer(format_prompt(tokenizer, row["prompt"], True)).input_ids) for row in rows)
    model = harness.load_model(args.model, "float32", CPU, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the engine's GPU arguments
    harness.load_vllm(args, 0, optimizer)
    (name, model_name, kwargs), *calls = vllm.calls
    assert name == "LLM" and model_name == args.model
    assert kwargs["max_model_len"] == longest + 16
    assert kwargs["enable_extensible_kv_cache"] is False
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["enable_sleep_mode"] is True
    assert kwargs["dtype"] == "bfloat16"
    assert kwargs.get("hf_overrides") == ({"head_dtype": "float32"} if flags else None)
    assert [call[0] for call in calls] == ["step", "sleep", "release_kv_cache_memory"]  # asleep, its cache freed


SEES_ANOTHER_FOLDER = """
import os
if os.environ.get("RANK") == "1":  # a second node: the same path, another disk
    os.makedirs(os.environ["OTHER_DISK"], exist_ok=True)
    os.chdir(os.environ["OTHER_DISK"])
"""


@pytest.mark.slow
def test_a_rank_that_cannot_see_the_run_folder_stops_at_start_up(tmp_path):
    """Two nodes without a filesystem they share: rank 1 resolves --output-dir runs on its own disk. Checkpoints
    need every rank to write its shards into rank 0's folder and read them back on --resume; the run stops at
    start-up with one line, before any model is trained."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SEES_ANOTHER_FOLDER)
    result = run(
        ["grpo.py", "--num-steps", "1", "--eval-every", "0", "--output-dir", "runs", "--run-name", "r"],
        cwd=tmp_path,
        torchrun=2,
        env={"PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "OTHER_DISK": str(tmp_path / "node2")},
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert lines and all(line == lines[0] for line in lines), result.stderr[-3000:]
    assert "rank 1 cannot see rank 0's run folder" in lines[0] and "one filesystem" in lines[0], lines[0]
    assert not (tmp_path / "runs" / "r" / "final").exists() and not (tmp_path / "runs" / "r" / "metrics.jsonl").exists()


def test_lm_head_fp32_gives_fp32_logits_to_the_log_probs_and_the_sampler():
    """On a model computing in bf16, --lm-head-fp32: the logits of the model's forward (what model.generate samples
    from) and of the head get_logprobs calls are the fp32 product of the hidden state and the weights; without it they
    are bf16's, which keeps 8 bits of mantissa (a logit of 10 to within 0.03)."""
    import torch.nn.functional as F

    from common import forward_last_hidden
    from harness import load_model

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    ids = torch.tensor([tokenizer("12+34=46").input_ids])
    for fp32 in (False, True):
        model = load_model(DEFAULT_MODEL, "bfloat16", CPU, tokenizer, lm_head_fp32=fp32)
        out, hidden = forward_last_hidden(model, input_ids=ids, use_cache=False)
        exact = F.linear(hidden.float(), model.lm_head.weight.float())  # (1, T, V)
        head = model.get_output_embeddings()(hidden)
        assert model.lm_head.weight.dtype == torch.float32  # held in fp32: trained
        assert (out.logits.dtype, head.dtype) == ((torch.float32,) * 2 if fp32 else (torch.bfloat16,) * 2)
        difference = max((out.logits.float() - exact).abs().max(), (head.float() - exact).abs().max())
        assert difference < 1e-5 if fp32 else difference > 1e-3, (fp32, difference)


def test_every_gpu_command_of_the_docs_fits_an_80_gb_gpu():
    """Each command of README.md's and docs/'s code blocks that trains a Hub model, read by benchmarks/memory_fit.py
    (its file's flags and defaults, the model's published shape): its peak per GPU, of loading, sampling and the
    update, is within 90 % of an 80 GB GPU. The GSM8K command as the README gave it before (the whole minibatch of
    256 completions of 1,024 tokens in one micro-batch) does not fit, nor the 32B DAPO recipe, whose every rank's
    vLLM engine would hold the whole model."""
    from benchmarks import memory_fit

    commands = memory_fit.gpu_commands()
    assert len(commands) >= 20 and {where for where, _ in commands} >= {"README.md", "docs/real_models.md"}
    for where, command in commands:
        verdict = memory_fit.estimate(command)[1]
        assert verdict.startswith("fits: "), (where, command, verdict)
    before = [
        "python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --max-new-tokens 512",
        "torchrun --nnodes=$NODES --nproc_per_node=8 dapo.py --model Qwen/Qwen2.5-32B --prompts-per-step 512 "
        "--group-size 16 --num-minibatches 16 --max-prompt-length 2048 --max-new-tokens 20480 --fsdp --vllm",
    ]
    for command in before:
        assert memory_fit.estimate(command)[1].startswith("does not fit: "), command
    run = memory_fit.read_command(
        "torchrun --nnodes=$NODES --nproc_per_node=8 grpo.py --model Qwen/Qwen2.5-7B "
        "--prompts-per-step 64 --micro-batch-size 4",
        nodes=2,
        prompt_length=512,
    )
    assert (run["world_size"], run["rollout"], run["micro_batch"]) == (16, 32, 4)
    assert run["shape"].params == pytest.approx(7.6156e9, rel=1e-4)  # Qwen2.5-7B: 7.61B (less its q, k, v biases)
