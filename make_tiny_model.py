"""Make the offline default models: a character-level tokenizer with a ChatML-style template, a small
Qwen3, and a short supervised warm-up on a built-in task that leaves it *partly* skilled (sampled accuracy
well below 1, the right answer often in its distribution), so RL has something to sharpen. Deterministic:
the same command rewrites the same weights on the same torch build.

    python make_tiny_model.py                # tiny_model/: ~0.4M parameters, a+b, ~1 minute on 2 CPU cores
    python make_tiny_model.py --task chain   # tiny_model_chain/: the lab's model (docs/lab.md), ~5 minutes
    python make_tiny_model.py --task guess   # tiny_model_guess/: the multi-turn game (examples/guess.py), ~7 minutes
    python make_tiny_model.py --sft-steps 0  # untrained weights, for experiments

The chain model's warm-up completions vary as a policy's would, so that RL has behaviour to choose between:
most write every partial sum; some add two numbers in one step, some slip once and carry the slip to the
answer, some slip and correct it after 'wait', some write the total at once. The guess model's warm-up
games likewise mix strategies, one per game: bisection (found in 7 guesses, always), random guesses inside
the interval the answers leave, a scan by a fixed step, and guesses that ignore the last answer.
"""

import random
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from common import correctness_reward, evaluate, format_prompt, generate
from harness import GUESS, TASKS, builtin_splits, load_object

Guess = load_object(GUESS, "--task guess", "class")  # examples/guess.py: the game's environment, as RL plays it

# ChatML, as Qwen's chat models write it; `<|im_end|>` ends the assistant's turn and is the EOS token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = list("0123456789+-*/=()., ?\n#") + list("abcdefghijklmnopqrstuvwxyz")


@dataclass
class Args:
    task: Literal["add", "chain", "guess"] = "add"
    """the built-in task of the warm-up"""
    output_dir: Optional[str] = None
    """where the model and tokenizer are written; left out: the task's default model folder (common.TASKS)"""
    seed: int = 0
    sft_steps: Optional[int] = None
    """supervised steps (left out: 350 for add, 600 for chain and guess); fewer leave the model weaker, more
    leave RL little to learn"""
    batch_size: Optional[int] = None
    """examples a step (left out: 128; 64 games for guess, ~400 guesses, whose long sequences make a step of
    128 over twice as slow on CPU)"""
    learning_rate: float = 3e-3
    hidden_size: int = 128
    num_layers: int = 2
    positions: Optional[int] = None
    """the model's positions, prompt and completion (left out: 128 for add, 160 for chain, 256 for guess: a
    7-guess game takes at most 224)"""


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


