"""What fits: peak memory per GPU of grpo.py's training step (weights, gradients, optimizer, activations, KV cache),
for DDP and --fsdp, with and without --gradient-checkpointing; the formula checked against tiny steps on CPU.

    python -m benchmarks.memory_fit            # from the repo root: the table in docs/benchmarks.md
    python -m benchmarks.memory_fit --check    # formula vs measured peak RSS on CPU (a few minutes)

The formula (bytes per GPU; N parameters, w bytes per weight; W ranks; b sequences of s tokens per micro-batch
(with --max-tokens-per-micro-batch, b s is at most that); L layers, hidden H, MLP width I, vocabulary V):
    DDP   static = 4 w N (weights, gradients, AdamW's two moments) + w N (DDP's gradient buckets, W > 1)
                   + w N (the frozen reference, beta > 0)
    FSDP  static = 16 N / W (fp32 master weights, gradients, moments, sharded) + 4 N / W (reference)
                   + 2 (V H (1 + untied) + 2 layer) (the root's and two layers' bf16 copies, unsharded)
    activations  = L b s a   without checkpointing,   L b s H w + b s a   with it,
                   a = (12 H + 4 I) w per token and layer (what autograd saves in a Qwen layer with
                   SDPA attention: measured by --check with saved-tensor hooks), + 0.8 GB for the
                   chunked log-prob head (measured at B x T = 8 x 2048, vocabulary 151,936), or
                   24 b s V when b s V <= 2^27 (get_logprobs then keeps the logits for the backward, in
                   one product instead of chunks: the logits and their temporaries, as a chunk's)
    KV cache     = 2 L n_kv d_head (P + T) w per sequence, for the rank's whole rollout while sampling
    peak         = static + max(KV cache, activations)
Not counted: the CUDA context and allocator fragmentation (keep ~10% free), a reward model or critic
(ppo.py: the critic adds a second policy's static bytes).
"""

import inspect
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

GB = 1e9


@dataclass
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 151936
    tied: bool = False

    def __post_init__(self):
        H, self.head_dim = self.hidden, self.hidden // self.heads
        kv = self.kv_heads * self.head_dim
        self.layer_params = H * H * 2 + H * kv * 2 + 3 * H * self.intermediate + 2 * H  # q o, k v, gate up down, norms
        self.embedding_params = self.vocab * H * (1 if self.tied else 2)  # input embeddings (and the LM head if untied)
        self.params = self.layers * self.layer_params + self.embedding_params + H  # + the final norm


# Qwen2.5 shapes (layers, hidden, MLP, heads, KV heads; from the published configs, recalled, not read here)
QWEN = [Shape("0.5B", 24, 896, 4864, 14, 2, tied=True), Shape("1.5B", 28, 1536, 8960, 12, 2, tied=True),
        Shape("3B", 36, 2048, 11008, 16, 2, tied=True), Shape("7B", 28, 3584, 18944, 28, 4),
        Shape("14B", 48, 5120, 13824, 40, 8), Shape("32B", 64, 5120, 27648, 40, 8)]


def peak_bytes(shape: Shape, fsdp: bool, ranks: int, checkpointing: bool, micro_batch: int, seq: int,
               rollout_seqs: int, w: int = 2, reference: bool = True, logprob_head: float = 0.8 * GB) -> float:
    N, tokens = shape.params, micro_batch * seq
    if fsdp:
        static = 16 * N / ranks + (4 * N / ranks if reference else 0)
        static += 2 * (shape.embedding_params + 2 * shape.layer_params)
    else:
        static = 4 * w * N + (w * N if ranks > 1 else 0) + (w * N if reference else 0)
    kv_cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * seq * w * rollout_seqs / ranks
    per_layer = (12 * shape.hidden + 4 * shape.intermediate) * w * tokens  # b s a: what autograd saves of a layer
    activations = shape.layers * shape.hidden * w * tokens + per_layer if checkpointing else shape.layers * per_layer
    return static + max(kv_cache, activations + logprob_head)


