"""GVPO: Group Variance Policy Optimization.

For each prompt's group of k completions, GVPO regresses the implicit reward of each completion,
beta * (log pi_theta(y_i) - log pi_theta'(y_i)) (sequence log-prob sums, against the anchor
pi_theta' = the policy at the start of the step), onto its reward, both centred within the group:
an MSE whose minimiser is the KL-regularised optimum pi* ~ pi_theta' exp(R / beta). Its gradient is
a policy gradient with weights w_i = b_i - beta (a_i - mean a): centred reward minus how far the
policy already moved, so no clipping, no importance ratio and no std normalisation are needed.
Because that optimum does not depend on who sampled the completions, GVPO can also train on
completions the current policy did not sample: --reuse-steps K replays the groups of the last K
steps, their a_i always measured against the current anchor.

Paper: Zhang et al., "GVPO: Group Variance Policy Optimization for Large Language Model
Post-Training", arXiv:2504.19599 (2025); the loss follows the authors' verl recipe (gvpo/).

Objective (minimised), per group of k completions with rewards R_i:
    a_i = sum_t log pi_theta(y_it) - sum_t log pi_theta'(y_it)     (sequence sums)
    b_i = R_i - mean(R)                                            (never divided by the std)
    L = mean over groups of 1/(k-1) sum_i 1/2 (beta (a_i - mean a) - b_i)^2
    grad L = -beta/(k-1) sum_i w_i grad log pi_theta(y_i),  w_i = b_i - beta (a_i - mean a)
The MSE's gradient is beta times the weighted log-likelihood form (the sum over i of the centred
terms vanishes), so detaching mean(a) changes nothing. beta = 0.1 is the official code's value;
the paper's own value is unverified.

Differences from grpo.py:
- Advantage: the centred reward R_i - mean R (no std); the loss is the group MSE above, with no
  clipping, no ratio, no KL term and no reference model (the anchor is the step's starting policy).
- Aggregation: per group, 1/(k-1) sum over its completions of whole-sequence terms, mean over groups;
  micro-batches and minibatches hold whole groups (sizes must be multiples of --group-size).
- --reuse-steps K: train on the fresh groups plus those of the previous K steps (default 0), in
  --updates-per-rollout passes over each group in all, spread over the K+1 steps it is trained at.
- --demos-per-group k: mixed data, k of each group's G completions the example's worked completion (default 0).
- --target-kl d: beta adapted after each step toward a KL of d nats per completion from the anchor to the updated
  policy, by PPO's adaptive KL penalty, within 2^10 of --beta; the loss is then divided by beta (docs/gvpo.md;
  default: beta fixed).

Why replayed groups and demonstrations need no importance weight (the paper's §3.3): with
R_theta(x, y) = beta log(pi_theta(y|x) / pi_theta'(y|x)), the loss estimates, for completions y drawn
from any sampling distribution pi_s,
    E_x E_{y ~ pi_s} [ ((R_theta(x,y) - E_{pi_s} R_theta) - (R(x,y) - E_{pi_s} R))^2 ],
which is 0 only where R_theta - R is constant in y on pi_s's support: at pi_theta ~ pi_theta' exp(R / beta),
whatever pi_s is, as long as its support is full (a softmax policy's is). A group of samples of an older
policy, or of samples and demonstrations (pi_s a mixture), has the same minimiser as an on-policy one.

Off-policy (--off-policy-steps, rollouts sampled that many steps behind): the loss has no ratio; the anchor is
pi_theta' of a_i (recompute: the policy at the step's start; behaviour: the stale sampler, no pass). Staleness changes
only the sampling distribution pi_s, and the loss is right under any pi_s (§3.3): the seed's claim, tested in the lab.

Run:
    python gvpo.py                                          # offline default: tiny model, a+b task, CPU
    torchrun --standalone --nproc_per_node=2 gvpo.py        # data-parallel (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 gvpo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
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
    pack,
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
    exact_div,
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
    beta: float = 0.1
    """KL strength toward the anchor; implicit reward beta * (log pi_theta - log pi_theta') (official code: 0.1)"""
    reuse_steps: int = 0
    """also train on the groups sampled in the previous K steps (0: on-policy only); each group is then trained at K+1
    steps, --updates-per-rollout // (K+1) passes at each (at least 1): the default 2 and K = 1 take one pass a step"""
    demos_per_group: int = 0
    """mixed data: k of each group's G completions are the example's worked completion (--task chain's
    scratchpad; on a --dataset, its answer), not sampled: graded and trained as the others (docs/gvpo.md)"""
    target_kl: Optional[float] = None
    """adapt beta after each step toward this KL from the anchor to the updated policy (nats per completion;
    PPO's adaptive KL penalty: x2 above 1.5 x target, /2 below target / 1.5, within 2^10 of --beta); None: beta fixed"""


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


def compute_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Centred rewards b_i = R_i - mean_G R, never divided by the std (that would change beta per prompt).

    rewards: (B,) with the k completions of each prompt stored contiguously -> b (B,)."""
    grouped = rewards.view(-1, group_size)  # (B/k, k)
    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)


def compute_loss(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    num_groups: float | torch.Tensor,
    group_size: int,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GVPO loss (minimised): per group, 1/(k-1) sum_i 1/2 (beta (a_i - mean a) - b_i)^2, summed over the
    groups here and divided by `num_groups`.

    logprobs, anchor_logprobs, response_mask: (B, T), whole groups of k = group_size contiguous rows;
    advantages: (B,) the centred rewards b. num_groups: the number of groups in the whole optimizer
    step (every micro-batch, every rank); computed once by the caller."""
    a = ((logprobs - anchor_logprobs) * response_mask).sum(-1).view(-1, group_size)  # (B/k, k) log-ratio sums
    b = advantages.view(-1, group_size)  # (B/k, k)
    e = beta * (a - a.mean(dim=1, keepdim=True)) - b  # (B/k, k) implicit minus real centred reward
    group_loss = 0.5 * (e**2).sum(dim=1) / (group_size - 1)  # (B/k,) unbiased group variance of R_theta - R
    loss = group_loss.sum() / num_groups

    with torch.no_grad():  # each metric a (sum, count), added up over the step's micro-batches and ranks, then divided
        n = response_mask.sum()  # (tensors: the caller syncs them with the device once a step)
        ratio = torch.exp(logprobs - anchor_logprobs)
        metrics = {
            "loss/policy": (group_loss.sum(), len(group_loss)),  # a mean over groups
            "algo/implicit_reward_abs": ((beta * a).abs().sum(), a.numel()),  # a mean over completions
            "policy/approx_kl": ((((ratio - 1) - torch.log(ratio)) * response_mask).sum(), n),
        }
    return loss, metrics


def update_beta(beta: float, kl: float, target_kl: float, initial: float) -> float:
    """PPO's adaptive KL penalty (Schulman et al., arXiv:1707.06347, section 4): after a step whose KL to the
    anchor was d, beta /= 2 if d < target / 1.5, beta *= 2 if d > target * 1.5, else unchanged. A larger beta
    pulls the implicit reward, and so the policy, closer to the anchor.

    Kept within 2^10 of the `initial` beta either way, as PPO's later controllers clip their updates (Ziegler et
    al.'s error to +-0.2): the paper's rule has no bound, and where the KL stays below target / 1.5 it halves beta at
    every step, to where the loss, divided by it, is not finite (~120 steps). At 1/1024 of its start the pull toward
    the anchor is nothing next to the centred rewards it is weighed against; at 1024 times it holds the policy there."""
    if kl < target_kl / 1.5:
        return max(beta / 2, initial / 2**10)
    if kl > target_kl * 1.5:
        return min(beta * 2, initial * 2**10)
    return beta


def given_rollout(tokenizer, prompts: list[str], completions: list[str], max_new_tokens: int, device: torch.device):
    """--demos-per-group's rows: a Rollout of given completions (one per formatted prompt), as `common.generate` would
    return it had it sampled them: each with EOS after it, cut at `max_new_tokens` (then truncated). Nothing sampled
    them: their sampler log-probs are 0."""
    ids = [
        x[:max_new_tokens]
        for x in tokenizer([c + tokenizer.eos_token for c in completions], add_special_tokens=False).input_ids
    ]
    return pack(
        tokenizer,
        tokenizer(prompts, add_special_tokens=False).input_ids,
        ids,
        [[1] * len(x) for x in ids],
        [[0.0] * len(x) for x in ids],
        tokenizer.batch_decode(ids, skip_special_tokens=True),
        [x[-1] != tokenizer.eos_token_id for x in ids],
        device=device,
    )


# ---------------------------------------------------------------------------------------------
# 3. Training
# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    check_flags(args)  # the shared flags and the per-rank batch sizes, before anything is loaded or written
    # --- algorithm: GVPO's flags ---
    require(args.group_size >= 2, "--group-size", args.group_size, ">= 2 (a group advantage needs 2 completions)")
    require(args.beta > 0, "--beta", args.beta, "> 0 (the implicit reward is beta times the log-ratio)")
    require(args.reuse_steps >= 0, "--reuse-steps", args.reuse_steps, ">= 0")
    require(
        0 <= args.demos_per_group < args.group_size,
        "--demos-per-group",
        args.demos_per_group,
        f"in [0, --group-size {args.group_size}) (each group samples at least one completion)",
    )
    require(
        not (args.demos_per_group and args.env),
        "--demos-per-group",
        args.demos_per_group,
        "0 with --env and --task guess (an episode has no demonstration)",
    )
    require(
        not (args.demos_per_group and args.anchor == "behaviour"),
        "--demos-per-group",
        args.demos_per_group,
        "0 with --anchor behaviour (a demonstration has no sampler log-probs to anchor on)",
    )
    require(
        args.target_kl is None or args.target_kl > 0,
        "--target-kl",
        args.target_kl,
        "> 0 nats per completion (or leave it out to keep --beta fixed)",
    )
    # A replayed group is trained at K+1 steps: --updates-per-rollout counts the passes over it in all, not at each
    # step (two a step over replayed groups, four over each, collapsed on the default task: docs/gvpo.md)
    args.updates_per_rollout = max(1, args.updates_per_rollout // (args.reuse_steps + 1))
    exact_div(
        args.minibatch_size,
        args.group_size,
        "--num-minibatches must split the sequences per rank into whole groups (a multiple of --group-size)",
    )
    exact_div(
        args.micro_batch_size,
        args.group_size,
        "--micro-batch-size must be a multiple of --group-size: "
        "a group's loss needs all its completions in one micro-batch",
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
    # --- algorithm: the (rollout, rewards, rollout-correction weights) of the last --reuse-steps steps, replayed ---
    state.setdefault("replay", [])
    G = state.setdefault("group_size", args.group_size)  # of the replayed groups: another would mix their prompts
    require(G == args.group_size or not state["replay"], "--group-size", args.group_size, f"{G}, as in the checkpoint")
    state["group_size"] = args.group_size
    state["beta"] = state.get("beta", args.beta) if args.target_kl else args.beta  # adapted: in every checkpoint
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

        # --- algorithm: 1-3. one group of G completions for each of the step's prompts, scored ---
        batch = prompt_batch(task.train, step, args.prompts_per_step, rank, args.world_size, args.seed)  # this rank's
        prompts = [format_prompt(tokenizer, e["prompt"], args.chat_template) for e in batch]
        sampled, k = args.group_size - args.demos_per_group, args.demos_per_group
        with timed(times, "gen"), sampler_weights.behind(step):  # stored contiguously by group: rows j*G .. j*G+G-1
            rollout = generate(
                policy,
                tokenizer,
                prompts,
                sampled,
                args.max_new_tokens,
                args.temperature,
                vllm=vllm,
                env=task.env,
                rows=batch,
            )
        if k:  # mixed data: each group's last k rows are the example's worked completion, not sampled
            demos = given_rollout(
                tokenizer,
                [p for p in prompts for _ in range(k)],
                [e.get("demo", e["answer"]) for e in batch for _ in range(k)],
                args.max_new_tokens,
                device,
            )
            j = torch.arange(len(batch))[:, None]  # group j: its sampled rows, then its demonstrations
            rows = torch.cat([j * sampled + torch.arange(sampled), len(batch) * sampled + j * k + torch.arange(k)], 1)
            rollout = select_rows(cat_rollouts([rollout, demos], tokenizer.pad_token_id), rows.view(-1))
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

        # 4. advantages, on the fresh groups and those replayed from the last --reuse-steps steps
        b_rollout = cat_rollouts([rollout] + [r for r, _, _ in state["replay"]], tokenizer.pad_token_id)
        b_rewards = torch.cat([rewards] + [r.cpu() for _, r, _ in state["replay"]])  # a resume puts them on the GPU
        b_advantages = compute_advantages(b_rewards, args.group_size).to(device)  # (B,)
        b_is_demo = torch.arange(len(b_rewards), device=device) % args.group_size >= sampled  # (B,) the same rows
        # The rollout correction corrects a row's sampler at the step that drew it: a replayed group keeps that
        # step's weights, pi_old / pi_sampler then (pi_anchor now / pi_sampler then would put the policy's move
        # since into an importance weight, which the loss does not need: §3.3); the demonstrations, drawn by no
        # sampler, 1.
        n, T = rollout.response_mask.shape[0], b_rollout.response_mask.shape[1]
        b_sampled_now = (torch.arange(len(b_rewards), device=device) < n) & ~b_is_demo  # (B,) this step's samples
        b_kept_weights = None  # (B, T) each replayed row's correction weights, 1 after its end
        if args.rollout_correction != "none":
            kept = [torch.ones(n, T, device=device)]  # this step's rows: weighted below, as they are sampled now
            for _, replayed, weights in state["replay"]:
                if weights is None:  # a group of a step that ran without the correction
                    kept.append(torch.ones(len(replayed), T, device=device))
                else:
                    kept.append(torch.nn.functional.pad(weights, (0, T - weights.shape[1]), value=1.0))
            b_kept_weights = torch.cat(kept)
        # The old log-probs below are the anchor: the policy at the start of the step, for every group, replayed
        # ones included, so a_i always measures the move away from the current anchor.
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
        minibatch_size = max(1, -(-len(b_ids) // args.num_minibatches))  # ceil: a batch of any size splits
        for epoch in range(args.updates_per_rollout):
            # --- algorithm: the minibatches: whole groups shuffled, never lone completions ---
            b_groups = torch.randperm(len(b_ids) // args.group_size, device=device)
            b_order = (b_groups[:, None] * args.group_size + torch.arange(args.group_size, device=device)).view(-1)
            # ---
            for start in range(0, len(b_ids), minibatch_size):  # none when the batch is empty
                mb_idx = b_order[start : start + minibatch_size].sort().values  # sorted: a group's rows together
                # --- algorithm: the loss is a mean over the step's groups (as many on every rank), each whole in
                # a micro-batch ---
                num_groups = len(mb_idx) // args.group_size
                # Micro-batches up to the token budget, as many on every rank: a forward with FSDP and a
                # gradient sync with DDP are collective
                parts = micro_batches(
                    mb_idx,
                    b_attention_mask,
                    b_rollout.prompt_length,
                    micro_batch_size=args.micro_batch_size,
                    max_tokens=args.max_tokens_per_micro_batch,
                    group_size=args.group_size,
                    whole_groups=True,
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
                        # --- algorithm: the weights of this step's samples; the replayed and demos' kept ---
                        weights = (
                            None
                            if weights is None
                            else torch.where(b_sampled_now[idx, None], weights, b_kept_weights[idx])
                        )
                        # ---
                        # The same values (what the ratio, clip and KL see), each token's gradient times its weight
                        logprobs = reweighted(logprobs, weights)
                        # --- algorithm: the GVPO loss ---
                        loss, mb_metrics = compute_loss(
                            logprobs,
                            b_old_logprobs[idx],
                            b_advantages[idx],
                            b_response_mask[idx],
                            num_groups,
                            args.group_size,
                            state["beta"],
                        )
                        # Adapted, beta sets only the pull toward the anchor: the MSE's gradient is beta times
                        # (b - beta (a - mean a)) grad log pi, and Adam's memory of the gradient's scale (~1000 steps)
                        # would make a smaller beta also a smaller step. Divided by beta, it is the weight form.
                        loss = loss / state["beta"] if args.target_kl else loss
                        # ---
                        loss.backward()
                    mb_metrics["policy/entropy"] = ((entropy * b_response_mask[idx]).sum(), b_response_mask[idx].sum())
                    add_metrics(update_metrics, mb_metrics)
                grad_norm = clip_grad_norm(policy.parameters(), args.max_grad_norm, step, run_dir)  # or stops the run
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                add_metrics(update_metrics, {"policy/grad_norm": grad_norm})
        times["update"] = time.perf_counter() - update_start
        # --- algorithm: this step's groups, kept for the next --reuse-steps steps; --target-kl's next beta ---
        L = rollout.response_mask.shape[1]
        kept = rollout_weights(
            b_old_logprobs[:n, :L],
            rollout.sampler_logprobs,
            rollout.response_mask,
            args.rollout_correction,
            args.correction_cap,
        )
        kept = None if kept is None else torch.where(b_sampled_now[:n, None], kept, 1.0)
        state["replay"] = ([(rollout, rewards, kept)] + state["replay"])[: args.reuse_steps]
        metrics["algo/beta"] = state["beta"]
        if args.target_kl:  # the next step's beta, from KL(pi_anchor || pi_theta) on this step's own samples
            with torch.no_grad():  # a forward pass more, of the updated policy
                log_ratio = (
                    rollout_logprobs(
                        model,
                        b_rollout,
                        args.temperature,
                        micro_batch_size=args.micro_batch_size,
                        max_tokens=args.max_tokens_per_micro_batch,
                        group_size=args.group_size,
                    )
                    - b_old_logprobs
                )
            kl = ((log_ratio.exp() - 1 - log_ratio) * b_response_mask).sum(-1)[b_sampled_now]  # (n,) k3 per completion
            kl_sum, count = all_reduce(torch.stack([kl.sum(), kl.new_tensor(len(kl))])).tolist()
            metrics["algo/kl_to_anchor"] = kl_sum / max(count, 1)
            state["beta"] = update_beta(state["beta"], metrics["algo/kl_to_anchor"], args.target_kl, args.beta)
        # ---

        # --- algorithm: the sampler guard, on the completions this policy sampled ---
        # Were they drawn from the distribution the loss assumes? (the gap is ~1e-6 in fp32; K steps behind: the
        # staleness, pi_prox against the sampler, under either anchor)
        # Only the fresh groups' sampled rows: the replayed ones were sampled by older policies, the demonstrations
        # by none. The step's metrics below describe those rows too.
        rows = b_sampled_now[:n].nonzero().squeeze(-1)
        rollout, rewards = select_rows(rollout, rows), rewards[rows.cpu()]
        components = {name: value[rows.cpu()] for name, value in components.items()}
        if b_proximal_logprobs is not None:  # (None: --anchor behaviour, --num-minibatches > 1)
            metrics.update(
                sampler_logprob_gap(
                    rollout.sampler_logprobs,
                    b_proximal_logprobs[rows, :L],
                    rollout.response_mask,
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
