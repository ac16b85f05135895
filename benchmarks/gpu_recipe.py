"""GPU recipe: generation throughput, training-step MFU and peak memory of grpo.py's code path at a
realistic shape, on one GPU with no internet: the model is built from a config with random weights
(timings do not depend on the weights; nothing is downloaded).

    python -m benchmarks.gpu_recipe        # from the repo root: Qwen3-0.6B shape, 64 prompts x 8, 512 new tokens
    python -m benchmarks.gpu_recipe --micro-batch-size 32 --peak-tflops 989
    python -m benchmarks.gpu_recipe --config tiny_model --device cpu --prompts 2 --group-size 2 \\
        --prompt-length 8 --new-tokens 4                    # the CPU check the tests run

What it runs, each timed after a warm-up:
1. sampling: `model.generate` (KV cache, T=1, no top-k) on --prompts random prompts, each --group-size
   times, forced to exactly --new-tokens tokens (EOS suppressed): response tokens per second;
2. the update: grpo.py's loss (`grpo.compute_loss`) on log-probs from `common.get_logprobs`, backward
   over micro-batches, gradient clipping and an AdamW step on the whole batch, as grpo.py does it
   (bf16 weights on GPU, as `--dtype auto`; a micro-batch runs each of its prompts once).
3. with trl installed (pip install -r benchmarks/requirements.txt): grpo.py's whole rounds against TRL's
   GRPOTrainer at this shape, both loaded and taking turns (benchmarks/lockstep.py's `compare`, on
   the built-in task's prompts of ~24 tokens, the same random model saved to a temporary folder):
   each one's seconds per round, grpo.py's split (generation, log-probs, update) and the ratio.
MFU = model FLOPs of the update / time / peak FLOPs. Model FLOPs (`update_flops`) count the
matmuls of forward + backward (x3 of the forward): 2 x the non-embedding weights per position run
(each micro-batch's distinct prompts once, every response), the causal attention scores and values
(half of the full T x T, as flash kernels skip the masked half) and the LM head on the response
tokens only (get_logprobs applies it to those); recomputation is not counted. --peak-tflops defaults
to 989, the dense bf16 peak of an H100/H200 SXM.
"""

import importlib.util
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import tyro
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

import grpo
from common import clip_grad_norm, get_logprobs

ROOT = Path(__file__).resolve().parent.parent

# Qwen/Qwen3-0.6B's config.json (written out: nothing can be downloaded on the GPU machine).
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")


def build_config(name: str):
    if name == "qwen3-0.6b":
        return Qwen3Config(**QWEN3_0_6B)
    path = Path(name) if Path(name).exists() else ROOT / name
    if not (path / "config.json").exists():
        raise SystemExit(f"--config {name}: neither 'qwen3-0.6b' nor a folder with a config.json")
    return AutoConfig.from_pretrained(path)


def update_flops(config, num_sequences: int, sequence_length: int, response_length: int,
                 causal: bool = True, prompts: Optional[int] = None) -> float:
    """Model FLOPs of one forward + backward of grpo.py's update over `num_sequences` sequences of
    `sequence_length` tokens, `response_length` of them scored (the backward costs 2 forwards). With
    `prompts`, the sequences share that many prompt forwards (common.response_hidden_states runs a prompt
    once per micro-batch): each prompt's positions once, each sequence's response positions against its
    prompt; without, every sequence runs whole."""
    d, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer_weights = d * (q_dim + 2 * kv_dim) + q_dim * d + 3 * d * config.intermediate_size  # attention + MLP
    P, L, n = sequence_length - response_length, response_length, num_sequences
    if prompts is None:  # each sequence's positions, each against all T (or, causal, half of the T x T)
        positions, scores = n * sequence_length, n * sequence_length**2 / (2 if causal else 1)
    else:  # the prompts' positions among themselves, each response position against its prompt and response
        positions, scores = prompts * P + n * L, (prompts * P**2 + n * L**2) / (2 if causal else 1) + n * L * P
    weights = 2 * layers * layer_weights * positions
    attention = 2 * 2 * layers * q_dim * scores  # QK^T and AV
    lm_head = 2 * d * config.vocab_size * n * response_length
    return 3 * (weights + attention + lm_head)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_generation(model, prompts: torch.Tensor, new_tokens: int,
                       device: torch.device) -> tuple[dict, torch.Tensor]:
    eos = model.generation_config.eos_token_id
    kwargs = dict(attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                  eos_token_id=eos if eos is not None else 0)
    with torch.no_grad():
        model.generate(prompts[:8], **{**kwargs, "attention_mask": kwargs["attention_mask"][:8]})  # warm-up
        sync(device)
        start = time.perf_counter()
        out = model.generate(prompts, **kwargs)
        sync(device)
    seconds = time.perf_counter() - start
    assert out.shape[1] == prompts.shape[1] + new_tokens, out.shape
    return {"gen_s": seconds, "gen_tokens_per_s": prompts.shape[0] * new_tokens / seconds}, out


