"""PPO for RLHF: a policy, a learned critic, a frozen reference and a reward, as in InstructGPT.

Score each completion (the rule-based reward, or a reward model) and spread it over tokens: the score
on the last token and, on every token, -beta * (log pi_old - log pi_ref), a k1 KL penalty that is part
of the reward and never differentiated. A critic V (a separate network with a scalar head) predicts
the return of every response prefix; GAE turns rewards and values into per-token advantages, whitened
over the batch. The policy minimises PPO's clipped surrogate, the critic a clipped squared error.

Papers: Schulman et al., arXiv:1707.06347 (PPO) and arXiv:1506.02438 (GAE); Ziegler et al.,
arXiv:1909.08593 (KL in the reward, adaptive beta); Ouyang et al., arXiv:2203.02155 (InstructGPT);
Huang et al., "The N+ Implementation Details of RLHF with PPO", arXiv:2403.17031 (the defaults here).

Per response token t (T = the last one, normally EOS; N = tokens in the optimizer step, all ranks):
    r_t  = -beta * (log pi_old - log pi_ref)_t + [t = T] * score
    A_t  = delta_t + gamma * lam * A_{t+1},  delta_t = r_t + gamma * V_old(t+1) - V_old(t),  V_old(T+1) = 0
    R_t  = A_t + V_old(t)  (returns from the raw advantages), then A <- whiten(A)
    loss = 1/N sum_t max(-A_t r_t, -A_t clip(r_t, 1-eps, 1+eps))            (r_t = pi_theta / pi_old)
         + vf_coef/N sum_t 1/2 max((V - R_t)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R_t)^2)

Differences from grpo.py:
- a critic replaces the group baseline: advantages are per token (GAE), and --group-size may be 1;
- the KL is a detached k1 penalty in the reward, not a k3 loss term; --target-kl adapts beta;
- --reward-model scores completions instead of the rule; a completion without EOS scores --no-eos-score;
- token-mean over the optimizer step instead of per-sequence mean then mean.

Off-policy (--off-policy-steps K, rollouts sampled K steps behind): --anchor recompute clips r around the policy at
the update's start and takes the KL reward's log pi_old from it, --rollout-correction weighing pi_old / pi_sampler
(AReaL's decoupled PPO); --anchor behaviour takes both from the sampler (verl's bypass mode). Values and GAE: as
on-policy.

Run:
    python ppo.py                                           # offline default: tiny model, a+b task, CPU
    torchrun --standalone --nproc_per_node=2 ppo.py         # data-parallel (gloo on CPU, nccl on GPU)
    torchrun --standalone --nproc_per_node=8 ppo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --reward-model my-rm --dataset train.jsonl --max-new-tokens 512 --learning-rate 3e-6 \\
        --critic-learning-rate 3e-6 --micro-batch-size 16
"""

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn.functional as F
import tyro
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModel, AutoModelForSequenceClassification

