"""What fits: the peak memory per GPU of a run, by phase (loading, sampling, the update), read from its command.

    python -m benchmarks.memory_fit --command "torchrun --nproc_per_node=8 dapo.py --model Qwen/Qwen2.5-7B ..."
    python -m benchmarks.memory_fit            # each GPU command of README.md and docs/*.md: docs/benchmarks.md's table
    python -m benchmarks.memory_fit --check    # the formula against measured peaks on CPU (a few minutes)

The command is read with its file's own flags and defaults; the model's shape from a local folder's config.json, else
from SHAPES below by its name; prompts are --max-prompt-length tokens (else --prompt-length); nodes given as a variable
($NODES) are --nodes. In bytes per GPU, for N parameters of which T train (the policy, ppo's critic; LoRA: the
adapters) and F stay frozen (the reference, a LoRA base, a reward model); S = the ranks under --fsdp, else 1 (every rank
holds everything); b s tokens a micro-batch; L layers, hidden H, MLP width I, vocabulary V:
    held        4 T / S (the fp32 weights the optimizer trains)  +  2 F / S (bf16)
                + 8 T / S (AdamW's two fp32 moments, from the first step on)
    copies      one GPU and DDP: 2 T, the bf16 casts of the fp32 weights autocast keeps from a forward to its backward;
                FSDP: 2 (V H (1 + untied) + 2 layers), the bf16 copies it gathers (the root, a layer and the next)
    update      held + copies + 4 T / S (gradients) + 4 T (DDP's gradient buckets) + activations + the log-prob head:
                L b s a, or with --gradient-checkpointing L b s 4 H + b s a (each layer's fp32 input, and the layer
                being recomputed); a = 2 (12 H + 4 I) + 16 H (what autograd saves of a Qwen layer under bf16 autocast,
                its fp32 norms included: measured by --check); the head: 0.8 GB (a chunk of 2^25 logits), or 24 b s V
                where the logits are kept (b s V <= 2^27)
    sampling    held + copies + model.generate's bf16 KV cache, 2 L n_kv d_head (P + T) 2 for each sequence sampled at
                once (the rank's rollout; an evaluation batch of 256); --vllm: the engine's --vllm-gpu-memory share of
                the card (its weights, KV cache and activations) instead of the KV cache and copies
    asleep      --vllm through the update: the engine's bf16 weights (2 N) kept, with --no-vllm-keep-weights nothing
    loading     held without AdamW (under FSDP rank 0 also sends one whole tensor at a time); --vllm: the engine
                starts after the models and takes its share of the card
A run fits where its peak is at most 90 % of the card: the CUDA context, the allocator's fragmentation and vLLM's CUDA
graphs are not counted.
"""

import importlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
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
    head_dim: int = 0  # 0: hidden // heads

    def __post_init__(self):
        H, self.head_dim = self.hidden, self.head_dim or self.hidden // self.heads
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.layer_params = 2 * H * q + H * kv * 2 + 3 * H * self.intermediate + 2 * H  # q o, k v, gate up down, norms
        self.embedding_params = self.vocab * H * (1 if self.tied else 2)  # input embeddings (and the LM head if untied)
        self.params = self.layers * self.layer_params + self.embedding_params + H  # + the final norm


