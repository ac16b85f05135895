"""Rewards (correctness, format, a user's function) and held-out evaluation. The math grader compares
numbers exactly and anything else with math-verify, in a child process with a hard deadline."""

import importlib
import importlib.util
import json
import math
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import UsageError, all_reduce_sum, generate
from data import format_prompt


def final_answer(text: str) -> str | None:
    """The final answer a completion states: the content of its last \\boxed{...}, else what follows its
    last '####' (GSM8K's format), else None (no explicit answer; `correctness_reward` then lets math-verify
    look for the last expression in the whole text)."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
        return None  # unclosed brace
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    return None


def _to_number(text: str) -> float | None:
    """A plain number ('1,234', '-3.5', '$12', '3/4', '1.5e3'), or None."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")  # '12 13' is two numbers, not 1213
    try:
        if "/" in text:
            num, den = text.split("/")
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


MATH_VERIFY_TIMEOUT_S = 2.0  # wall-clock seconds math-verify may spend on one completion before it scores 0

# The child process that runs math-verify: one (gold, completion) JSON line in, "1" or "0" out. It runs
# isolated (`python -I`: neither the working directory nor PYTHON* variables on its path, so a `json.py`
# lying there is not imported), with the folder that holds math_verify (argv[1]) added. Its own
# timeouts are off (they are signal.alarm, which fails outside a main thread and cannot stop C
# code such as big-integer arithmetic); the parent enforces the deadline. An address-space limit turns a
# runaway allocation into a MemoryError (scored 0) rather than the machine's OOM killer.
_MATH_VERIFY_CHILD = r"""
import sys
sys.path.append(sys.argv[1])
import json, logging, resource
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
logging.disable(logging.WARNING)
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
config = [LatexExtractionConfig(), ExprExtractionConfig()]
print("ready", flush=True)
for line in sys.stdin:
    gold, completion = json.loads(line)
    try:
        right = verify(parse(gold, config, parsing_timeout=None), parse(completion, config, parsing_timeout=None),
                       timeout_seconds=None)
    except Exception:
        right = False
    print(int(right), flush=True)
"""


