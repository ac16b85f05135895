"""Two trainers loaded side by side, each in its own process, taking turns one rollout round at a time: an algorithm
file against TRL's GRPOTrainer at the file's configuration, or against the same file in another checkout (before and
after a change). Rounds taken in turns (A B B A ...) see the same machine, and the ratio of each round to its neighbour
cancels the slow drifts that separate runs on a shared machine show.

    python -m benchmarks.lockstep                               # from the repo root: grpo.py against TRL
    python -m benchmarks.lockstep --shape varied --this-flags="--max-tokens-per-micro-batch 400"
    python -m benchmarks.lockstep --file dapo --against /tmp/before   # dapo.py here against another checkout's

Shapes (fp32 on CPU, `--dtype auto`):
- default: the offline default, 32 prompts x 8 completions, 8 new tokens (EOS after ~3.5);
- realistic: Qwen/Qwen3-0.6B's config (`QWEN3_0_6B`) with 4 of its 28 layers (218.5M parameters), random weights,
  the offline tokenizer: 4 prompts x 4 completions, 32 new tokens (all drawn: random weights almost never sample EOS);
- varied: the same model with EOS made likelier (`realistic_model`), so that lengths spread as a real run's, 256
  new tokens (median ~65, ~8% reach the cap); learning rate 1e-7, so that they stay so;
- tool: episodes of up to 4 turns on the chain task with a calculator (examples/sums.py: a turn ends at '=');
  8 prompts x 4, 96 tokens; against a checkout only.
Both sample at T=1 without top-k or top-p and take 2 updates per rollout on the whole batch (beta 0.04, a reference
model, gradient clipping at 1.0); TRL (`pip install -r benchmarks/requirements.txt`) with `loss_type="grpo"`, no
gradient checkpointing, fp32 on CPU, the same prompts and reward. On a GPU: benchmarks/gpu_check.py, at its own shape.

A round is one training step: sampling, scoring, old and reference log-probs, the updates and the logging. Printed: each
trainer's median seconds per round and range, the split of the round (TRL's: generating and scoring, with its log-probs,
and the rest), the share of padding in the positions the update computed, and the positions model.generate computed per
completion; and the median ratio of neighbouring rounds, with its range. The last line is the same as JSON. Not a test.
"""

import importlib
import json
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import tyro

from benchmarks import as_flags

# Nothing of the project is imported at the top: a worker imports the algorithm file of its own checkout.
ROOT = Path(__file__).resolve().parent.parent
UPDATES_PER_ROLLOUT, BETA = 2, 0.04  # grpo.py's defaults
# Qwen/Qwen3-0.6B's config.json (written out: nothing is downloaded).
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def realistic_model(folder: Path, varied: bool = False) -> None:
    """Qwen3-0.6B with 4 layers, random weights (seed 0) and the offline tokenizer. `varied`: residual dimension 0 is 1
    everywhere (in every embedding; no layer writes it), ~0.84 after the final norm, and 1 + 7.2 in EOS's embedding."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": 4}))
    with torch.no_grad():
        for layer in model.model.layers if varied else ():
            layer.self_attn.o_proj.weight[0] = layer.mlp.down_proj.weight[0] = 0
        if varied:
            model.model.embed_tokens.weight[:, 0] = 1.0
            model.model.embed_tokens.weight[2, 0] = 1.0 + 7.2  # <|im_end|>, the offline tokenizer's EOS
    save_with_offline_tokenizer(model, folder)


def save_with_offline_tokenizer(model, folder: Path) -> None:
    """`model` saved with the offline tokenizer and generation config (ids past its 52 decode to nothing)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(ROOT / "tiny_model")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "tiny_model" / name, folder / name)


class Turns:
    """A worker's side: `ready()` once loaded, `done(figures)` after each round; each waits for the next turn."""

    def __init__(self, conn):
        self.conn, self.start = conn, 0.0

    def ready(self, message: tuple = ("ready", None)) -> None:
        self.conn.send(message)
        if self.conn.recv() == "stop":  # after the last timed round: the worker's process ends here
            raise SystemExit
        self.start = time.perf_counter()

    def done(self, figures: dict) -> None:
        self.ready(("round", {"round_s": time.perf_counter() - self.start, **figures}))