# The published configs (layers, hidden, MLP, heads, KV heads), by the model's name without -Instruct
SHAPES = {
    shape.name: shape
    for shape in [
        Shape("Qwen2.5-0.5B", 24, 896, 4864, 14, 2, tied=True),
        Shape("Qwen2.5-1.5B", 28, 1536, 8960, 12, 2, tied=True),
        Shape("Qwen2.5-3B", 36, 2048, 11008, 16, 2, tied=True),
        Shape("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 152064),
        Shape("Qwen2.5-14B", 48, 5120, 13824, 40, 8, 152064),
        Shape("Qwen2.5-32B", 64, 5120, 27648, 40, 8, 152064),
        Shape("Qwen2.5-Math-1.5B", 28, 1536, 8960, 12, 2, tied=True),
        Shape("Qwen2.5-Math-7B", 28, 3584, 18944, 28, 4),
        Shape("Qwen3-1.7B", 28, 2048, 6144, 16, 8, tied=True, head_dim=128),
        Shape("Skywork-Reward-V2-Qwen3-0.6B", 28, 1024, 3072, 16, 8, tied=True, head_dim=128),
    ]
}


def model_shape(name: str) -> Shape:
    """--model's shape: its config.json where it is a local folder, else SHAPES' entry for its name."""
    if (Path(name) / "config.json").is_file():
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(name).get_text_config()
        return Shape(
            name,
            c.num_hidden_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size,
            c.tie_word_embeddings,
            getattr(c, "head_dim", 0) or 0,
        )
    key = name.rsplit("/", 1)[-1].removesuffix("-Instruct")
    if key not in SHAPES:
        raise SystemExit(
            f"error: --model {name}: no shape known for it; pass a local folder with its config.json, or "
            "add its shape to SHAPES in benchmarks/memory_fit.py."
        )
    return SHAPES[key]


def read_command(command: str, nodes: int, prompt_length: int) -> dict:
    """What memory depends on in `command` (`python x.py ...` or `torchrun ... x.py ...`): the file's flags as it
    parses them, the ranks, the model's shape and the lengths."""
    words = [w for w in shlex.split(command.replace("\\\n", " ")) if w != "..."]
    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    launcher = dict(re.match(r"--([a-z_-]+)=?(.*)", w).groups() for w in words[:at] if w.startswith("--"))
    ranks_per_node = int(launcher.get("nproc_per_node", launcher.get("nproc-per-node", 1)))
    node_count = launcher.get("nnodes", "1")
    world_size = ranks_per_node * (int(node_count) if node_count.isdigit() else nodes)
    sys.path[:0] = [] if str(ROOT) in sys.path else [str(ROOT)]  # the algorithm files and common.py
    from harness import cli

    module = importlib.import_module(Path(words[at]).stem)
    args = cli(module.Args, words[at + 1 :])
    local_rows = args.prompts_per_step // world_size * args.group_size
    minibatch = local_rows // args.num_minibatches
    return {
        "file": words[at],
        "args": args,
        "world_size": world_size,
        "shape": model_shape(args.model),
        "prompt": args.max_prompt_length or prompt_length,
        "response": args.max_new_tokens or 8,
        "rollout": local_rows,
        "micro_batch": min(args.micro_batch_size or minibatch, minibatch),
        "uses_reference": "load_reference(" in (ROOT / words[at]).read_text(),
    }


def phases(run: dict, card: float) -> dict[str, float]:
    """Bytes per GPU of each phase of `run` (read_command's) on a card of `card` bytes: the docstring's formula."""
    args, shape, L, H = run["args"], run["shape"], run["shape"].layers, run["shape"].hidden
    N, S = shape.params, run["world_size"] if args.fsdp else 1
    seq = run["prompt"] + run["response"]
    tokens = run["micro_batch"] * seq
    if args.max_tokens_per_micro_batch:  # micro-batches filled up to the budget (a longer row alone)
        tokens = max(seq, min(tokens, args.max_tokens_per_micro_batch))
    lora = args.lora_rank * L * (9 * H + 2 * shape.kv_heads * shape.head_dim + 3 * shape.intermediate)
    trained, frozen = (lora, N) if args.lora_rank else (N, 0)
    if run["uses_reference"] and not args.lora_rank and (args.beta > 0 or getattr(args, "target_kl", None)):
        frozen += N
    if Path(run["file"]).stem == "ppo":  # the critic, a backbone without its LM head, trained in full; a reward model
        critic = model_shape(args.critic_model or args.reward_model or args.model)
        trained += critic.params - (0 if critic.tied else critic.vocab * critic.hidden)
        frozen += model_shape(args.reward_model).params if args.reward_model else 0
    held = 4 * trained / S + 2 * frozen / S
    adam = 8 * trained / S
    copies = 2 * (shape.embedding_params + 2 * shape.layer_params) if args.fsdp else 2 * trained
    buckets = 4 * trained if run["world_size"] > 1 and not args.fsdp else 0
    update = held + adam + copies + 4 * trained / S + buckets + activations(shape, tokens, args.gradient_checkpointing)
    kv_cache = 2 * L * shape.kv_heads * shape.head_dim * seq * 2 * max(run["rollout"], 256 if args.eval_every else 0)
    engine = args.vllm_gpu_memory * card if args.vllm else 0
    sampling = held + adam + (engine if args.vllm else copies + kv_cache)
    asleep = 2 * N if args.vllm and args.vllm_keep_weights else 0
    largest_tensor = 4 * shape.vocab * H if args.fsdp else 0
    return {"loading": held + largest_tensor + engine, "sampling": sampling, "update": update + asleep}


def activations(shape: Shape, tokens: int, checkpointing: bool) -> float:
    """Bytes the update keeps for its backward over `tokens` positions: the layers' activations, the head's logits."""
    L, H = shape.layers, shape.hidden
    a = 2 * (12 * H + 4 * shape.intermediate) + 16 * H
    layers = L * tokens * 4 * H + tokens * a if checkpointing else L * tokens * a
    logits = tokens * shape.vocab if tokens * shape.vocab <= 2**27 else 2**25
    return layers + 24 * logits


def estimate(command: str, card_gb: float = 80, nodes: int = 1, prompt_length: int = 512) -> tuple[dict, str]:
    """(GB per phase, the verdict line: 'fits: ...' or 'does not fit: ...') for `command` on a card of `card_gb`."""
    run = read_command(command, nodes, prompt_length)
    gb = {phase: value / GB for phase, value in phases(run, card_gb * GB).items()}
    peak, usable = max(gb.values()), 0.9 * card_gb
    verdict = "fits" if peak <= usable else "does not fit"
    return gb, f"{verdict}: peak {peak:.1f} GB per GPU, of {usable:.0f} GB usable on a {card_gb:.0f} GB GPU"


def gpu_commands() -> list[tuple[str, str]]:
    """(file, command) of every command in README.md's and docs/*.md's code blocks that trains a --model on GPUs."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for command in re.split(r"(?<!\\)\n", block):
                command = re.sub(r"\s*#.*$", "", command, flags=re.M).strip()  # (the comments)
                if re.match(r"(python|torchrun) ", command) and "--model Qwen/" in command:
                    found.append((path.relative_to(ROOT).as_posix(), command))
    return found


def table(card_gb: float, nodes: int) -> None:
    print(f"Every GPU command of README.md and docs/, on an {card_gb:.0f} GB GPU ($NODES: {nodes}); GB per GPU")
    print("| where | file | --model | ranks | memory flags | loading | sampling | update | |")
    print("|---|---|---|---|---|---|---|---|---|")
    for where, command in gpu_commands():
        run, (gb, verdict) = read_command(command, nodes, 512), estimate(command, card_gb, nodes)
        flags = re.findall(
            r"--(?:fsdp|gradient-checkpointing|vllm|lora-rank \d+|micro-batch-size \d+|max-tokens-per-"
            r"micro-batch \d+|vllm-gpu-memory [\d.]+)(?=\s|$)",
            command,
        )
        print(
            f"| {where} | {run['file']} | {run['args'].model} | {run['world_size']} | {' '.join(flags)} | "
            f"{gb['loading']:.0f} | {gb['sampling']:.0f} | {gb['update']:.0f} | {verdict.split(':')[0]} |"
        )


# --- the check on CPU ------------------------------------------------------------------------------

# (layers, hidden, MLP, batch, seq): weights-heavy, activation-heavy, and in between
TINY = [(4, 512, 2048, 2, 128), (2, 256, 1024, 16, 512), (8, 384, 1536, 8, 256)]


def measure_one(layers: int, hidden: int, intermediate: int, batch: int, seq: int, checkpointing: bool) -> None:
    """Child process: one GRPO-like training step (reference log-probs, forward, backward, AdamW) of a Qwen3 with fp32
    weights computing in bf16 (harness.autocast, as load_model on a GPU) on CPU; prints the growth of peak RSS and the
    formula's bytes (with the CPU's fp32 reference in place of bf16), in GB."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from common import get_logprobs, peak_memory_gb
    from harness import autocast

    torch.manual_seed(0)
    vocab, cpu = 1024, torch.device("cpu")
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones_like(ids)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    base = peak_memory_gb(cpu) * 2**30
    policy, ref = Qwen3ForCausalLM(config), Qwen3ForCausalLM(config).to(torch.bfloat16).requires_grad_(False)
    for model in (policy, ref):
        model.forward = autocast(model.forward, cpu, torch.bfloat16)
        model.lm_head.forward = autocast(model.lm_head.forward, cpu, torch.bfloat16)
    if checkpointing:
        policy.activation_checkpointing_enable({"use_reentrant": False})
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    with torch.no_grad():
        get_logprobs(ref, ids, mask, 1, 1.0)
    logprobs, _ = get_logprobs(policy, ids, mask, 1, 1.0)
    logprobs.sum().backward()
    optimizer.step()
    measured = peak_memory_gb(cpu) * 2**30 - base
    shape, tokens = Shape("tiny", layers, hidden, intermediate, 4, 2, vocab=vocab), batch * seq
    predicted = 20 * shape.params + activations(shape, tokens, checkpointing)  # trained 16, ref. 2, casts 2
    print(f"{measured / GB:.4f} {predicted / GB:.4f} {shape.params}")