from common import (
    SamplerWeights,
    UsageError,
    add_metrics,
    all_reduce,
    evaluate,
    format_prompt,
    generate,
    get_logprobs,
    micro_batches,
    no_sync,
    print0,
    prompt_batch,
    response_hidden_states,
    reweighted,
    rollout_logprobs,
    rollout_weights,
    sampler_logprob_gap,
    score,
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
    load_reference,
    load_task,
    load_tokenizer,
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
    clip_eps: float = 0.2
    """epsilon of the clipped ratio (N+ and TRL: 0.2)"""
    beta: float = 0.05
    """weight of the k1 KL penalty in the per-token reward (N+ and TRL: 0.05); 0 skips the reference model"""
    target_kl: Optional[float] = None
    """adapt beta toward this KL to the reference (nats per completion; Ziegler et al.'s controller); None: fixed"""
    gamma: float = 1.0
    """discount of GAE (1: the final score counts fully at every token, as N+, TRL and verl)"""
    lam: float = 0.95
    """lambda of GAE (N+ and TRL: 0.95; verl: 1.0)"""
    value_clip_eps: float = 0.2
    """the value prediction moves at most this far from the rollout's value (N+ and TRL: 0.2; verl: 0.5)"""
    vf_coef: float = 0.1
    """weight of the value loss (N+ and TRL: 0.1); with a separate critic and Adam it mostly sets when
    --max-grad-norm clips the critic's gradient"""
    critic_learning_rate: Optional[float] = None
    """the critic's AdamW learning rate; left out: --learning-rate (verl uses 10x the policy's)"""
    critic_model: Optional[str] = None
    """backbone of the critic; left out: --reward-model when given (as N+), else --model; must share
    --model's tokenizer, since it reads the policy's tokens"""
    reward_model: Optional[str] = None
    """AutoModelForSequenceClassification (one output) whose score replaces the rule-based reward"""
    no_eos_score: Optional[float] = -1.0
    """score of a completion cut off at --max-new-tokens without EOS (N+'s EOS trick: -1); None: scored normally"""


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


class Critic(torch.nn.Module):
    """V(s_t): a transformer backbone and a scalar head, one value per response token: the value of the
    state before that token, i.e. read from the same hidden state as the logit that predicts it.

    The head starts at zero, so the first values are 0 and the first advantages are the discounted rewards."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1, device=backbone.device)  # fp32
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """(B, P+L) ids and mask -> values (B, L) in fp32, 0 after the last response token."""
        hidden = response_hidden_states(self.backbone, input_ids, attention_mask, prompt_length)  # (B, L, H)
        # In fp32, also where FSDP gathers the head in bf16 for the compute: a value is a regression target
        head = self.value_head
        values = F.linear(hidden.float(), head.weight.float(), head.bias.float()).squeeze(-1)  # (B, L)
        return values * attention_mask[:, prompt_length:]


def load_reward_model(name: str, dtype: str, device: torch.device):
    """A frozen `AutoModelForSequenceClassification` with one output (a reward model) and its own
    tokenizer, which need not be the policy's: completions are scored as text."""
    tokenizer = load_tokenizer(name, "--reward-model")
    model = load_model(name, dtype, device, tokenizer, AutoModelForSequenceClassification, trained=False)
    if model.config.num_labels != 1:
        raise UsageError(
            f"--reward-model {name!r}: has {model.config.num_labels} outputs; a reward model has one "
            "(AutoModelForSequenceClassification with num_labels=1)."
        )
    return model.eval().requires_grad_(False), tokenizer


@torch.no_grad()
def reward_model_scores(
    reward_model,
    tokenizer,
    prompts: list[str],
    completions: list[str],
    ended: torch.Tensor,
    chat_template: bool,
    batch_size: int,
) -> torch.Tensor:
    """Scores (B,) of prompt + completion (+ EOS where the completion `ended` with it), re-tokenized with
    the reward model's own tokenizer and read at the last token: left padding puts it in the last column,
    where the sequence-classification head picks the last non-pad token."""
    texts = [
        format_prompt(tokenizer, p, chat_template) + c + ((tokenizer.eos_token or "") if e else "")
        for p, c, e in zip(prompts, completions, ended.tolist())
    ]
    device, scores = next(reward_model.parameters()).device, []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        mask = enc["attention_mask"].to(device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens start at 0
        scores.append(
            reward_model(input_ids=enc["input_ids"].to(device), attention_mask=mask, position_ids=position_ids)
            .logits[:, 0]
            .float()
            .cpu()
        )
    return torch.cat(scores)


def compute_rewards(
    scores: torch.Tensor,
    truncated: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    beta: float,
    no_eos_score: Optional[float] = -1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -beta * k1 KL on every response token, plus the completion's score on its last
    token (EOS when there is one; in an episode, the policy's last token, never an observation's); a completion
    cut off without EOS (an episode cut by a budget) scores `no_eos_score` instead.

    scores, truncated: (B,); old_logprobs, ref_logprobs, response_mask: (B, T) -> rewards (B, T), kl (B, T).
    Everything is detached: the KL is part of the reward the policy sees, never a loss to differentiate."""
    if no_eos_score is not None:
        scores = torch.where(truncated, torch.full_like(scores, no_eos_score), scores)
    if ref_logprobs is None:
        kl = torch.zeros_like(old_logprobs)
    else:
        kl = (old_logprobs - ref_logprobs).detach() * response_mask  # (B, T) k1 = log pi_old - log pi_ref
    rewards = -beta * kl
    last = response_mask.shape[1] - 1 - response_mask.flip(-1).argmax(-1)  # (B,) index of the policy's last token
    rewards[torch.arange(len(rewards)), last] += scores.detach()
    return rewards, kl


def compute_advantages(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over response tokens, treating the last real token as terminal (the value after it is 0, even
    for a completion that was cut off: the LLM-RLHF convention). In an episode the environment's tokens
    (response_mask 0) are skipped: the policy token before an observation bootstraps from the value of the
    policy token after it, and the advantage carries over the gap, undiscounted, as verl's multi-turn GAE does
    (verl core_algos.compute_gae_advantage_return; its test_multi_turn_compute_gae_advantage_return).

    rewards, values (V_old at rollout time), response_mask: (B, T) -> advantages, returns: (B, T), 0 after
    the last token. The returns (critic targets) use these raw advantages; whiten the advantages after."""
    rewards, values = rewards * response_mask, values * response_mask  # past the end: no reward, value 0
    advantages = torch.zeros_like(rewards)
    next_advantage = next_value = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        policy = response_mask[:, t] > 0  # (B,) elsewhere (an observation, the padding) both carry over as they are
        next_advantage = torch.where(policy, delta + gamma * lam * next_advantage, next_advantage)
        advantages[:, t] = next_advantage
        next_value = torch.where(policy, values[:, t], next_value)
    advantages = advantages * response_mask
    return advantages, advantages + values


def whiten(x: torch.Tensor, mask: torch.Tensor, reduce=lambda sums: sums, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens (mask = 1), 0 elsewhere; unbiased variance, as
    verl and TRL. `reduce` sums the statistics over ranks (e.g. an all-reduce) when the batch is spread
    over them, so that every rank whitens with the whole batch's mean and variance."""
    count, total, total_sq = reduce(torch.stack([mask.sum(), (x * mask).sum(), (x * x * mask).sum()]))
    mean = total / count
    var = (total_sq - count * mean**2) / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def update_kl_coef(
    beta: float, observed_kl: float, target_kl: float, num_sequences: int, horizon: int = 10000
) -> float:
    """Ziegler et al.'s adaptive KL controller: raise beta when the KL to the reference (per completion)
    is above target, lower it when below, by at most 20% of num_sequences / horizon per call."""
    error = min(max(observed_kl / target_kl - 1, -0.2), 0.2)
    return beta * (1 + error * num_sequences / horizon)


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    num_tokens: float | torch.Tensor,
    value_clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 1/2 max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, -eps_v, eps_v),
    summed over tokens and divided by `num_tokens` (the optimizer step's token count).

    All (B, T) -> (loss, clipped): the pessimistic (larger) error is kept, so the critic gets no gradient
    where it moved more than eps_v from the rollout's value in the direction that made its error worse; `clipped`
    counts those tokens."""
    values_clipped = old_values + torch.clamp(values - old_values, -value_clip_eps, value_clip_eps)
    errors, errors_clipped = (values - returns) ** 2, (values_clipped - returns) ** 2
    loss = (0.5 * torch.max(errors, errors_clipped) * response_mask).sum() / num_tokens
    return loss, ((errors_clipped > errors).float() * response_mask).sum()


def compute_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    num_tokens: float | torch.Tensor,
    clip_eps: float = 0.2,
    value_clip_eps: float = 0.2,
    vf_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO loss (minimised): clipped surrogate + vf_coef * clipped value loss, both token-means over the
    optimizer step: summed over tokens and divided by `num_tokens`, the response tokens of the whole step
    (every micro-batch, every rank), computed once by the caller.

    All (B, T): per-token advantages (whitened), values of the critic being trained, old_values and
    returns from the rollout."""
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T); exactly 1 on the first update of a rollout
    pg_losses = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    pg_loss = (pg_losses * response_mask).sum() / num_tokens
    vf_loss, vf_clipped = compute_value_loss(values, old_values, returns, response_mask, num_tokens, value_clip_eps)
    loss = pg_loss + vf_coef * vf_loss

    with torch.no_grad():  # each metric a (sum, count), added up over the step's micro-batches and ranks, then divided
        n = response_mask.sum()  # (tensors: the caller syncs them with the device once a step)
        clipped = (ratio - 1).abs() > clip_eps
        metrics = {
            "loss/policy": ((pg_losses * response_mask).sum(), n),
            "loss/value": (vf_loss * num_tokens, n),
            "policy/clipfrac": ((clipped.float() * response_mask).sum(), n),
            "policy/clipfrac_low": (((ratio < 1 - clip_eps).float() * response_mask).sum(), n),  # below 1 - eps
            "policy/clipfrac_high": (((ratio > 1 + clip_eps).float() * response_mask).sum(), n),  # above 1 + eps
            "policy/approx_kl": ((((ratio - 1) - torch.log(ratio)) * response_mask).sum(), n),
            "algo/value_clipfrac": (vf_clipped, n),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# 3. Training
# ---------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    check_flags(args)  # the shared flags and the per-rank batch sizes, before anything is loaded or written
    # --- algorithm: PPO's flags ---
    if args.target_kl is not None and args.target_kl <= 0:
        raise UsageError(f"--target-kl {args.target_kl}: must be positive (or leave it out to keep --beta fixed).")
    require(0 < args.clip_eps < 1, "--clip-eps", args.clip_eps, "in (0, 1)")
    require(args.beta >= 0, "--beta", args.beta, ">= 0")
    require(0 <= args.gamma <= 1, "--gamma", args.gamma, "in [0, 1]")
    require(0 <= args.lam <= 1, "--lam", args.lam, "in [0, 1]")
    require(args.value_clip_eps > 0, "--value-clip-eps", args.value_clip_eps, "> 0")
    require(args.vf_coef >= 0, "--vf-coef", args.vf_coef, ">= 0")
    require(
        args.critic_learning_rate is None or args.critic_learning_rate > 0,
        "--critic-learning-rate",
        args.critic_learning_rate,
        "> 0 (or left out: --learning-rate)",
    )
    require(
        not (args.reward_model and args.env),
        "--reward-model",
        args.reward_model,
        "left out with --env and --task guess (single-turn: an environment scores its episodes)",
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
    # --- algorithm: the reference model (not loaded when the KL is off), the reward model, the critic ---
    ref_policy = load_reference(args, policy, tokenizer, device) if args.beta > 0 or args.target_kl else None
    reward_model = rm_tokenizer = None
    if args.reward_model:
        reward_model, rm_tokenizer = load_reward_model(args.reward_model, args.dtype, device)
        if not rm_tokenizer.chat_template and any(isinstance(e["prompt"], list) for e in task.train + task.held_out):
            raise UsageError(
                f"--reward-model {args.reward_model!r}: its tokenizer has no chat template for the "
                "prompts' chat messages. Pass a reward model that has one, or give the prompts as text."
            )
    # The critic reads the policy's token ids, so its backbone must share the policy's tokenizer.
    critic_path = args.critic_model or args.reward_model or args.model
    flag = "--model"
    if args.critic_model or args.reward_model:
        flag = "--critic-model" if args.critic_model else "--reward-model"
    if critic_path != args.model and load_tokenizer(critic_path, flag).get_vocab() != tokenizer.get_vocab():
        raise UsageError(
            f"{flag} {critic_path!r}: its tokenizer differs from --model's, and the critic reads the "
            "policy's tokens. Pass --critic-model with a model that shares --model's tokenizer "
            "(e.g. --critic-model <the --model path>)."
        )
    torch.manual_seed(args.seed)
    backbone = load_model(  # trained: held in fp32, as the policy
        critic_path,
        args.dtype,
        device,
        tokenizer,
        AutoModel,
        sharded=args.fsdp,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    critic = Critic(backbone)
    if args.fsdp:
        shard_model(critic, device, args.dtype)
    # ---
    torch.manual_seed(args.seed + rank)
    # --- algorithm: what the optimizer trains: the policy and the critic (its own learning rate) ---
    optimizer = torch.optim.AdamW(
        [
            {"params": policy.parameters()},
            {"params": critic.parameters(), "lr": args.critic_learning_rate or args.learning_rate},
        ],
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        fused=True,  # one kernel for all the weights
    )
    trained = {"policy": policy, "critic": critic}  # saved to and restored from checkpoints
    # ---
    start_step, state = load_checkpoint(resume_dir, trained, optimizer, rank)  # state: the algorithm's, per rank
    # --- algorithm: the KL coefficient, adapted each step with --target-kl ---
    state.setdefault("beta", args.beta)
    # ---
    # What the update calls: DDP averages gradients over ranks (FSDP2 has sharded in place: nothing to wrap).
    wrapped = {name: DDP(m) if args.world_size > 1 and not args.fsdp else m for name, m in trained.items()}
    model = wrapped["policy"]
    # The sampler: model.generate, or a vLLM engine on this rank's device, which gets the policy's weights at its
    # first call after an optimizer step (a hook on `optimizer`)
    vllm = load_vllm(args, rank, optimizer)
    # The weights that sample: the policy's, or with --off-policy-steps K those of K steps before (kept in `state`)
    sampler_weights = SamplerWeights(policy, args.off_policy_steps, state, vllm)
    # --- algorithm: the critic, as the update calls it ---
    critic_model = wrapped["critic"]
    # ---
    claim_run_dir(run_dir, resume_dir, rank)  # created and locked: from here on this run writes there
    logger = Logger(run_dir, asdict(args), rank, args.track, args.num_steps)
    print0(f"{args.prompts_per_step} prompts x {args.group_size} completions per step on {args.world_size} rank(s)")

    for step in range(start_step, args.num_steps):
        step_start, times, metrics = time.perf_counter(), {}, {}
        if args.eval_every and step % args.eval_every == 0:
            metrics = evaluate(policy, task, args.chat_template, args.max_new_tokens, args.seed, vllm=vllm)

        # --- algorithm: 1-3. one group of G completions for each of the step's prompts, scored by the rule-based
        # reward or by the reward model (the rule's parts are still logged)
        batch = prompt_batch(task.train, step, args.prompts_per_step, rank, args.world_size, args.seed)  # this rank's
        prompts = [format_prompt(tokenizer, e["prompt"], args.chat_template) for e in batch]
        with timed(times, "gen"), sampler_weights.behind(step):  # stored contiguously by group: rows j*G .. j*G+G-1
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
        if reward_model is not None:
            group_prompts = [e["prompt"] for e in batch for _ in range(args.group_size)]
            rewards = components["model"] = reward_model_scores(
                reward_model,
                rm_tokenizer,
                group_prompts,
                rollout.texts,
                ~rollout.truncated,
                args.chat_template,
                args.micro_batch_size,
            )
        b_rollout = rollout  # the batch to train on: here every completion sampled
        # ---
        b_ids, b_attention_mask = b_rollout.input_ids, b_rollout.attention_mask  # (B, P+T)
        b_response_mask = b_rollout.response_mask  # (B, T): 1 on the response tokens, EOS included

        # 5. old log-probs by the training model (the ratio starts at 1; with one step per pass, pass 1 gives them), or
        # the sampler's (--anchor behaviour)
        # --- algorithm: the KL reward needs the old log-probs before the update (under --anchor behaviour the
        # sampler's, there already); nothing else does ---
        old_in_pass_1 = args.num_minibatches == 1 and (ref_policy is None or args.anchor == "behaviour")
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
            # --- algorithm: the reference model's log-probs, for the KL penalty, and the critic's old values ---
            b_ref_logprobs = None
            if ref_policy is not None:
                b_ref_logprobs = rollout_logprobs(
                    ref_policy,
                    b_rollout,
                    args.temperature,
                    micro_batch_size=args.micro_batch_size,
                    max_tokens=args.max_tokens_per_micro_batch,
                    group_size=args.group_size,
                )
            b_old_values = torch.zeros_like(b_response_mask)  # (B, T)
            all_rows = torch.arange(len(b_ids), device=device)
            for idx in micro_batches(
                all_rows,
                b_attention_mask,
                b_rollout.prompt_length,
                micro_batch_size=args.micro_batch_size,
                max_tokens=args.max_tokens_per_micro_batch,
                group_size=args.group_size,
            ):
                with torch.no_grad():
                    b_old_values[idx] = critic_model(b_ids[idx], b_attention_mask[idx], b_rollout.prompt_length)
            # ---

        # --- algorithm: 4. advantages, after the log-probs and values they need: per-token rewards (the score at
        # the end, the KL penalty on every token), GAE, whitened over the whole batch (sums over ranks)
        b_rewards, b_kl = compute_rewards(
            rewards.to(device),
            rollout.truncated.to(device),
            b_old_logprobs,
            b_ref_logprobs,
            b_response_mask,
            state["beta"],
            args.no_eos_score,
        )
        b_advantages, b_returns = compute_advantages(b_rewards, b_old_values, b_response_mask, args.gamma, args.lam)
        b_advantages = whiten(b_advantages, b_response_mask, all_reduce)
        kl_sum, num_sequences = all_reduce(torch.stack([b_kl.sum(), b_kl.new_tensor(len(b_kl))]))
        value, residual, target = (x * b_response_mask for x in (b_old_values, b_returns - b_old_values, b_returns))
        n, value_sum, residual_sum, residual_sq, target_sum, target_sq = all_reduce(
            torch.stack(
                [  # every rank's tokens
                    b_response_mask.sum(),
                    value.sum(),
                    residual.sum(),
                    (residual**2).sum(),
                    target.sum(),
                    (target**2).sum(),
                ]
            )
        )
        metrics.update(
            {
                "algo/kl": kl_sum / num_sequences,  # k1 KL to the reference, nats per completion
                "algo/beta": state["beta"],
                "algo/value_mean": value_sum / n,
                "algo/explained_variance": 1 - (residual_sq - residual_sum**2 / n) / (target_sq - target_sum**2 / n),
            }
        )
        if args.target_kl:  # the coefficient for the next step, from the whole batch's KL
            state["beta"] = update_kl_coef(
                state["beta"], (kl_sum / num_sequences).item(), args.target_kl, int(num_sequences)
            )
        # ---

        # 6. update: updates_per_rollout passes x num_minibatches optimizer steps x micro-batches
        update_start, update_metrics = time.perf_counter(), {}  # (sum, count) of each metric: `add_metrics`
        minibatch_size = max(1, -(-len(b_ids) // args.num_minibatches))  # ceil: a batch of any size splits
        for epoch in range(args.updates_per_rollout):
            # --- algorithm: the minibatches: a fresh shuffle of the sequences each pass ---
            b_order = torch.randperm(len(b_ids), device=device)
            # ---
            for start in range(0, len(b_ids), minibatch_size):  # none when the batch is empty
                mb_idx = b_order[start : start + minibatch_size].sort().values  # sorted: a group's rows together
                # --- algorithm: the loss is a sum over the step's response tokens, over every rank; micro-batches ---
                # Counted over every rank, then / ranks: DDP averages the ranks' gradients, so the ranks' losses,
                # each divided by this, average to the step's mean
                num_tokens = all_reduce(b_response_mask[mb_idx].sum()) / args.world_size
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
                        # --- algorithm: the PPO loss: clipped surrogate and clipped value loss ---
                        values = critic_model(b_ids[idx], b_attention_mask[idx], b_rollout.prompt_length)  # (b, T)
                        loss, mb_metrics = compute_loss(
                            logprobs,
                            b_old_logprobs[idx],
                            b_advantages[idx],
                            values,
                            b_old_values[idx],
                            b_returns[idx],
                            b_response_mask[idx],
                            num_tokens,
                            args.clip_eps,
                            args.value_clip_eps,
                            args.vf_coef,
                        )
                        # ---
                        loss.backward()
                    mb_metrics["policy/entropy"] = ((entropy * b_response_mask[idx]).sum(), b_response_mask[idx].sum())
                    add_metrics(update_metrics, mb_metrics)
                grad_norm = clip_grad_norm(policy.parameters(), args.max_grad_norm, step, run_dir)  # or stops the run
                # --- algorithm: the critic's gradients, clipped on their own ---
                value_grad_norm = clip_grad_norm(critic.parameters(), args.max_grad_norm, step, run_dir)
                add_metrics(update_metrics, {"algo/value_grad_norm": value_grad_norm})
                # ---
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
