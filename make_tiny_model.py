"""Make the offline default model in `tiny_model/`: a character-level tokenizer with a ChatML-style
template, a ~0.4M-parameter Qwen3, and a short supervised warm-up on the built-in `a+b` task that
leaves it *partly* skilled (sampled accuracy well below 1, the right answer often in its
distribution), so RL has something to sharpen. Deterministic: the same command rewrites the same
weights on the same torch build.

    python make_tiny_model.py                # ~1 minute on 2 CPU cores
    python make_tiny_model.py --sft-steps 0  # untrained weights, for experiments
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from common import builtin_splits, correctness_reward, evaluate, format_prompt, generate

# ChatML, as Qwen's chat models write it; `<|im_end|>` ends the assistant's turn and is the EOS token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = list("0123456789+-*/=()., ?\n#") + list("abcdefghijklmnopqrstuvwxyz")


@dataclass
class Args:
    output_dir: str = str(Path(__file__).parent / "tiny_model")
    """where the model and tokenizer are written"""
    seed: int = 0
    sft_steps: int = 350
    """supervised steps; fewer leave the model weaker, more make RL's job trivial"""
    batch_size: int = 128
    learning_rate: float = 3e-3
    hidden_size: int = 128
    num_layers: int = 2


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
    torch.manual_seed(args.seed)
    tokenizer = make_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=128, tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")

    train, eval_set = builtin_splits()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))  # 50-step warm-up
    g = torch.Generator().manual_seed(args.seed)
    for step in range(args.sft_steps):
        idx = torch.randint(len(train), (args.batch_size,), generator=g).tolist()
        ids, mask, labels = sft_batch(tokenizer, [train[i] for i in idx])
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == args.sft_steps - 1:
            print(f"sft step {step:>4} | loss {loss.item():.4f}", flush=True)

    model.eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    metrics = evaluate(model, tokenizer, eval_set, True, True, 8, seed=1234)
    prompts = [format_prompt(tokenizer, e["prompt"], True) for e in eval_set]
    texts = generate(model, tokenizer, prompts, 8, 8, 1.0).texts
    right = correctness_reward(texts, [e["answer"] for e in eval_set for _ in range(8)], exact=True).view(-1, 8)
    metrics["eval/pass@8"] = right.max(-1).values.mean().item()
    print(" | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
