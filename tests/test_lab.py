"""The lab (docs/lab.md): the chain task, its grading, the metrics that show the algorithms' differences,
gvpo.py's mixed data, and every file on --task chain."""

import collections
import math
import random
import re

import pytest
import torch

import cispo
import dapo
import grpo
import gspo
from common import Rollout, all_reduce_mean, correctness_reward, format_prompt, format_reward, generate, step_metrics
from conftest import ALGORITHMS, read_metrics, run
from gvpo import given_rollout
from harness import TASKS, builtin_splits, load_model, load_tokenizer


def test_warm_up_completions_vary_and_only_a_carried_slip_is_wrong():
    """make_tiny_model.py's chain data: every partial sum is the previous total plus the terms it names,
    except a slip (by 1 or 10), which is either carried to a wrong answer or corrected after 'wait'."""
    from make_tiny_model import warm_up_completion

    rng, kinds = random.Random(0), collections.Counter()
    for _ in range(3000):
        numbers = [rng.randrange(100) for _ in range(rng.randint(2, 6))]
        text = warm_up_completion(numbers, rng)
        scratchpad, total = text.rsplit("#### ", 1)
        right = int(total) == sum(numbers)
        if "wait" in text:
            kinds["wait"] += 1
        elif not scratchpad:
            kinds["direct"] += 1
        else:
            kinds["right" if right else "slip"] += 1
        assert right or ("wait" not in text and scratchpad)  # only a carried slip is wrong
        for step in scratchpad.replace(" wait", "").split():
            terms, result = step.split("=")
            assert abs(int(result) - sum(map(int, terms.split("+")))) in (0, 1, 10) or int(result) == 0
    assert kinds["slip"] > 300 and kinds["wait"] > 200 and kinds["direct"] > 200, kinds


def test_chain_examples_are_fixed_disjoint_and_worked_right():
    train, held_out = builtin_splits("chain")
    assert (len(train), len(held_out)) == (19_500, 500) and held_out == builtin_splits("chain")[1]
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in held_out}
    for e in train[:2000] + held_out:
        numbers = [int(n) for n in e["prompt"].split("+")]
        assert 2 <= len(numbers) <= 6 and all(0 <= n <= 99 for n in numbers) and e["answer"] == str(sum(numbers))
        steps, final = e["demo"].split(" #### ")
        assert final == e["answer"] and len(steps.split()) == len(numbers) - 1
        for i, step in enumerate(steps.split(), 1):  # each partial sum: the previous one plus the next number
            assert step == f"{sum(numbers[:i])}+{numbers[i]}={sum(numbers[: i + 1])}"
    lengths = [len(set(e["prompt"].split("+"))) for e in train]
    assert min(lengths) == 1 and max(len(e["prompt"].split("+")) for e in train) == 6


@pytest.mark.parametrize(
    "completion, right",
    [
        ("12+7=19 #### 19", True),
        ("12+7=18 wait 12+7=19 #### 19", True),
        ("#### 19", True),
        ("####19", True),
        ("12+7=19", False),  # no answer: a completion cut by --max-new-tokens is wrong
        ("12+7=19 #### 18", False),
        ("#### 19 #### 18", False),  # the last '####' holds the answer
        ("19", True),  # a bare total, as the add task answers
        ("#### 19.0", False),
        ("#### 019", False),  # the digits, exactly as the add task grades them
    ],
)
def test_the_built_in_tasks_grade_the_text_after_the_last_marker(completion, right):
    assert correctness_reward([completion], ["19"], exact_match=True).item() == right


def test_the_format_reward_of_the_built_in_tasks_wants_a_bare_number_after_the_marker():
    """--format-weight on the chain task rewards the answer's form, not skipping the scratchpad."""
    texts = ["12+7=19 #### 19", "#### 20", "19", "12+7=19", "12+7=19 #### x", ""]
    assert format_reward(texts, exact_match=True).tolist() == [1, 1, 1, 0, 0, 0]


def test_the_add_task_grades_as_before():
    """The add task's completions have no '####': the whole text is compared, as before the chain task."""
    assert correctness_reward(["19", " 19 ", "19 ", "1 9", "019", ""], ["19"] * 6, exact_match=True).tolist() == [
        1,
        1,
        1,
        0,
        0,
        0,
    ]