def table(micro_batch: int, seq: int, rollout_seqs: int) -> None:
    print(f"grpo.py, bf16, reference model on; micro-batch {micro_batch} x {seq} tokens; "
          f"rollout {rollout_seqs} sequences over the ranks. Cell: peak GB per GPU on the fewest GPUs "
          "(1, 2, 4, 8) where it fits in 90% of the card, '-' if none")
    for card in (80, 141):
        print(f"\n{card} GB cards")
        print("| model | params | DDP | DDP + ckpt | FSDP | FSDP + ckpt |")
        print("|---|---|---|---|---|---|")
        for shape in QWEN:
            cells = []
            for fsdp, ckpt in [(False, False), (False, True), (True, False), (True, True)]:  # the header's order
                cell = "-"
                for ranks in ((2, 4, 8) if fsdp else (1,)):  # DDP replicates: more GPUs do not help memory
                    gb = peak_bytes(shape, fsdp, ranks, ckpt, micro_batch, seq, rollout_seqs) / GB
                    if gb <= 0.9 * card:
                        cell = f"{ranks} GPU{'s' if ranks > 1 else ''}, {gb:.0f}"
                        break
                cells.append(cell)
            print(f"| {shape.name} | {shape.params / 1e9:.2f}B | " + " | ".join(cells) + " |")


# --- the check on CPU ------------------------------------------------------------------------------

# (layers, hidden, MLP, batch, seq): weights-heavy, activation-heavy, and in between
TINY = [(4, 512, 2048, 2, 128), (2, 256, 1024, 16, 512), (8, 384, 1536, 8, 256)]


def measure_one(layers: int, hidden: int, intermediate: int, batch: int, seq: int, checkpointing: bool) -> None:
    """Child process: one GRPO-like training step (reference log-probs, forward, backward, AdamW) of a
    Qwen3 in fp32 on CPU; prints the growth of peak RSS and the formula's bytes, in GB."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from common import get_logprobs, peak_memory_gb

    torch.manual_seed(0)
    vocab = 1024
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones_like(ids)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    base = peak_memory_gb(torch.device("cpu")) * 2**30
    policy, ref = Qwen3ForCausalLM(config), Qwen3ForCausalLM(config).requires_grad_(False)
    if checkpointing:
        policy.activation_checkpointing_enable({"use_reentrant": False})
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    with torch.no_grad():
        get_logprobs(ref, ids, mask, 1, 1.0)
    logprobs, _ = get_logprobs(policy, ids, mask, 1, 1.0)
    logprobs.sum().backward()
    optimizer.step()
    measured = peak_memory_gb(torch.device("cpu")) * 2**30 - base
    shape = Shape("tiny", layers, hidden, intermediate, 4, 2, vocab=vocab)
    # a chunk's logits and temporaries; below get_logprobs' threshold one chunk holds them all, kept for the backward
    kept = batch * seq * vocab <= inspect.signature(get_logprobs).parameters["recompute_above"].default
    logprob_head = 6 * (batch * seq if kept else min(batch * seq, 2**25 // vocab)) * vocab * 4
    predicted = peak_bytes(shape, False, 1, checkpointing, batch, seq, 0, w=4, logprob_head=logprob_head)
    print(f"{measured / GB:.4f} {predicted / GB:.4f} {shape.params}")


def check() -> None:
    print("fp32 on CPU, one process, policy + reference; peak RSS growth of a training step vs the formula")
    print("| layers x hidden x MLP | micro-batch x seq | ckpt | params | measured GB | formula GB "
          "| formula / measured |")
    print("|---|---|---|---|---|---|---|")
    for layers, hidden, intermediate, batch, seq in TINY:
        for ckpt in (False, True):
            sizes = map(str, (layers, hidden, intermediate, batch, seq, int(ckpt)))
            out = subprocess.run([sys.executable, "-m", "benchmarks.memory_fit", "--one", *sizes], capture_output=True,
                                 cwd=Path(__file__).resolve().parent.parent, text=True, check=True).stdout
            measured, predicted, params = map(float, out.split()[-3:])
            print(f"| {layers} x {hidden} x {intermediate} | {batch} x {seq} | {'yes' if ckpt else 'no'} | "
                  f"{params / 1e6:.1f}M | {measured:.3f} | {predicted:.3f} | {predicted / measured:.2f} |", flush=True)


@dataclass
class Args:
    check: bool = False
    """formula vs measured peak memory on CPU"""
    micro_batch: int = 8
    """sequences per micro-batch (table)"""
    seq: int = 1024
    """prompt + response tokens per sequence (table)"""
    rollout: int = 512
    """sequences sampled per step, all ranks (table)"""
    one: tuple[int, int, int, int, int, int] | None = None
    """internal: LAYERS HIDDEN MLP BATCH SEQ CHECKPOINTING, one measurement, in the child process --check starts"""


def main(args: Args) -> None:
    if args.one:
        measure_one(*args.one[:5], bool(args.one[5]))
    elif args.check:
        check()
    else:
        table(args.micro_batch, args.seq, args.rollout)


if __name__ == "__main__":
    main(tyro.cli(Args))