def file_worker(conn, root: str, file: str, flags: list[str]) -> None:
    """Runs `<root>/<file>.py`'s main with `flags`, one step per turn (from its Logger's creation to each step's log),
    with its `perf/*`, the positions the update's forwards computed and how many were padding, and model.generate's."""
    sys.stdout = open(os.devnull, "w")  # the run's progress lines; errors still go to stderr
    sys.path.insert(0, root)
    module, mixin = importlib.import_module(file), importlib.import_module("transformers").GenerationMixin
    turns, logger_class = Turns(conn), module.Logger
    init, log, get_logprobs, generate = logger_class.__init__, logger_class.log, module.get_logprobs, mixin.generate
    counts = dict.fromkeys(("update_positions", "update_padding", "update_tokens", "sampled_positions"), 0)

    def init_then_wait(self, *args, **kwargs):
        init(self, *args, **kwargs)
        turns.ready()

    def log_then_wait(self, step, metrics):
        log(self, step, metrics)
        turns.done(
            {key.removeprefix("perf/"): float(value) for key, value in metrics.items() if key.startswith("perf/")}
            | counts
        )
        counts.update(dict.fromkeys(counts, 0))

    def count(_, args, kwargs):  # a forward's new positions, and those the attention mask leaves out
        counts["update_positions"] += kwargs["input_ids"].numel()
        counts["update_padding"] += int((kwargs["attention_mask"][:, -kwargs["input_ids"].shape[1] :] == 0).sum())

    def counted_get_logprobs(model, ids, mask, P, *args, **kwargs):  # the update's (the file's own calls)
        counts["update_tokens"] += int(mask[:, P:].sum())  # the response tokens it scores
        with getattr(model, "module", model).register_forward_pre_hook(count, with_kwargs=True):
            return get_logprobs(model, ids, mask, P, *args, **kwargs)

    def counted_generate(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)  # rows x new tokens: an ended row keeps its place until the batch ends
        counts["sampled_positions"] += out.shape[0] * (out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    logger_class.__init__, logger_class.log, module.get_logprobs = init_then_wait, log_then_wait, counted_get_logprobs
    mixin.generate = counted_generate
    module.main(module.cli(module.Args, flags))


def trl_worker(conn, model: str, shape: "Shape", rounds: int, seed: int, vllm: bool = False) -> None:
    """TRL's GRPOTrainer at grpo.py's configuration, a rollout round (UPDATES_PER_ROLLOUT optimizer steps) per turn,
    with the seconds of generating and scoring (where TRL computes the old and reference log-probs); the batch sampled
    at once, accumulated in micro-batches of `shape.micro_batch_size` as the files do; bf16 on GPU, fp32 on CPU; with
    `vllm` its colocated engine (its defaults: 30% of the GPU's memory, importance sampling correction on)."""
    sys.stdout = open(os.devnull, "w")
    sys.path.insert(0, str(ROOT))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common import format_prompt, score
    from harness import builtin_splits, load_tokenizer

    tokenizer = load_tokenizer(model, "--model")
    dataset = Dataset.from_list(
        [{"prompt": format_prompt(tokenizer, e["prompt"], True), "answer": e["answer"]} for e in builtin_splits()[0]]
    )  # the train split

    def reward(prompts, completions, answer, **kwargs):
        examples = [{"prompt": p, "answer": a} for p, a in zip(prompts, answer)]  # one per completion
        return score(examples, completions, 1, exact_match=True)[0].tolist()

    turns, seconds = Turns(conn), {"rollout_s": 0.0}

    class EachRound(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            turns.ready()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % UPDATES_PER_ROLLOUT == 0:
                turns.done(dict(seconds))
                seconds["rollout_s"] = 0.0

    batch, gpu = shape.prompts_per_step * shape.group_size, torch.cuda.is_available()
    micro_batch = shape.micro_batch_size or batch
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=10**6,
            seed=seed,
            max_steps=(rounds + 1) * UPDATES_PER_ROLLOUT,
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=batch // micro_batch,
            steps_per_generation=batch // micro_batch,
            num_iterations=UPDATES_PER_ROLLOUT,
            num_generations=shape.group_size,
            top_k=0,
            top_p=1.0,
            max_completion_length=shape.max_new_tokens,
            temperature=1.0,
            learning_rate=shape.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            max_grad_norm=1.0,
            epsilon=0.2,
            beta=BETA,
            scale_rewards="group",
            loss_type="grpo",
            mask_truncated_completions=False,
            bf16=gpu,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=not gpu,
            dataloader_num_workers=0,
            disable_tqdm=True,
            log_completions=False,
            use_vllm=vllm,
            vllm_mode="colocate",
        )
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if gpu else torch.float32)
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[EachRound()],
        )
        rollout = trainer._generate_and_score_completions

        def rollout_timed(*args, **kwargs):
            start = time.perf_counter()
            result = rollout(*args, **kwargs)
            seconds["rollout_s"] += time.perf_counter() - start
            return result

        trainer._generate_and_score_completions = rollout_timed
        trainer.train()