def test_task_picks_the_model_and_generation_limit_and_excludes_dataset(tmp_path):
    args = grpo.Args(task="chain", output_dir=str(tmp_path))
    grpo.check_flags(args)
    assert (args.model, args.max_new_tokens) == TASKS["chain"]
    args = grpo.Args(task="chain", model="other", max_new_tokens=9)
    grpo.check_flags(args)
    assert (args.model, args.max_new_tokens) == ("other", 9)  # what the user passed wins
    args = grpo.Args()
    grpo.check_flags(args)
    assert (args.model, args.max_new_tokens) == TASKS["add"]
    with pytest.raises(grpo.UsageError, match=r"^--task chain is a built-in dataset: pass --task or --dataset"):
        grpo.check_flags(grpo.Args(task="chain", dataset="train.jsonl"))


def rollout_of(texts: list[str], lengths: list[int]) -> Rollout:
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).float()
    return Rollout(
        torch.zeros(len(texts), 1),
        torch.ones(len(texts), 1),
        mask,
        1,
        texts,
        torch.zeros(len(texts), dtype=torch.bool),
        torch.zeros_like(mask),
    )


def test_step_metrics_split_lengths_by_outcome_and_count_self_corrections():
    """Hand-worked: lengths 4 and 8 right, 2, 6 and 10 wrong; two of five write 'wait', one of them right."""
    texts = ["1+1=2 wait", "x", "Wait, no", "waiting", "y"]
    right = torch.tensor([1.0, 0, 0, 1, 0])
    m = all_reduce_mean(step_metrics(right, {"correct": right}, rollout_of(texts, [4, 2, 6, 8, 10]), {}, 0.0))
    assert m["response/length_correct"] == 6 and m["response/length_wrong"] == 6  # (4+8)/2, (2+6+10)/3
    assert m["response/length_mean"] == 6
    assert m["task/self_correction_frac"] == pytest.approx(2 / 5)  # 'wait' as a word, any case ('waiting' is not)
    assert m["task/self_correction_accuracy"] == pytest.approx(1 / 2)
    none_right = all_reduce_mean(
        step_metrics(right * 0, {"correct": right * 0}, rollout_of(texts, [4, 2, 6, 8, 10]), {}, 0.0)
    )
    assert math.isnan(none_right["response/length_correct"]) and none_right["response/length_wrong"] == 6


def clip_inputs():
    """Ratios 0.5, 0.9, 1.0, 1.25, 1.5 (one token each of one completion), advantage 1."""
    old = torch.zeros(1, 5, dtype=torch.float64)
    new = torch.tensor([[0.5, 0.9, 1.0, 1.25, 1.5]], dtype=torch.float64).log()
    return new, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 5, dtype=torch.float64)


def test_clip_fractions_below_and_above_the_range():
    """Symmetric eps 0.2: 0.5 below 0.8, 1.25 and 1.5 above 1.2. DAPO's clip-higher (0.2, 0.28): 1.25 is
    inside. CISPO's weight, capped at 1 + 0.2 from above only by default (is_eps_low None): 1.25, 1.5."""
    new, old, adv, mask = clip_inputs()
    _, m = grpo.compute_loss(new, old, None, adv, mask, 1, clip_eps=0.2, beta=0.0)
    m = all_reduce_mean(m)
    assert (m["policy/clipfrac_low"], m["policy/clipfrac_high"], m["policy/clipfrac"]) == (0.2, 0.4, 0.6)
    _, m = dapo.compute_loss(new, old, adv, mask, 5, clip_eps_low=0.2, clip_eps_high=0.28)
    m = all_reduce_mean(m)
    assert (m["policy/clipfrac_low"], m["policy/clipfrac_high"]) == (0.2, 0.2)
    _, m = cispo.compute_loss(new, old, adv, mask, 5, is_eps_high=0.2)
    m = all_reduce_mean(m)
    assert (m["policy/clipfrac_low"], m["policy/clipfrac_high"], m["policy/clipfrac"]) == (0.0, 0.4, 0.4)
    _, m = cispo.compute_loss(new, old, adv, mask, 5, is_eps_high=0.2, is_eps_low=0.2)
    m = all_reduce_mean(m)
    assert (m["policy/clipfrac_low"], m["policy/clipfrac_high"]) == (0.2, 0.4)


