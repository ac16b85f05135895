"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization.

GRPO's group-relative advantage without GRPO's KL term, and four changes for long reasoning RL:
the clip range is decoupled so that unlikely tokens can grow ("clip-higher"); groups whose
completions are all right or all wrong carry no signal and are replaced by fresh prompts until the
batch is full ("dynamic sampling"); the loss is a mean over every token of the optimizer step, not
over sequences ("token-level loss"); and completions that run into the length limit are penalised
softly ("overlong reward shaping"). The correctness reward is +1 / -1, as in the paper.

Paper: Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476 (2025); the soft overlong punishment is its Eq. 13.

Objective (maximised; r = pi_theta / pi_old per token, A_i = (R_i - mean R) / (std R + eps)):
    J = 1/sum_i |o_i| sum_i sum_t min(r_it A_i, clip(r_it, 1-eps_low, 1+eps_high) A_i)
    s.t. 0 < |{o_i : o_i is correct}| < G
    R_i = (+1 if correct else -1) + R_length(|o_i|)   (soft overlong punishment, Eq. 13)

Differences from grpo.py:
- Clip-higher: clip(r, 1 - 0.2, 1 + 0.28) instead of clip(r, 1 - 0.2, 1 + 0.2).
- Dynamic sampling: groups with all-equal correctness are dropped and refilled from fresh prompts,
  at most --max-gen-rounds rounds; when the budget runs out the step trains on what it kept.
- Token-level loss: summed over tokens, divided by the step's token count (all micro-batches and
  ranks), instead of a mean per sequence then over sequences.
- Overlong reward shaping: a penalty ramping from 0 to -1 over the last --overlong-buffer tokens
  before --max-new-tokens; optional --overlong-filtering masks truncated completions out of the loss.
- No KL term and no reference model.

