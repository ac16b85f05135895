"""What only a GPU can show (skipped without CUDA): fp32 master weights under CUDA's bf16 autocast, a LoRA final/ in
the checkpoint's dtype, one update's peak memory at a real model's shape against benchmarks/memory_fit.py's figure,
and the vLLM engine (where vLLM is installed) built, put to sleep, woken and given weights three times without capping
the memory this process's trainer can take. About 2 minutes on one H100 (`bash ../shared/device/gpu_smoke.sh` runs
it first, then `python -m benchmarks.gpu_check`)."""

import importlib.util
import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from test_precision import SHORT, moved  # noqa: E402

import grpo  # noqa: E402
import ppo  # noqa: E402
from conftest import read_metrics  # noqa: E402
from harness import cli  # noqa: E402


@pytest.mark.parametrize("module", [grpo, ppo])
def test_bf16_compute_on_cuda_moves_every_trained_weight_as_fp32_does(tmp_path, module):
    """--dtype auto is bf16 on a GPU: at lr 1e-6 the policy (and ppo's critic) move as in fp32 (bf16 weights: ~1 %)."""
    figures = {}
    for dtype in ("float32", "auto"):
        module.main(cli(module.Args, [*SHORT, "--dtype", dtype, "--output-dir", str(tmp_path), "--run-name", dtype]))
        figures[dtype] = moved(tmp_path / dtype)
    print(json.dumps({name: {k: v[:2] for k, v in f.items()} for name, f in figures.items()}))
    for name, (share, mean, dtype) in figures["auto"].items():
        assert dtype == torch.float32 and share >= figures["float32"][name][0] - 0.01, (name, share)
        assert 0.5 < mean / figures["float32"][name][1] < 2, name


def test_a_lora_final_on_cuda_is_in_the_checkpoint_dtype(tmp_path, bf16_model):
    from safetensors.torch import load_file

    grpo.main(
        cli(
            grpo.Args,
            [
                "--model",
                str(bf16_model),
                "--lora-rank",
                "4",
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
            ],
        )
    )
    assert {t.dtype for t in load_file(tmp_path / "r" / "final" / "model.safetensors").values()} == {torch.bfloat16}


def test_one_update_at_a_real_shape_peaks_where_memory_fit_says(tmp_path):
    """grpo.py, one step at Qwen2.5-0.5B's shape (random weights): 16 prompts of 256 tokens x 8 completions of 256
    (EOS is rare: they run to the cap), micro-batches of 16; its perf/peak_mem_gb (allocated) against memory_fit's
    peak for the same command, which counts what is held, not the allocator's slack."""
    from transformers import AutoModelForCausalLM

    from benchmarks import gpu_check, memory_fit
    from benchmarks.lockstep import save_with_offline_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gpu_check.qwen_config(gpu_check.SHAPES["0.5b"]), dtype=torch.bfloat16)
    save_with_offline_tokenizer(model, tmp_path / "model")
    gpu_check.dataset(tmp_path, gpu_check.Args(prompts=16, prompt_length=256))
    command = (
        f"python grpo.py --model {tmp_path / 'model'} --dataset {tmp_path / 'prompts.jsonl'} --eval-every 0 "
        "--eval-size 0 --num-steps 1 --prompts-per-step 16 --group-size 8 --max-prompt-length 256 "
        "--max-new-tokens 256 --micro-batch-size 16 --learning-rate 1e-6"
    )
    grpo.main(cli(grpo.Args, [*command.split()[2:], "--output-dir", str(tmp_path), "--run-name", "r"]))
    measured = read_metrics(tmp_path / "r")[0]["perf/peak_mem_gb"] * 2**30 / 1e9
    estimated = max(memory_fit.estimate(command)[0].values())
    print(json.dumps({"measured_gb": measured, "memory_fit_gb": estimated}))
    assert 0.5 < measured / estimated < 1.5, (measured, estimated)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (requirements-vllm.txt)")
def test_the_vllm_engine_sleeps_wakes_and_leaves_the_trainer_its_memory():
    """The engine on this process's GPU: after it is built and after each of three calls (a push of new weights each
    time) it sleeps, and the memory it freed is the trainer's to take: a tensor of half the GPU can be allocated (vLLM
    0.34's extensible KV cache would have capped this process's PyTorch memory at warm-up)."""
    from harness import DEFAULT_MODEL, load_model, load_tokenizer, plain_weights
    from vllm_engine import VllmEngine

    device = torch.device("cuda")
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    model = load_model(DEFAULT_MODEL, "auto", device, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    free = [torch.cuda.mem_get_info()[0]]
    engine = VllmEngine(DEFAULT_MODEL, torch.bfloat16, 0, optimizer, plain_weights, 0.3, max_model_len=64)
    free.append(torch.cuda.mem_get_info()[0])
    total = torch.cuda.mem_get_info()[1]
    for call in range(3):
        optimizer.step()  # (no gradients: the weights stay; its hook tells the engine they changed)
        responses, _ = engine.generate(model, tokenizer, [[5, 6, 7]], 2, 8, 1.0)
        assert len(responses) == 2 and not engine.stale
        free.append(torch.cuda.mem_get_info()[0])
        half = torch.empty(int(total * 0.5), dtype=torch.uint8, device=device)  # the trainer takes half the GPU
        del half
    print(json.dumps({"free_gb": [round(f / 1e9, 2) for f in free], "total_gb": round(total / 1e9, 2)}))
    assert min(free[1:]) > free[0] - 0.15 * total  # asleep, the engine holds its weights, not its 0.3 share
