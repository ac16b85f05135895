"""Make the offline default models: a character-level tokenizer with a ChatML-style template, a small
Qwen3, and a short supervised warm-up on a built-in task that leaves it *partly* skilled (sampled accuracy
well below 1, the right answer often in its distribution), so RL has something to sharpen. Deterministic:
the same command rewrites the same weights on the same torch build.

    python make_tiny_model.py                # tiny_model/: ~0.4M parameters, a+b, ~1 minute on 2 CPU cores
    python make_tiny_model.py --task chain   # tiny_model_chain/: the lab's model (docs/lab.md), ~5 minutes
    python make_tiny_model.py --sft-steps 0  # untrained weights, for experiments

The chain model's warm-up completions vary as a policy's would, so that RL has behaviour to choose between:
most write every partial sum; some add two numbers in one step, some slip once and carry the slip to the
answer, some slip and correct it after 'wait', some write the total at once.
"""

import random
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from common import TASKS, builtin_splits, correctness_reward, evaluate, format_prompt, generate

# ChatML, as Qwen's chat models write it; `<|im_end|>` ends the assistant's turn and is the EOS token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = list("0123456789+-*/=()., ?\n#") + list("abcdefghijklmnopqrstuvwxyz")


@dataclass
class Args:
    task: Literal["add", "chain"] = "add"
    """the built-in task of the warm-up"""
    output_dir: Optional[str] = None
    """where the model and tokenizer are written; left out: the task's default model folder (common.TASKS)"""
    seed: int = 0
    sft_steps: Optional[int] = None
    """supervised steps (left out: 350 for add, 600 for chain); fewer leave the model weaker, more leave RL
    little to learn"""
    batch_size: int = 128
    learning_rate: float = 3e-3
    hidden_size: int = 128
    num_layers: int = 2
    positions: Optional[int] = None
    """the model's positions, prompt and completion (left out: 128 for add, 160 for chain)"""


def warm_up_completion(numbers: list[int], rng: random.Random) -> str:
    """A completion of the chain task for the warm-up data: the partial sums written out (half of them),
    two numbers added in one step, a slip by 1 or 10 carried to the answer, a slip corrected after
    'wait', or the total at once (the others)."""
    kind = rng.choices(["full", "skip", "slip", "wait", "direct"], [50, 15, 15, 10, 10])[0]
    slip = rng.randrange(1, len(numbers))  # where a slip happens (the term that is added)
    skip = rng.randrange(1, len(numbers) - 1) if kind == "skip" and len(numbers) > 2 else None
    steps, total, i = [], numbers[0], 1
    while i < len(numbers):
        terms = numbers[i : i + 2] if i == skip else numbers[i : i + 1]
        written = "+".join(map(str, [total, *terms]))
        right = total + sum(terms)
        wrong = max(0, right + rng.choice([-10, -1, 1, 10])) if slip in range(i, i + len(terms)) else right
        if wrong != right and kind == "wait":
            steps.append(f"{written}={wrong} wait {written}={right}")
        else:
            steps.append(f"{written}={wrong if kind == 'slip' else right}")
            right = wrong if kind == "slip" else right
        total, i = right, i + len(terms)
    return " ".join(([] if kind == "direct" else steps) + [f"#### {total}"])


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (any character outside the vocabulary is an error, not an UNK), plus
    three special tokens. The pad token is not the EOS token."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE, padding_side="left")


def sft_batch(tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + answer + EOS, left-padded; labels only on the answer and EOS."""
    prompts = [tokenizer(format_prompt(tokenizer, e["prompt"], True), add_special_tokens=False).input_ids
               for e in examples]
    answers = [tokenizer(e["answer"] + tokenizer.eos_token, add_special_tokens=False).input_ids for e in examples]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        seq = torch.tensor(p + a)
        ids[i, width - len(seq) :], mask[i, width - len(seq) :] = seq, 1
        labels[i, width - len(a) :] = torch.tensor(a)
    return ids, mask, labels


def main(args: Args) -> None:
    model_dir, max_new_tokens = TASKS[args.task]
    output_dir, positions = args.output_dir or model_dir, args.positions or {"add": 128, "chain": 160}[args.task]
    sft_steps = {"add": 350, "chain": 600}[args.task] if args.sft_steps is None else args.sft_steps
    torch.manual_seed(args.seed)
    tokenizer = make_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=positions, tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")

    train, eval_set = builtin_splits(args.task)
    completions = random.Random(args.seed)  # the chain task's warm-up completions, drawn afresh each time
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))  # 50-step warm-up
    g = torch.Generator().manual_seed(args.seed)
    for step in range(sft_steps):
        idx = torch.randint(len(train), (args.batch_size,), generator=g).tolist()
        examples = [train[i] if args.task == "add" else
                    {"prompt": train[i]["prompt"], "answer": warm_up_completion(
                        [int(n) for n in train[i]["prompt"].split("+")], completions)} for i in idx]
        ids, mask, labels = sft_batch(tokenizer, examples)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == sft_steps - 1:
            print(f"sft step {step:>4} | loss {loss.item():.4f}", flush=True)

    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    metrics = evaluate(model, tokenizer, eval_set, True, True, max_new_tokens, seed=1234)
    prompts = [format_prompt(tokenizer, e["prompt"], True) for e in eval_set]
    texts = generate(model, tokenizer, prompts, 8, max_new_tokens, 1.0).texts
    right = correctness_reward(texts, [e["answer"] for e in eval_set for _ in range(8)], exact=True).view(-1, 8)
    metrics["eval/pass@8"] = right.max(-1).values.mean().item()
    print(" | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"wrote {output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