Off-policy (--off-policy-steps K, rollouts sampled K steps behind): --anchor recompute clips r around the policy at
the update's start, --rollout-correction weighing each token by pi_old / pi_sampler (AReaL's decoupled PPO); --anchor
behaviour clips r = pi_theta / pi_sampler, the asymmetric band centred on the stale sampler (verl's bypass mode).

Run:
    python dapo.py                                          # offline default: tiny model, a+b task, CPU
    torchrun --standalone --nproc_per_node=2 dapo.py        # data-parallel (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 dapo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset train.jsonl --max-new-tokens 512 --learning-rate 1e-6 --micro-batch-size 16
"""

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (
    SamplerWeights,
    UsageError,
    add_metrics,
    all_reduce,
    cat_rollouts,
    evaluate,
    format_prompt,
    generate,
    get_logprobs,
    micro_batches,
    no_sync,
    print0,
    prompt_batch,
    reweighted,
    rollout_logprobs,
    rollout_weights,
    sampler_logprob_gap,
    score,
    select_rows,
    step_metrics,
    timed,
)
from harness import (
    Logger,
    add_lora,
    check_flags,
    claim_run_dir,
    cleanup_distributed,
    cli,
    clip_grad_norm,
    load_checkpoint,
    load_model,
    load_task,
    load_vllm,
    prepare_run_dir,
    require,
    save_checkpoint,
    setup_distributed,
    shard_model,
)

# ---------------------------------------------------------------------------------------------
# 1. Config
# ---------------------------------------------------------------------------------------------


@dataclass
class ExperimentFlags:
    seed: int = 1
    """seed of the data order, the sampling and evaluation"""
    run_name: Optional[str] = None
    """metrics and checkpoints go to <output-dir>/<run-name>; left out: <file>__<seed>__<unix time>__<pid>"""
    output_dir: str = "runs"
    """folder of all runs"""
    track: bool = False
    """log to Weights & Biases (pip install wandb)"""
    eval_every: int = 20
    """evaluate on the held-out split every N steps, and at the end (0: never)"""
    save_every: int = 0
    """save a resumable checkpoint (weights, optimizer, RNG, step) every N steps (0: only the final weights)"""
    keep_checkpoints: int = 0
    """keep only the newest N step checkpoints, removing older ones after each save (0: keep all)"""
    resume: Optional[str] = None
    """continue from a checkpoint folder <run>/step_N (in <run>, or in --run-name's folder when given), or
    'latest' for the newest checkpoint of --run-name's run"""


@dataclass
class ModelAndDataFlags:
    model: Optional[str] = None
    """Hugging Face model name or local folder; left out: the bundled tiny model of --task"""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """compute dtype; auto = float32 on CPU, bfloat16 on GPU. What the optimizer trains is held in float32 whatever it
    is (bf16 weights round updates of ~1e-6 away), what is frozen (the reference, a LoRA base) in it; final/ is saved
    in the checkpoint's own dtype; the log-softmax of the log-probs is float32"""
    lm_head_fp32: bool = False
    """compute the LM head in float32 on a bfloat16 model, for the log-probs and for sampling (model.generate and
    vLLM alike): logits not rounded to bf16, a smaller sampler gap, for a float32 matmul over the vocabulary"""
    dataset: Optional[str] = None
    """training data: a JSONL file, a Hugging Face dataset name, or a JSON/Parquet/CSV file or dataset folder
    (needs `pip install datasets`); left out: the built-in --task"""
    task: Optional[Literal["add", "chain", "guess"]] = None
    """built-in task, without --dataset: add (a+b, answered with the digits), chain (sums of 2-6 numbers,
    partial sums then '#### total': the lab, docs/lab.md) or guess (find a number from 0 to 99 over turns,
    told 'higher' or 'lower': multi-turn); left out: add"""
    dataset_config: Optional[str] = None
    """configuration of --dataset (e.g. 'main' for openai/gsm8k)"""
    split: str = "train"
    """split of --dataset to train on"""
    eval_dataset: Optional[str] = None
    """held-out data, in the same forms; left out: --eval-split of --dataset, else its last --eval-size rows"""
    eval_split: Optional[str] = None
    """split of the held-out data; left out: 'test' for --eval-dataset (or its only split)"""
    eval_size: int = 500
    """held-out prompts taken from the built-in task or --dataset when there is no --eval-dataset or --eval-split"""
    prompt_field: str = "prompt"
    """the rows' prompt field (e.g. 'question' for openai/gsm8k, 'problem' for MATH), or a dotted path to a nested
    one; its value text, or a list of chat messages (TRL's conversational prompts, verl's parquet)"""
    answer_field: str = "answer"
    """the rows' gold-answer field, or a dotted path ('reward_model.ground_truth' in verl's parquet); a final
    \\boxed{} or GSM8K's '#### 72' in it is found"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template, when it has one (a list of messages needs it)"""
    system_prompt: Optional[str] = None
    """a system message put before every prompt that has none, in training and evaluation (needs the chat
    template); left out: none, or the template's own default (Qwen2.5's, SmolLM2's)"""
    format_weight: float = 0.0
    """weight of the format reward (answer as a bare number / in \\boxed{}) added to correctness"""
    reward_fn: Optional[str] = None
    """extra reward 'module:function' or 'file.py:function', called as fn(prompts, completions, answers)"""
    env: Optional[str] = None
    """multi-turn environment 'file.py:Class' or 'module:Class', one per episode, made from its dataset row; it
    answers each turn and gives the rewards (docs/environments.md)"""


@dataclass
class RolloutFlags:
    num_steps: int = 200
    """training steps; each samples one rollout and takes updates-per-rollout x num-minibatches optimizer steps"""
    prompts_per_step: int = 32
    """prompts per rollout, over all ranks"""
    group_size: int = 8
    """G: completions sampled per prompt"""
    max_prompt_length: Optional[int] = None
    """drop prompts longer than this many tokens after the chat template; left out: only those that leave
    no room for --max-new-tokens in the model's positions are dropped"""
    max_new_tokens: Optional[int] = None
    """tokens after the prompt: the completion's, or with --max-turns > 1 the episode's (the policy's turns and
    the observations); one that reaches it without EOS is 'truncated'; left out: 64 for --task chain, 192 for
    guess, else 8"""
    max_turns: Optional[int] = None
    """the policy's turns per episode, each answered by the environment (--env); an episode that has not ended
    after them is 'truncated'; left out: 7 for --task guess, else 1"""
    temperature: float = 1.0
    """sampling temperature; log-probs divide the logits by it too"""
    vllm: bool = False
    """sample rollouts and evaluations with a vLLM engine beside the policy on each rank's device, which gets the
    policy's weights after each change (pip install -r requirements-vllm.txt, in an environment of its own)"""
    vllm_gpu_memory: float = 0.3
    """fraction of the GPU's memory the vLLM engine takes for its weights and KV cache (--vllm on a GPU)"""
    vllm_keep_weights: bool = True
    """the vLLM engine keeps its weights on the GPU between calls, freeing only its KV cache for the update;
    --no-vllm-keep-weights frees them too (memory for a larger update, a push before every call)"""
    rollout_correction: Literal["auto", "none", "tis", "mis", "seq-tis", "seq-mis", "geo-mis"] = "auto"
    """weight each token's loss by w = pi_old / pi_sampler, truncated at --correction-cap (tis), or keep only
    the tokens with w in [1/cap, cap] (mis); seq-tis, seq-mis: the same with the completion's ratio prod_t w_t on
    each of its tokens; geo-mis: seq-mis with the geometric mean of w; auto: tis with --vllm, else none"""
    correction_cap: float = 2.0
    """C of --rollout-correction"""
    off_policy_steps: int = 0
    """K: sample each step's rollout with the policy's weights of K steps before (the initial ones for the first K), as
    an asynchronous trainer's sampler lags behind; the latest K are kept on the host and in checkpoints (4 bytes a
    trained parameter each); 0: with the policy as it is"""
    anchor: Literal["recompute", "behaviour"] = "recompute"
    """pi_old of the loss: recompute (the policy at the update's start, a forward pass; --rollout-correction weighs
    pi_old / pi_sampler: AReaL's decoupled loss) or behaviour (the sampler's log-probs, no pass: the ratio and its clip
    act on pi_theta / pi_sampler, as verl's bypass mode, prime-rl and TRL's AsyncGRPO)"""


@dataclass
class OptimizationFlags:
    learning_rate: float = 2e-4
    """tuned for the tiny default model; 1e-6 is the paper's value for 7B models"""
    updates_per_rollout: int = 2
    """mu: passes over each rollout (1 makes the ratio exactly 1 and clipping inactive)"""
    num_minibatches: int = 1
    """optimizer steps per pass over the rollout"""
    micro_batch_size: Optional[int] = None
    """sequences per forward/backward on each rank, accumulated up to the minibatch; left out: the whole minibatch"""
    max_tokens_per_micro_batch: Optional[int] = None
    """also at most this many positions per forward (rows x (widest prompt + longest response)): rows sorted by
    length, longest first (whole groups where their shared prompt costs less), so that micro-batches carry little
    padding, as verl's ppo_max_token_len_per_gpu; a longer row runs alone; left out: rows in their order"""
    fsdp: bool = False
    """shard weights, gradients and optimizer state over the ranks (FSDP2; bf16 compute on GPU) instead of DDP"""
    dist_timeout: float = 60.0
    """minutes a rank waits for the others at a collective before the run stops (a step's generation and
    scoring must fit in it)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass: less activation memory, ~1/3 more compute"""
    lora_rank: int = 0
    """train LoRA adapters of this rank instead of the whole model (pip install peft; the reference model is
    then the policy with its adapters off, no copy); 0: full fine-tuning"""
    lora_alpha: float = 16.0
    """the adapters' scale is lora-alpha / lora-rank (their dropout is 0: the trained distribution must be the
    sampled one)"""
    lora_targets: str = "all-linear"
    """modules that get adapters: all-linear (every linear layer of the transformer blocks) or names, q_proj,v_proj"""
    max_grad_norm: float = 1.0
    """gradient clipping (verl and the DAPO script use 1.0)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""


@dataclass
class AlgorithmFlags:
    clip_eps_low: float = 0.2
    """lower clip: the ratio is kept above 1 - clip_eps_low (paper: 0.2)"""
    clip_eps_high: float = 0.28
    """upper clip, decoupled from the lower ("clip-higher"): the ratio is kept below 1 + clip_eps_high (paper: 0.28)"""
    std_eps: float = 1e-6
    """added to the group std before dividing (verl's value)"""
    max_gen_rounds: int = 10
    """dynamic sampling: generation rounds per step at most (verl recipe: 10); then train on the groups kept"""
    overlong_buffer: int = 4
    """L_cache: the overlong penalty ramps from 0 to -1 over the last N tokens before --max-new-tokens
    (paper: 4096 of 20480); 0: no overlong penalty"""
    overlong_filtering: bool = False
    """mask truncated completions out of the loss (off in the paper's best run)"""


@dataclass
class Args(AlgorithmFlags, OptimizationFlags, RolloutFlags, ModelAndDataFlags, ExperimentFlags):
    """Every flag, flat (args.seed, args.beta, ...); `--help` shows them in the groups above."""

    # Computed at runtime
    world_size: tyro.conf.Suppress[int] = 1
    local_prompts_per_step: tyro.conf.Suppress[int] = 0
    local_batch_size: tyro.conf.Suppress[int] = 0
    minibatch_size: tyro.conf.Suppress[int] = 0
    max_sequence_length: tyro.conf.Suppress[int] = 0  # the longest prompt + --max-new-tokens (load_task)


# ---------------------------------------------------------------------------------------------
# 2. Algorithm
# ---------------------------------------------------------------------------------------------


def compute_advantages(rewards: torch.Tensor, group_size: int, std_eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantage: (R_i - mean_G R) / (std_G R + eps), with the unbiased std.

    rewards: (B,) with the G completions of each prompt stored contiguously -> advantages (B,).
    A group whose rewards are all equal gets advantage 0 for every member."""
    grouped = rewards.view(-1, group_size)  # (B/G, G)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)  # unbiased (1/(G-1)), as verl and TRL
    return ((grouped - mean) / (std + std_eps)).view(-1)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """Soft overlong punishment (DAPO Eq. 13), added to the reward: 0 up to max_length - buffer tokens,
    then falling linearly to -1 at max_length, and -1 beyond (buffer 0: none). lengths: (B,) response tokens,
    EOS included."""
    return ((max_length - buffer - lengths) / buffer).clamp(-1.0, 0.0) if buffer else torch.zeros_like(lengths)


def filter_groups(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dynamic sampling's filter: True for the groups whose completions are neither all right nor all
    wrong. It looks at correctness, not the shaped reward, so the overlong penalty or a format reward
    cannot let a group with no correctness signal through. correct: (B,) 0/1 -> keep: (B/G,) bool."""
    grouped = correct.view(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def compute_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    num_tokens: float | torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO loss (minimised): clipped surrogate with a decoupled clip range, summed over tokens and
    divided by `num_tokens` ("token-mean": every token of the step weighs the same, whatever the
    length of its sequence).

    logprobs, old_logprobs, response_mask: (B, T); advantages: (B,).
    num_tokens: the number of response tokens in the whole optimizer step (every micro-batch, every
    rank), so that micro-batch losses add up to the step's mean; computed once by the caller."""
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T); exactly 1 on the first update of a rollout
    adv = advantages.unsqueeze(-1)  # (B, 1): one advantage for every token of a completion
    pg_losses = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high))  # (B, T)
    loss = (pg_losses * response_mask).sum() / num_tokens

    with torch.no_grad():  # each metric a (sum, count), added up over the step's micro-batches and ranks, then divided
        n = response_mask.sum()  # (tensors: the caller syncs them with the device once a step)
        clipped = (ratio < 1 - clip_eps_low) | (ratio > 1 + clip_eps_high)
        pull = ratio * adv.abs() * response_mask  # (B, T) |d(r A) / d log pi|: each token's gradient, unbounded
        binds = torch.where(adv > 0, ratio > 1 + clip_eps_high, ratio < 1 - clip_eps_low)  # the clip takes all of it
        metrics = {
            "loss/policy": ((pg_losses * response_mask).sum(), n),
            "policy/clipfrac": ((clipped.float() * response_mask).sum(), n),
            "policy/clipfrac_low": (((ratio < 1 - clip_eps_low).float() * response_mask).sum(), n),
            "policy/clipfrac_high": (((ratio > 1 + clip_eps_high).float() * response_mask).sum(), n),
            "policy/gradient_removed": ((pull * binds).sum(), pull.sum()),  # a share of sum |r A|
            "policy/approx_kl": ((((ratio - 1) - torch.log(ratio)) * response_mask).sum(), n),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# 3. Training
# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    check_flags(args)  # the shared flags and the per-rank batch sizes, before anything is loaded or written
    # --- algorithm: DAPO's flags ---
    require(args.group_size >= 2, "--group-size", args.group_size, ">= 2 (a group advantage needs 2 completions)")
    require(0 < args.clip_eps_low < 1, "--clip-eps-low", args.clip_eps_low, "in (0, 1)")
    require(args.clip_eps_high > 0, "--clip-eps-high", args.clip_eps_high, "> 0")
    require(args.std_eps >= 0, "--std-eps", args.std_eps, ">= 0")
    require(args.max_gen_rounds >= 1, "--max-gen-rounds", args.max_gen_rounds, ">= 1")
    if not 0 <= args.overlong_buffer <= args.max_new_tokens:
        raise UsageError(
            f"--overlong-buffer {args.overlong_buffer} must be between 0 and --max-new-tokens "
            f"({args.max_new_tokens}): the penalty ramps over the last N tokens (0: none)."
        )
    # ---
    rank, args.world_size, device = setup_distributed(args.dist_timeout)
    run_info = {"algorithm": Path(__file__).name, "config": asdict(args)}  # recorded in every checkpoint
    run_dir, resume_dir = prepare_run_dir(run_info, rank)  # where it writes, and from what it resumes
    task = load_task(args)  # the data, its scoring and environment, before any model: bad input fails fast
    tokenizer = task.tokenizer

    # Seeded alike on every rank while loading (new weights, e.g. LoRA's, are the same), then by rank (own samples).
    torch.manual_seed(args.seed)
    policy = load_model(
        args.model,
        args.dtype,
        device,
        tokenizer,
        gradient_checkpointing=args.gradient_checkpointing,
        trained=args.lora_rank == 0,
        sharded=args.fsdp,
        lm_head_fp32=args.lm_head_fp32,
    )
    policy = add_lora(policy, args.lora_rank, args.lora_alpha, args.lora_targets)  # as it is with --lora-rank 0
    if args.fsdp:  # sharded in place; FSDP2 averages gradients over ranks, as DDP does
        shard_model(policy, device, args.dtype)
    torch.manual_seed(args.seed + rank)
    # --- algorithm: what the optimizer trains: the policy ---
    optimizer = torch.optim.AdamW(
        policy.parameters(),
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        fused=True,  # one kernel for all the weights
    )
    trained = {"policy": policy}  # saved to and restored from checkpoints
    # ---
    start_step, state = load_checkpoint(resume_dir, trained, optimizer, rank)  # state: the algorithm's, per rank
    # --- algorithm: prompt batches drawn so far (dynamic sampling draws several a step) ---
    state.setdefault("draw", 0)
    # ---
    # What the update calls: DDP averages gradients over ranks (FSDP2 has sharded in place: nothing to wrap).
    wrapped = {name: DDP(m) if args.world_size > 1 and not args.fsdp else m for name, m in trained.items()}
    model = wrapped["policy"]
    # The sampler: model.generate, or a vLLM engine on this rank's device, which gets the policy's weights at its
    # first call after an optimizer step (a hook on `optimizer`)
    vllm = load_vllm(args, rank, optimizer)
    # The weights that sample: the policy's, or with --off-policy-steps K those of K steps before (kept in `state`)
    sampler_weights = SamplerWeights(policy, args.off_policy_steps, state, vllm)
    claim_run_dir(run_dir, resume_dir, rank)  # created and locked: from here on this run writes there
    logger = Logger(run_dir, asdict(args), rank, args.track, args.num_steps)
    print0(f"{args.prompts_per_step} prompts x {args.group_size} completions per step on {args.world_size} rank(s)")

    for step in range(start_step, args.num_steps):
        step_start, times, metrics = time.perf_counter(), {}, {}
        if args.eval_every and step % args.eval_every == 0:
            metrics = evaluate(policy, task, args.chat_template, args.max_new_tokens, args.seed, vllm=vllm)

        # --- algorithm: 1-3. dynamic sampling: the groups with mixed correctness are kept, and fresh prompts
        # drawn until every rank has its share. Every rank runs the same number of rounds (decided on
        # all-reduced counts), or the collectives below would deadlock.
        sampled, times["gen"] = [], 0.0  # (rollout, rewards, components, keep) of each round
        for gen_round in range(1, args.max_gen_rounds + 1):
            batch = prompt_batch(task.train, state["draw"], args.prompts_per_step, rank, args.world_size, args.seed)
            state["draw"] += 1
            prompts = [format_prompt(tokenizer, e["prompt"], args.chat_template) for e in batch]
            with timed(times, "gen"), sampler_weights.behind(step):
                rollout = generate(
                    policy,
                    tokenizer,
                    prompts,
                    args.group_size,
                    args.max_new_tokens,
                    args.temperature,
                    vllm=vllm,
                    env=task.env,
                    rows=batch,
                )
            rewards, components = score(
                batch,
                rollout.texts,
                args.group_size,
                task.exact_match,
                args.format_weight,
                task.reward_fn,
                args.reward_fn,
                rollout.env_return,
            )
            # Correctness counted twice, less 1: +1 right, -1 wrong (the paper's rule reward) instead of score's 1 / 0
            rewards = rewards + components["correct"] - 1
            components["overlong"] = overlong_penalty(
                rollout.response_mask.sum(-1), args.max_new_tokens, args.overlong_buffer
            )
            rewards = rewards + components["overlong"]
            keep = filter_groups(components["correct"], args.group_size).repeat_interleave(args.group_size)  # (B,)
            sampled.append((rollout, rewards, components, keep))
            num_kept = sum(k.sum().item() for *_, k in sampled) // args.group_size
            num_kept = all_reduce(torch.tensor(num_kept, device=device), "min").item()  # the same on every rank
            if num_kept >= args.local_prompts_per_step:
                break
        if num_kept < args.local_prompts_per_step:
            print0(
                f"step {step}: dynamic sampling kept {num_kept * args.world_size} of {args.prompts_per_step} "
                f"groups in {args.max_gen_rounds} rounds (--max-gen-rounds); training on those"
            )
        # Every completion sampled this step (what the logs describe), and the batch trained on: the first
        # kept groups, exactly as many on every rank (the step's share, or all that the budget gave).
        rollout = cat_rollouts([r for r, *_ in sampled], tokenizer.pad_token_id)
        rewards = torch.cat([r for _, r, *_ in sampled])
        components = {name: torch.cat([c[name] for *_, c, _ in sampled]) for name in components}
        keep = torch.cat([k for *_, k in sampled])  # (B_sampled,)
        b_rows = keep.nonzero().squeeze(-1)[: min(num_kept, args.local_prompts_per_step) * args.group_size]
        b_rollout, b_rewards = select_rows(rollout, b_rows), rewards[b_rows]
        metrics["algo/gen_rounds"] = gen_round
        metrics["algo/kept_groups_frac"] = keep.float().mean()

        # 4. advantages (none when dynamic sampling kept no group: there is nothing to train on)
        b_advantages = compute_advantages(b_rewards, args.group_size, args.std_eps) if len(b_rewards) else b_rewards
        b_advantages = b_advantages.to(device)  # (B,)
        # ---
        b_ids, b_attention_mask = b_rollout.input_ids, b_rollout.attention_mask  # (B, P+T)
        b_response_mask = b_rollout.response_mask  # (B, T): 1 on the response tokens, EOS included

        # 5. old log-probs by the training model (the ratio starts at 1; with one step per pass, pass 1 gives them), or
        # the sampler's (--anchor behaviour)
        # --- algorithm: nothing needs the old log-probs before the update ---
        old_in_pass_1 = args.num_minibatches == 1
        # ---
        with timed(times, "logprobs"):
            # pi_prox, the policy at the update's start: pi_old (--anchor recompute), or the staleness's measure
            if old_in_pass_1:
                b_proximal_logprobs = torch.zeros_like(b_response_mask)  # (B, T), filled in by pass 1
            elif args.anchor == "recompute":
                b_proximal_logprobs = rollout_logprobs(
                    model,
                    b_rollout,
                    args.temperature,
                    micro_batch_size=args.micro_batch_size,
                    max_tokens=args.max_tokens_per_micro_batch,
                    group_size=args.group_size,
                )
            else:  # behaviour: no pass is run for them
                b_proximal_logprobs = None
            # pi_old: the proximal policy, or the behaviour policy (the log-probs its sampler drew with)
            b_old_logprobs = b_rollout.sampler_logprobs if args.anchor == "behaviour" else b_proximal_logprobs

        # 6. update: updates_per_rollout passes x num_minibatches optimizer steps x micro-batches
        update_start, update_metrics = time.perf_counter(), {}  # (sum, count) of each metric: `add_metrics`
        # --- algorithm: overlong filtering (they still count in their group's statistics above) ---
        if args.overlong_filtering:
            b_response_mask = b_response_mask * ~b_rollout.truncated[:, None]  # truncated: no gradient
        # ---
        minibatch_size = max(1, -(-len(b_ids) // args.num_minibatches))  # ceil: a batch of any size splits
        for epoch in range(args.updates_per_rollout):
            # --- algorithm: the minibatches: a fresh shuffle of the sequences each pass ---
            b_order = torch.randperm(len(b_ids), device=device)
            # ---
            for start in range(0, len(b_ids), minibatch_size):  # none when the batch is empty
                mb_idx = b_order[start : start + minibatch_size].sort().values  # sorted: a group's rows together
                # --- algorithm: the loss is a mean over the step's response tokens, on every rank; micro-batches ---
                # Counted over every rank, then / ranks: DDP averages the ranks' gradients, so the ranks' losses,
                # each divided by this, average to the step's mean
                num_tokens = all_reduce(b_response_mask[mb_idx].sum()).clamp(min=1) / args.world_size
                # Micro-batches up to the token budget, as many on every rank: a forward with FSDP and a
                # gradient sync with DDP are collective
                parts = micro_batches(
                    mb_idx,
                    b_attention_mask,
                    b_rollout.prompt_length,
                    micro_batch_size=args.micro_batch_size,
                    max_tokens=args.max_tokens_per_micro_batch,
                    group_size=args.group_size,
                )
                # ---
                for k, idx in enumerate(parts):
                    # Gradients are synced over ranks once per optimizer step, on the last micro-batch.
                    with no_sync(wrapped.values(), last=k == len(parts) - 1):
                        logprobs, entropy = get_logprobs(
                            model, b_ids[idx], b_attention_mask[idx], b_rollout.prompt_length, args.temperature
                        )
                        if old_in_pass_1 and epoch == 0:  # the weights before the update
                            b_proximal_logprobs[idx] = logprobs.detach()
                        # The rollout correction: each token's loss weighted by pi_old / pi_sampler (None: off)
                        weights = rollout_weights(
                            b_old_logprobs[idx],
                            b_rollout.sampler_logprobs[idx],
                            b_response_mask[idx],
                            args.rollout_correction,
                            args.correction_cap,
                        )
                        # The same values (what the ratio, clip and KL see), each token's gradient times its weight
                        logprobs = reweighted(logprobs, weights)
                        # --- algorithm: the DAPO loss ---
                        loss, mb_metrics = compute_loss(
                            logprobs,
                            b_old_logprobs[idx],
                            b_advantages[idx],
                            b_response_mask[idx],
                            num_tokens,
                            args.clip_eps_low,
                            args.clip_eps_high,
                        )
                        # ---
                        loss.backward()
                    mb_metrics["policy/entropy"] = ((entropy * b_response_mask[idx]).sum(), b_response_mask[idx].sum())
                    add_metrics(update_metrics, mb_metrics)
                grad_norm = clip_grad_norm(policy.parameters(), args.max_grad_norm, step, run_dir)  # or stops the run
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                add_metrics(update_metrics, {"policy/grad_norm": grad_norm})
        times["update"] = time.perf_counter() - update_start

        # --- algorithm: the sampler guard, on the completions this policy sampled ---
        # Were they drawn from the distribution the loss assumes? (the gap is ~1e-6 in fp32; K steps behind: the
        # staleness, pi_prox against the sampler, under either anchor)
        if b_proximal_logprobs is not None:  # (None: --anchor behaviour, --num-minibatches > 1)
            metrics.update(
                sampler_logprob_gap(
                    b_rollout.sampler_logprobs,
                    b_proximal_logprobs,
                    b_rollout.response_mask,
                    args.rollout_correction,
                    args.correction_cap,
                )
            )
        # ---

        # 7. log, evaluate, checkpoint
        metrics.update(update_metrics)
        metrics["policy/off_policy_steps"] = sampler_weights.steps_behind  # how old the sampler's weights were
        logger.log(step, {**metrics, **step_metrics(rewards, components, rollout, times, step_start)})
        if args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(
                run_dir / f"step_{step + 1}",
                trained,
                tokenizer,
                rank,
                run_info,
                optimizer,
                step + 1,
                state,
                args.keep_checkpoints,
            )

    if args.eval_every:
        logger.log(
            args.num_steps,
            evaluate(policy, task, args.chat_template, args.max_new_tokens, args.seed, vllm=vllm),
        )
    save_checkpoint(run_dir / "final", trained, tokenizer, rank, run_info, step=args.num_steps)
    print0(f"done: {run_dir / 'final'}")
    logger.close()


if __name__ == "__main__":
    try:
        main(cli(Args))
    except (UsageError, OSError) as error:  # bad input, or what the OS refused (a full disk): one line, no traceback
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    cleanup_distributed()  # after main has returned (its DDP wrappers freed): the ranks end together