class Worker:
    """The controller's side: a worker process and its pipe."""

    def __init__(self, name: str, target, *args):
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: its own imports, threads and RNG
        self.name, (self.conn, child), self.rounds = name, context.Pipe(), []
        self.process = context.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()

    def receive(self) -> tuple[str, dict]:
        try:
            return self.conn.recv()
        except EOFError:
            raise SystemExit(
                f"error: {self.name} stopped (exit code {self.process.join(5) or self.process.exitcode});"
                " its error is printed above"
            ) from None

    def run_round(self) -> dict:
        self.conn.send("go")
        return self.receive()[1]  # the round's figures

    def stop(self) -> None:
        self.conn.send("stop")
        self.process.join(30)


@dataclass
class Shape:
    """A rollout round's size, as the files' flags name it."""

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    micro_batch_size: Optional[int] = None  # sequences per forward/backward; None: the whole batch
    learning_rate: float = 2e-4  # grpo.py's default; 1e-7 for varied: its lengths must stay as they are

    def flags(self) -> list[str]:
        return as_flags(asdict(self))


SHAPES = {
    "default": Shape(32, 8, 8),
    "realistic": Shape(4, 4, 32),
    "varied": Shape(4, 4, 256, learning_rate=1e-7),
    "tool": Shape(8, 4, 96),
}


def compare(
    file: str,
    against: str,
    model: str,
    shape: Shape,
    rounds: int,
    warmup: int,
    flags: list[str],
    seed: int,
    output_dir: str,
    trl_vllm: bool = False,
    this_flags: list[str] = (),
) -> dict:
    """`<file>.py` of this checkout against TRL or the same file of the checkout at `against`, on `model` at `shape`:
    `warmup` rounds each, then `rounds` in blocks of A B B A; each trainer's figures, and the ratio of neighbours."""
    if rounds < 2 or rounds % 2:
        raise SystemExit(f"error: --rounds {rounds}: must be a positive multiple of 2 (blocks of A B B A)")
    if against == "trl" and importlib.util.find_spec("trl") is None:
        raise SystemExit("error: the comparison with TRL needs trl: pip install -r benchmarks/requirements.txt")
    if against != "trl" and not (Path(against) / f"{file}.py").exists():
        raise SystemExit(f"error: --against {against}: neither 'trl' nor a folder with {file}.py")
    options = {
        "model": model,
        "seed": seed,
        "eval_every": 0,
        "output_dir": output_dir,
        "num_steps": warmup + rounds + 1,
    }
    flags = [*as_flags(options), *shape.flags(), *flags]
    this = Worker(f"{file}.py", file_worker, str(ROOT), file, [*flags, *this_flags, "--run-name", "this"])
    other = (
        Worker("TRL", trl_worker, model, shape, warmup + rounds, seed, trl_vllm)
        if against == "trl"
        else Worker(
            f"{against}/{file}.py", file_worker, str(Path(against).resolve()), file, [*flags, "--run-name", "other"]
        )
    )
    for worker in (this, other):
        worker.receive()  # loaded, waiting for its first turn
    for worker in (this, other) * warmup:
        worker.run_round()
    for worker in (this, other, other, this) * (rounds // 2):
        worker.rounds.append(worker.run_round())
    for worker in (this, other):
        worker.stop()
    ratios = sorted(x["round_s"] / y["round_s"] for x, y in zip(this.rounds, other.rounds))  # neighbours
    return {
        "names": [this.name, other.name],
        "this": summary(this.rounds),
        "other": summary(other.rounds),
        "ratio": statistics.median(ratios),
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "rounds": this.rounds,
    }


def summary(rounds: list[dict]) -> dict:
    times = [r["round_s"] for r in rounds]
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)} | {
        key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "round_s"
    }