def check() -> None:
    print(
        "fp32 weights, bf16 autocast, on CPU, one process, policy + bf16 reference; peak RSS growth of a training "
        "step vs the formula"
    )
    print(
        "| layers x hidden x MLP | micro-batch x seq | ckpt | params | measured GB | formula GB | formula / measured |"
    )
    print("|---|---|---|---|---|---|---|")
    for layers, hidden, intermediate, batch, seq in TINY:
        for ckpt in (False, True):
            sizes = map(str, (layers, hidden, intermediate, batch, seq, int(ckpt)))
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.memory_fit", "--one", *sizes],
                capture_output=True,
                cwd=ROOT,
                text=True,
                check=True,
            ).stdout
            measured, predicted, params = map(float, out.split()[-3:])
            print(
                f"| {layers} x {hidden} x {intermediate} | {batch} x {seq} | {'yes' if ckpt else 'no'} | "
                f"{params / 1e6:.1f}M | {measured:.3f} | {predicted:.3f} | {predicted / measured:.2f} |",
                flush=True,
            )


@dataclass
class Args:
    command: str | None = None
    """a training command (python or torchrun): its peak per GPU by phase, and whether it fits"""
    gpu_memory: float = 80
    """the card's memory, GB (H100/A100: 80, H200: 141)"""
    nodes: int = 1
    """nodes, where a command gives them as a variable ($NODES)"""
    prompt_length: int = 512
    """prompt tokens, where a command gives no --max-prompt-length"""
    check: bool = False
    """formula vs measured peak memory on CPU"""
    one: tuple[int, int, int, int, int, int] | None = None
    """internal: LAYERS HIDDEN MLP BATCH SEQ CHECKPOINTING, one measurement, in the child process --check starts"""


def main(args: Args) -> None:
    if args.one:
        measure_one(*args.one[:5], bool(args.one[5]))
    elif args.check:
        check()
    elif args.command:
        gb, verdict = estimate(args.command, args.gpu_memory, args.nodes, args.prompt_length)
        for phase, value in gb.items():
            print(f"{phase:<9} {value:7.1f} GB per GPU")
        print(verdict)
    else:
        table(args.gpu_memory, args.nodes)


if __name__ == "__main__":
    main(tyro.cli(Args))
