"""TRL's GRPOTrainer at grpo.py's configuration, timed per rollout round (sampling + the updates on
it), for benchmarks/step_time.py's comparison. Needs `trl` (optional: pip install -r
benchmarks/requirements.txt); run by step_time.py in its own process, or alone:

    python -m benchmarks.trl_grpo --steps 12 [--prompts-per-step 32 --group-size 8 ...]   # from the repo root

Matched to grpo.py's defaults: the same model folder and tokenizer, the same prompts (the built-in
task, formatted by `data.format_prompt` with the chat template), the same reward (`rewards.score`),
32 prompts x 8 completions per rollout, 8 new tokens at T=1 with no top-k/top-p, 2 updates per
rollout (`num_iterations`) on the whole batch at once, learning rate 2e-4, clip 0.2, k3 KL beta 0.04
to a reference model, std-normalised group advantages, per-sequence token-mean loss (`loss_type="grpo"`),
gradients clipped at 1.0, fp32 (`bf16=False`) and no gradient checkpointing (TRL turns both on by
default). Prints one JSON line: the mean seconds per rollout round after --warmup rounds.
"""

import json
import tempfile
import time
from dataclasses import dataclass

import tyro

from data import builtin_splits, format_prompt
from models import DEFAULT_MODEL, load_tokenizer
from rewards import score


@dataclass
class Args:
    steps: int = 12
    """rollout rounds"""
    warmup: int = 2
    """rounds left out of the mean"""
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 8
    updates_per_rollout: int = 2
    learning_rate: float = 2e-4
    beta: float = 0.04
    seed: int = 1


def main(args: Args) -> None:
    if args.steps <= args.warmup:
        raise SystemExit(f"error: --steps {args.steps} must exceed --warmup {args.warmup}")

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = load_tokenizer(DEFAULT_MODEL, "--model")
    train_set, _ = builtin_splits()
    dataset = Dataset.from_list([{"prompt": format_prompt(tokenizer, e["prompt"], True), "answer": e["answer"]}
                                 for e in train_set])

    def reward(prompts, completions, answer, **kwargs):
        return score(prompts, completions, answer, exact=True)[0].tolist()

    class StepTimer(TrainerCallback):  # when each optimizer step ends; --updates-per-rollout of them make a round
        def __init__(self):
            self.ends = []

        def on_step_end(self, *args, **kwargs):
            self.ends.append(time.perf_counter())

    batch = args.prompts_per_step * args.group_size
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, report_to="none", save_strategy="no", logging_steps=10**6, seed=args.seed,
            max_steps=args.steps * args.updates_per_rollout, per_device_train_batch_size=batch,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=args.updates_per_rollout,
            num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=1.0,
            top_k=0, top_p=1.0, learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
            epsilon=0.2, beta=args.beta, scale_rewards="group", loss_type="grpo", mask_truncated_completions=False,
            bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0, disable_tqdm=True, log_completions=False)
        model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
        timer = StepTimer()
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        start = time.perf_counter()
        trainer.train()
    ends = [start] + timer.ends[args.updates_per_rollout - 1 :: args.updates_per_rollout]  # end of each round
    rounds = [b - a for a, b in zip(ends, ends[1:])][args.warmup :]
    print(json.dumps({"trl_round_s": sum(rounds) / len(rounds), "rounds": len(rounds)}))


if __name__ == "__main__":
    main(tyro.cli(Args))