def test_gspo_clip_fractions_count_the_tokens_of_clipped_sequences():
    """Two completions of 2 and 3 tokens with sequence ratios exp(mean log r) = 0.5 and 2: below and above."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.5, 0.5, 9.0], [2.0, 2.0, 2.0]], dtype=torch.float64).log()
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]], dtype=torch.float64)
    _, m = gspo.compute_loss(new, old, None, torch.ones(2, dtype=torch.float64), mask, 2, beta=0.0)
    m = all_reduce_mean(m)
    assert (m["policy/clipfrac_low"], m["policy/clipfrac_high"]) == (pytest.approx(2 / 5), pytest.approx(3 / 5))


def test_a_given_rollout_is_what_generate_returns_for_the_same_text():
    """given_rollout of generate's own texts rebuilds its tokens and masks (completions that ended with EOS),
    so gvpo.py's demonstrations enter the batch as a sampled completion would."""
    tokenizer = load_tokenizer(TASKS["chain"][0])
    model = load_model(TASKS["chain"][0], "float32", torch.device("cpu"), tokenizer)
    prompts = [format_prompt(tokenizer, e["prompt"], True) for e in builtin_splits("chain")[1][:6]]
    torch.manual_seed(0)
    sampled = generate(model, tokenizer, prompts, 1, 64, 1.0)
    given = given_rollout(tokenizer, prompts, sampled.texts, 64, torch.device("cpu"))
    ended = ~sampled.truncated
    assert ended.sum() >= 4 and given.texts == sampled.texts and given.prompt_length == sampled.prompt_length
    width = given.response_mask.shape[1]
    assert torch.equal(given.response_mask[ended], sampled.response_mask[ended][:, :width])
    assert torch.equal(
        given.input_ids[ended] * given.attention_mask[ended],
        (sampled.input_ids * sampled.attention_mask)[ended][:, : given.input_ids.shape[1]],
    )
    cut = given_rollout(tokenizer, prompts[:1], ["1+2=3 #### 3"], 5, torch.device("cpu"))
    assert cut.texts == ["1+2=3"] and cut.truncated.tolist() == [True] and cut.response_mask.sum() == 5


@pytest.mark.slow
def test_gvpo_mixed_data_puts_the_worked_completion_in_each_group(tmp_path, monkeypatch):
    """--demos-per-group 1 with groups of 4: each group's last row is the example's scratchpad, graded
    and trained with the others. No sampler drew it, so its rollout-correction weight is 1: under tis its
    sampler log-probs of 0 would give it exp(old log-prob), far below 1, were it not left out. The logged
    metrics describe the sampled completions."""
    import gvpo

    seen, real_score, real_reweighted, real_metrics = {}, gvpo.score, gvpo.reweighted, gvpo.step_metrics

    def score(batch, texts, group_size, *args):
        seen["groups"] = [(e["demo"], texts[i * group_size : (i + 1) * group_size]) for i, e in enumerate(batch)]
        return real_score(batch, texts, group_size, *args)

    def reweighted(logprobs, weights):
        seen.setdefault("weights", weights)
        return real_reweighted(logprobs, weights)

    def step_metrics(rewards, components, rollout, *args):
        seen["logged"] = rollout.texts
        return real_metrics(rewards, components, rollout, *args)

    monkeypatch.setattr(gvpo, "score", score)
    monkeypatch.setattr(gvpo, "reweighted", reweighted)
    monkeypatch.setattr(gvpo, "step_metrics", step_metrics)
    gvpo.main(
        gvpo.Args(
            task="chain",
            demos_per_group=1,
            num_steps=1,
            prompts_per_step=2,
            group_size=4,
            eval_every=0,
            rollout_correction="tis",
            output_dir=str(tmp_path),
            run_name="mixed",
        )
    )
    assert [texts[-1] for _, texts in seen["groups"]] == [demo for demo, _ in seen["groups"]]
    weights = seen["weights"]  # (8, T): the one micro-batch, rows in order; rows 3 and 7 the demonstrations
    assert torch.equal(weights[[3, 7]], torch.ones_like(weights[[3, 7]]))
    assert torch.allclose(weights[[0, 1, 2, 4, 5, 6]], torch.ones(6, weights.shape[1]), atol=1e-4)
    assert seen["logged"] == [t for _, texts in seen["groups"] for t in texts[:3]]  # the sampled rows only


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_file_runs_the_chain_task(tmp_path, algo):
    """As a user would type it, at a tiny shape: the chain model, 64 new tokens, the new metrics logged."""
    flags = ["--demos-per-group", "1"] if algo == "gvpo" else []
    result = run(
        [
            f"{algo}.py",
            "--task",
            "chain",
            "--num-steps",
            "2",
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--eval-every",
            "2",
            "--eval-size",
            "16",
            "--output-dir",
            str(tmp_path),
            "--run-name",
            "chain",
            *flags,
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "chain")
    assert metrics[0]["response/length_mean"] > 10 and 0 <= metrics[-1]["eval/accuracy"] <= 1
    for key in ["response/length_wrong", "task/self_correction_frac"]:
        assert key in metrics[0], key
    clipped = algo not in ("gvpo", "rloo", "sapo", "dppo")  # no clip in their losses
    assert ("policy/clipfrac_high" in metrics[0]) == clipped
    assert re.search(r"tiny_model_chain", (tmp_path / "chain" / "config.json").read_text())