def print_comparison(result: dict, shape: Shape, rounds: int, warmup: int) -> None:
    print(
        f"\n{shape.prompts_per_step} prompts x {shape.group_size} completions, {shape.max_new_tokens} new "
        f"tokens; {rounds} timed rounds each after {warmup} warm-up, in turns A B B A"
    )
    print("| trainer | median s/round | min | max | generation s | log-probs s | update s | sampling + scoring s |")
    print("|---|---|---|---|---|---|---|---|")
    names = [result["names"][0] + " (this checkout)", result["names"][1]]
    for name, s in zip(names, (result["this"], result["other"])):
        cells = [f"{s[k]:.3f}" if k in s else "-" for k in ("gen_s", "logprobs_s", "update_s", "rollout_s")]
        print(f"| {name} | {s['median_s']:.3f} | {s['min_s']:.3f} | {s['max_s']:.3f} | {' | '.join(cells)} |")
    for name, s in zip(names, (result["this"], result["other"])):
        if "update_padding" in s:  # (medians over the rounds)
            rows = shape.prompts_per_step * shape.group_size
            print(
                f"{name}: padding {s['update_padding'] / s['update_positions']:.1%} of the positions the update "
                f"computed, {1000 * s['update_s'] / s['update_tokens']:.3f} s per 1,000 response tokens; "
                f"model.generate computed {s['sampled_positions'] / rows:.1f} positions a completion"
            )
    print(
        f"\n{' / '.join(result['names'])}: {result['ratio']:.3f} per round (median of {rounds} neighbouring "
        f"rounds; range {result['ratio_min']:.3f}-{result['ratio_max']:.3f})"
    )


@dataclass
class Args:
    file: Literal["grpo", "dapo", "cispo", "gvpo", "ppo", "drgrpo", "gspo", "rloo", "sapo", "dppo"] = "grpo"
    against: str = "trl"
    """'trl' (TRL's GRPOTrainer at grpo.py's configuration), or another checkout's folder: its --file"""
    shape: Literal["default", "realistic", "varied", "tool"] = "default"
    rounds: int = 8
    """timed rounds of each trainer (a multiple of 2: blocks of A B B A), after --warmup rounds each"""
    warmup: int = 2
    flags: str = ""
    """more flags for the file(s), given last, as --flags="--micro-batch-size 8" (not for TRL)"""
    this_flags: str = ""
    """more flags for this checkout's file only (one the other checkout lacks: --max-tokens-per-micro-batch 1024)"""
    seed: int = 1


def main(args: Args) -> None:
    shape, flags = SHAPES[args.shape], shlex.split(args.flags)
    if args.shape == "tool":  # tool calls: the chain model, episodes of up to 4 turns
        if args.against == "trl":
            raise SystemExit("error: --shape tool runs episodes with an environment: compare it --against a checkout")
        flags = ["--task", "chain", "--env", f"{ROOT / 'examples' / 'sums.py'}:Sums", "--max-turns", "4", *flags]
    with tempfile.TemporaryDirectory() as tmp:
        model = str(ROOT / ("tiny_model_chain" if args.shape == "tool" else "tiny_model"))
        if args.shape in ("realistic", "varied"):
            model = str(Path(tmp) / "model")
            realistic_model(Path(model), varied=args.shape == "varied")
        result = compare(
            args.file,
            args.against,
            model,
            shape,
            args.rounds,
            args.warmup,
            flags,
            args.seed,
            str(Path(tmp) / "runs"),
            this_flags=shlex.split(args.this_flags),
        )
    print_comparison(result, shape, args.rounds, args.warmup)
    print(
        json.dumps(
            {
                "shape": args.shape,
                "file": args.file,
                "against": args.against,
                **{k: v for k, v in result.items() if k != "rounds"},
            }
        )
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