def update(model, optimizer, ids: torch.Tensor, prompt_length: int, micro_batch_size: int) -> float:
    """One grpo.py optimizer step over the batch (random advantages; old log-probs = current ones)."""
    attention_mask = torch.ones_like(ids)
    response_mask = attention_mask[:, prompt_length:].float()
    advantages = torch.randn(len(ids), device=ids.device)
    for start in range(0, len(ids), micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        logprobs, _ = get_logprobs(model, ids[sl], attention_mask[sl], prompt_length, 1.0)
        loss, _ = grpo.compute_loss(logprobs, logprobs.detach(), None, advantages[sl], response_mask[sl],
                                    len(ids), beta=0.0)
        loss.backward()
    grad_norm = clip_grad_norm(model.parameters(), 1.0, 0, Path.cwd())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item()


def against_trl(config, dtype, args) -> dict:
    """grpo.py's rounds against TRL's at this shape, in turns (benchmarks/lockstep.py): the figures."""
    from benchmarks.lockstep import Shape, compare, print_comparison, save_with_offline_tokenizer

    batch = args.prompts * args.group_size  # the files' micro-batch must divide it
    shape = Shape(args.prompts, args.group_size, args.new_tokens, math.gcd(args.micro_batch_size, batch))
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        save_with_offline_tokenizer(AutoModelForCausalLM.from_config(config, dtype=dtype), Path(tmp) / "model")
        result = compare("grpo", "trl", str(Path(tmp) / "model"), shape, args.trl_rounds, args.trl_warmup, [], 1,
                         str(Path(tmp) / "runs"))
    print_comparison(result, shape, args.trl_rounds, args.trl_warmup)
    grpo_round, trl_round = result["this"], result["other"]
    return {"grpo_round_s": grpo_round["median_s"], "trl_round_s": trl_round["median_s"], "trl_ratio": result["ratio"],
            **{f"grpo_round_{k}": v for k, v in grpo_round.items() if k in ("gen_s", "logprobs_s", "update_s")}}


@dataclass
class Args:
    config: str = "qwen3-0.6b"
    """'qwen3-0.6b' or a folder with a config.json"""
    prompts: int = 64
    group_size: int = 8
    prompt_length: int = 256
    new_tokens: int = 512
    micro_batch_size: int = 16
    """sequences per forward/backward"""
    update_steps: int = 2
    """timed optimizer steps (after one warm-up)"""
    peak_tflops: float = 989.0
    """the accelerator's dense bf16 peak"""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    out: Optional[Path] = None
    """also write the figures to this JSON file"""
    trl: bool = True
    """3. the rounds against TRL's GRPOTrainer, when trl is installed"""
    trl_rounds: int = 2
    """timed rounds of each trainer in that comparison (a multiple of 2)"""
    trl_warmup: int = 1


def main(args: Args) -> None:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # grpo.py's --dtype auto
    config = build_config(args.config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    n_params = sum(p.numel() for p in model.parameters())
    batch = args.prompts * args.group_size
    print(f"{args.config}: {n_params / 1e6:.1f} M parameters, {dtype}, {device}; {args.prompts} prompts x "
          f"{args.group_size} = {batch} sequences of {args.prompt_length} + {args.new_tokens} tokens", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    prompts = torch.randint(1, config.vocab_size, (args.prompts, args.prompt_length), device=device)
    prompts = prompts.repeat_interleave(args.group_size, dim=0)  # G completions of each, as the files sample
    figures, sequences = measure_generation(model, prompts, args.new_tokens, device)
    print(f"generation: {figures['gen_tokens_per_s']:,.0f} response tokens/s ({figures['gen_s']:.1f} s)", flush=True)
    if device.type == "cuda":
        figures["gen_peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    update(model, optimizer, sequences, args.prompt_length, args.micro_batch_size)  # warm-up (allocates Adam state)
    sync(device)
    start = time.perf_counter()
    for _ in range(args.update_steps):
        update(model, optimizer, sequences, args.prompt_length, args.micro_batch_size)
    sync(device)
    step_s = (time.perf_counter() - start) / args.update_steps
    prompt_forwards = sum(len(sequences[i : i + args.micro_batch_size, : args.prompt_length].unique(dim=0))
                          for i in range(0, batch, args.micro_batch_size))  # each micro-batch runs its prompts once
    flops = update_flops(config, batch, sequences.shape[1], args.new_tokens, prompts=prompt_forwards)
    figures.update({"update_s": step_s, "update_tflops_per_s": flops / step_s / 1e12,
                    "update_tokens_per_s": batch * sequences.shape[1] / step_s})
    if device.type == "cuda":
        figures["update_peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        figures["mfu"] = flops / step_s / (args.peak_tflops * 1e12)
    print(f"update: {step_s:.2f} s per optimizer step, {figures['update_tflops_per_s']:.1f} TFLOP/s"
          + (f", MFU {figures['mfu']:.1%} of {args.peak_tflops:.0f} TFLOP/s, peak "
             f"{figures['update_peak_mem_gb']:.1f} GB (generation: {figures['gen_peak_mem_gb']:.1f} GB)"
             if device.type == "cuda" else " (no MFU on CPU)"), flush=True)
    if args.trl and importlib.util.find_spec("trl") is None:
        print("grpo.py against TRL: skipped, trl is not installed (pip install -r benchmarks/requirements.txt)")
    elif args.trl:
        del model, optimizer, sequences
        if device.type == "cuda":
            torch.cuda.empty_cache()
        figures.update(against_trl(config, dtype, args))
    line = json.dumps({"config": args.config, "device": str(device), "batch": batch, **figures})
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