class MathVerifier:
    """math-verify (the grader of TRL's accuracy reward) in a child process of this one, with a hard
    deadline: a completion it has not graded within `timeout_s` seconds scores 0, and the child is killed
    and started afresh. So no completion can hang a step, which under torchrun would leave the other
    ranks waiting in a collective until the backend's timeout ends the run; and, no signal being used
    in this process, it works from any thread. One child per process (per rank), started on first use."""

    def __init__(self, timeout_s: float = MATH_VERIFY_TIMEOUT_S):
        self.timeout_s, self.child, self.timeouts = timeout_s, None, 0

    def _start(self) -> None:
        found = importlib.util.find_spec("math_verify")
        if found is None:
            raise UsageError("the math reward needs math-verify: pip install -r requirements.txt")
        where = str(Path(found.origin).parent.parent)  # the site-packages (or other folder) it is installed in
        self.child = subprocess.Popen([sys.executable, "-I", "-c", _MATH_VERIFY_CHILD, where], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if not select.select([self.child.stdout], [], [], 120)[0] or self.child.stdout.readline() != "ready\n":
            self._stop()
            raise UsageError("the math reward's math-verify process did not start: check "
                             "`python -c 'import math_verify'`")

    def _stop(self) -> None:
        self.child.kill()
        self.child.wait()
        self.child = None

    def __call__(self, gold: str, completion: str) -> bool:
        if self.child is None or self.child.poll() is not None:  # not started yet, or ended from outside
            self._start()
        self.child.stdin.write(json.dumps([gold, completion]) + "\n")
        self.child.stdin.flush()
        if select.select([self.child.stdout], [], [], self.timeout_s)[0]:
            answer = self.child.stdout.readline()
            if answer:
                return answer == "1\n"
        self.timeouts += 1  # over the deadline, or the child died: it is replaced for the next completion
        self._stop()
        return False


_math_verifier = MathVerifier()


def math_reward(completion: str, answer: str) -> bool:
    """Is `completion` right, for a gold `answer` such as '72', '\\frac{1}{2}', '(1, 3]', 'B' or GSM8K's
    'reasoning #### 72'? When the completion's final answer (`final_answer`; or the whole completion, if it
    is a bare number) and the gold answer are both plain numbers they are compared numerically (1e-6
    relative), which is exact and instant; a gold letter A-J is compared with the letter the completion
    chooses (`chosen_letter`). Anything else goes to math-verify (`MathVerifier`), which compares them
    symbolically: fractions, roots, pi, percentages, units, intervals, tuples, sets, equations."""
    gold = answer.rsplit("####", 1)[-1].strip()
    stated = final_answer(completion)
    prediction = stated if stated is not None else completion.strip()
    numbers = _to_number(gold), _to_number(prediction)
    if None not in numbers:
        return math.isclose(*numbers, rel_tol=1e-6, abs_tol=1e-9)
    letter = re.fullmatch(r"\(?([A-J])\)?", gold)
    if letter:
        return chosen_letter(completion) == letter.group(1)
    if numbers[0] is not None and re.fullmatch(r"-?[\d.]+[eE][-+]?\d+", gold):
        gold = f"{numbers[0]:f}".rstrip("0").rstrip(".")  # LaTeX reads 1.5e3 as 1.5 times a symbol e
    if "\\boxed" not in gold and "$" not in gold:
        gold = f"${gold}$"  # LaTeX, e.g. \frac{1}{2}, (1, 3], \{1, 2\}
    return _math_verifier(gold, f"\\boxed{{{stated}}}" if stated is not None else completion)


def chosen_letter(completion: str) -> str | None:
    """The multiple-choice letter a completion gives: its final answer ('B', '(B)', '\\text{B}'), else the
    last '(B)' or 'answer is B' / 'Answer: B' in the text."""
    stated = final_answer(completion)
    if stated is not None:
        letter = re.fullmatch(r"\(?(?:\\text\{)?\s*([A-J])\s*\}?\)?", stated)
        return letter.group(1) if letter else None
    found = re.findall(r"\(([A-J])\)|(?i:answer)(?:\s+is|\s*:)?\s*\(?([A-J])\b", completion)
    return "".join(found[-1]) if found else None


def correctness_reward(completions: list[str], answers: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the completion is right: the whole text equals the answer (`exact`, the built-in task),
    or it states the gold answer, by `math_reward` (real data)."""
    right = [c.strip() == a.strip() if exact else math_reward(c, a) for c, a in zip(completions, answers)]
    timeouts = _math_verifier.timeouts
    if timeouts:
        _math_verifier.timeouts = 0
        print(f"math reward: {timeouts} completion(s) not graded within {_math_verifier.timeout_s} s scored 0",
              flush=True)
    return torch.tensor(right, dtype=torch.float32)


def format_reward(completions: list[str], exact: bool) -> torch.Tensor:
    """1.0 where the answer is given in the expected form: a bare number (built-in) or \\boxed{} / ####."""
    if exact:
        ok = [re.fullmatch(r"\s*-?\d+\s*", c) is not None for c in completions]
    else:
        ok = ["\\boxed{" in c or "####" in c for c in completions]
    return torch.tensor(ok, dtype=torch.float32)


def load_reward_fn(spec: str, examples: list[dict] = ()):
    """`module:function` (a module importable from the working directory) or `path/to/file.py:function`.
    The function is called as `fn(prompts, completions, answers)` and returns one float per completion;
    it is tried at once on `examples` (their answers as completions), not after the first rollout."""
    module_name, _, fn_name = spec.rpartition(":")
    if not module_name or not fn_name:
        raise UsageError(f"--reward-fn {spec!r}: expected 'module:function' or 'file.py:function'.")
    ours = sys.modules.get(module_name.partition(".")[0])
    if not module_name.endswith(".py") and Path(getattr(ours, "__file__", None) or "/").parent == Path(__file__).parent:
        raise UsageError(f"--reward-fn {spec!r}: {module_name!r} is a module of this project; pass your file as "
                         f"path/to/{module_name}.py:{fn_name}, or rename it.")
    try:
        if module_name.endswith(".py"):
            loader_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if loader_spec is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())  # for this import only: found from the working directory first
            try:
                module = importlib.import_module(module_name)
            finally:
                sys.path.remove(os.getcwd())
    except Exception as e:
        raise UsageError(f"--reward-fn {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}).") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--reward-fn {spec!r}: {module_name!r} has no function {fn_name!r}.")
    if examples:
        answers = [e["answer"] for e in examples]
        call_reward_fn(fn, spec, [e["prompt"] for e in examples], answers, answers)
    return fn


def call_reward_fn(fn, spec: str, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
    """A user reward function's values (B,): one finite float per completion, or a stop that says what it gave.
    It gets copies of the lists (what it does to them changes nothing here). It has no deadline: it runs in
    this process, where it may hold a model or a connection (under torchrun the other ranks stop after
    --dist-timeout; give its own calls to a server a timeout)."""
    try:
        values = fn(list(prompts), list(completions), list(answers))
    except SystemExit as e:  # an exit inside it would end the run with its status, and no final/
        raise UsageError(f"--reward-fn {spec!r} called sys.exit({e.code}). A reward function must return its "
                         "values; to stop the run, raise an exception.") from None
    except Exception as e:
        raise UsageError(f"--reward-fn {spec!r} raised {type(e).__name__}: {e}") from None
    out = None
    if isinstance(values, (list, tuple, torch.Tensor)) or type(values).__name__ == "ndarray":  # not a dict's keys
        try:
            out = torch.tensor([float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError):
            pass
    if out is None or len(out) != len(completions) or not out.isfinite().all():
        shown = repr(values) if out is None else repr(out.tolist()[:4])
        raise UsageError(f"--reward-fn {spec!r} must return a list of one finite float per completion "
                         f"({len(completions)}), got {shown[:200]}.")
    return out


def score(prompts: list[str], completions: list[str], answers: list[str], exact: bool, format_weight: float = 0.0,
          reward_fn=None, reward_fn_spec: str = "") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total reward (B,) = correct + format_weight * format + user reward, and each component (B,)."""
    components = {"correct": correctness_reward(completions, answers, exact)}
    if format_weight:
        components["format"] = format_reward(completions, exact)
    if reward_fn is not None:
        components["user"] = call_reward_fn(reward_fn, reward_fn_spec, prompts, completions, answers)
    rewards = components["correct"] + format_weight * components.get("format", 0.0) + components.get("user", 0.0)
    return rewards, components


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[dict], chat_template: bool, exact: bool, max_new_tokens: int,
             rank: int, world_size: int, seed: int, batch_size: int = 256) -> dict[str, float]:
    """Held-out accuracy: one sample at T=1 (`eval/accuracy`) and greedy (`eval/accuracy_greedy`).
    Each rank scores a strided shard; sampling is seeded and forked so that evaluation neither
    depends on nor disturbs the training RNG. `perf/eval_s` is its wall time (part of the step's `perf/step_s`)."""
    start, shard = time.perf_counter(), examples[rank::world_size]
    right = torch.zeros(2, dtype=torch.float64, device=model.device)
    largest = -(-len(examples) // world_size)  # every rank runs as many batches (FSDP's forward is collective)
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(seed + rank)
        for i in range(0, largest, batch_size):
            batch, counted = shard[i : i + batch_size], True
            if not batch:  # this rank's shard is one example short: generate for nothing, count nothing
                batch, counted = examples[:1], False
            prompts = [format_prompt(tokenizer, e["prompt"], chat_template) for e in batch]
            answers = [e["answer"] for e in batch]
            for j, greedy in enumerate((False, True)):
                texts = generate(model, tokenizer, prompts, 1, max_new_tokens, 1.0, greedy=greedy).texts
                right[j] += correctness_reward(texts, answers, exact).sum().item() * counted
    right = all_reduce_sum(right) / len(examples)
    return {"eval/accuracy": right[0].item(), "eval/accuracy_greedy": right[1].item(),
            "perf/eval_s": time.perf_counter() - start}