def warm_up_game(row: dict, rng: random.Random) -> list[dict]:
    """A game of the guess task for the warm-up data, its messages, played by one strategy: bisection (the
    middle of the interval lo..hi that the answers leave), a random guess in that interval, a scan from a
    random start by a fixed step in the answer's direction (kept in the interval), or a random guess in the
    interval before the last answer (ignoring it). Found within 7 guesses: always, ~50 %, ~28 %, ~25 %."""
    kind = rng.choices(["bisect", "random", "scan", "ignore"], [30, 30, 20, 20])[0]
    game, step, guess, answer = Guess(row), rng.choice([1, 5, 10, 20]), None, None
    messages, (lo, hi), before = [{"role": "user", "content": row["prompt"]}], (0, 99), (0, 99)
    for _ in range(7):
        if kind == "scan":
            if guess is None:
                guess = rng.randrange(100)
            else:
                guess = min(hi, max(lo, guess + (step if answer == "higher" else -step)))
        else:
            guess = {"bisect": (lo + hi) // 2, "random": rng.randint(lo, hi), "ignore": rng.randint(*before)}[kind]
        answer, _, done = game.step(str(guess))
        messages.append({"role": "assistant", "content": str(guess)})
        if done:
            break
        messages.append({"role": "user", "content": answer})
        before, (lo, hi) = (lo, hi), ((max(lo, guess + 1), hi) if answer == "higher" else (lo, min(hi, guess - 1)))
    return messages[:-1] if messages[-1]["role"] == "user" else messages  # after the 7th guess: no more turns


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (any character outside the vocabulary is an error, not an UNK), plus
    three special tokens. The pad token is not the EOS token."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def sft_batch(tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + answer + EOS, left-padded; labels only on the answer and EOS."""
    prompts = [
        tokenizer(format_prompt(tokenizer, e["prompt"], True), add_special_tokens=False).input_ids for e in examples
    ]
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


def chat_batch(tokenizer, conversations: list[list[dict]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Whole conversations as the chat template renders them, left-padded; labels only on the assistant
    turns, from after each `<|im_start|>assistant\n` header to its EOS: the header and all before it are the
    context the policy sees before its turn (the template with add_generation_prompt)."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    header, eos = encode("<|im_start|>assistant\n"), tokenizer.eos_token_id
    seqs = [encode(tokenizer.apply_chat_template(m, tokenize=False)) for m in conversations]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        pad = width - len(seq)
        ids[i, pad:], mask[i, pad:] = torch.tensor(seq), 1
        for j in range(len(header), len(seq)):
            if seq[j - len(header) : j] == header:
                end = seq.index(eos, j)
                labels[i, pad + j : pad + end + 1] = ids[i, pad + j : pad + end + 1]
    return ids, mask, labels


def play_guess(model, tokenizer, rows: list[dict], greedy: bool) -> dict[str, float]:
    """Plays the guess task on `rows` turn by turn, every running game's context in one generate call a turn
    (left-padded; plain softmax at T = 1, or greedy), up to 7 guesses. Success, guesses a game, and what the
    guesses look like: inside the interval lo..hi the answers leave (after the first guess; beside it the
    share a uniform guess would have: above it, the model reads the answers), its midpoint (bisection), a step
    as long as the one before (a scan); and the share of games whose guesses are all midpoints, all inside."""
    games, messages = [Guess(r) for r in rows], [[{"role": "user", "content": r["prompt"]}] for r in rows]
    bounds, history = [(0, 99)] * len(rows), [[] for _ in rows]  # lo..hi; each game's (guess, lo, hi) a turn
    running, won = list(range(len(rows))), 0
    for _ in range(7):
        contexts = [
            tokenizer.apply_chat_template(messages[i], add_generation_prompt=True, tokenize=False) for i in running
        ]
        for i, text in zip(running, generate(model, tokenizer, contexts, 1, 8, 1.0, greedy).texts):
            guess, (lo, hi) = int(text) if text.strip().isdigit() else -1, bounds[i]  # -1: as Guess.step reads it
            history[i].append((guess, lo, hi))
            answer, reward, done = games[i].step(text)
            messages[i].append({"role": "assistant", "content": text})
            if not done:
                messages[i].append({"role": "user", "content": answer})
                bounds[i] = (max(lo, guess + 1), hi) if answer == "higher" else (lo, min(hi, guess - 1))
            won += int(reward)
        if not (running := [i for i in running if messages[i][-1]["role"] == "user"]):
            break
    mean = lambda xs: sum(xs := list(xs)) / max(1, len(xs))  # noqa: E731
    inside, middle = (lambda g, lo, hi: lo <= g <= hi), (lambda g, lo, hi: g == (lo + hi) // 2)
    later, turns = [t for h in history for t in h[1:]], [t for h in history for t in h]
    same_step = [abs(c[0] - b[0]) == abs(b[0] - a[0]) for h in history for a, b, c in zip(h, h[1:], h[2:])]
    return {
        "success": won / len(rows),
        "turns": len(turns) / len(rows),
        "inside": mean(inside(*t) for t in later),
        "inside_uniform": mean((hi - lo + 1) / 100 for _, lo, hi in later),
        "midpoint": mean(middle(*t) for t in turns),
        "same_step": mean(same_step),
        "games_all_midpoint": mean(all(middle(*t) for t in h) for h in history),
        "games_all_inside": mean(all(inside(*t) for t in h) for h in history),
    }


def main(args: Args) -> None:
    model_dir, max_new_tokens = TASKS[args.task]
    output_dir = args.output_dir or model_dir
    positions = args.positions or {"add": 128, "chain": 160, "guess": 256}[args.task]
    sft_steps = {"add": 350, "chain": 600, "guess": 600}[args.task] if args.sft_steps is None else args.sft_steps
    batch_size = args.batch_size or (64 if args.task == "guess" else 128)
    torch.manual_seed(args.seed)
    tokenizer = make_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}")

    train, eval_set = builtin_splits(args.task)
    completions = random.Random(args.seed)  # the chain task's warm-up completions (guess: games), drawn afresh
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))  # 50-step warm-up
    g = torch.Generator().manual_seed(args.seed)
    for step in range(sft_steps):
        idx = torch.randint(len(train), (batch_size,), generator=g).tolist()
        if args.task == "guess":
            ids, mask, labels = chat_batch(tokenizer, [warm_up_game(train[i], completions) for i in idx])
        else:
            examples = [
                train[i]
                if args.task == "add"
                else {
                    "prompt": train[i]["prompt"],
                    "answer": warm_up_completion([int(n) for n in train[i]["prompt"].split("+")], completions),
                }
                for i in idx
            ]
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
    if args.task == "guess":  # a game of turns, played here (evaluate grades one completion)
        torch.manual_seed(1234)
        sampled, greedy = (play_guess(model, tokenizer, eval_set, flag) for flag in (False, True))
        metrics = {
            **{f"eval/{k}": v for k, v in sampled.items()},
            **{f"eval/{k}_greedy": greedy[k] for k in ("success", "turns", "inside", "midpoint")},
        }
    else:
        metrics = evaluate(model, tokenizer, eval_set, True, True, max_new_tokens, seed=1234)
        prompts = [format_prompt(tokenizer, e["prompt"], True) for e in eval_set]
        texts = generate(model, tokenizer, prompts, 8, max_new_tokens, 1.0).texts
        right = correctness_reward(texts, [e["answer"] for e in eval_set for _ in range(8)], exact_match=True).view(
            -1, 8
        )
        metrics["eval/pass@8"] = right.max(-1).values.mean().item()
    print(" | ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"wrote {output_dir}")


if __name__ == "__main__":
    main(tyro.cli(Args))
