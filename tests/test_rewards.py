"""The math reward of real data (common.correctness_reward with exact=False): a table of (gold answer,
completion, right?) cases in the forms MATH- and GSM8K-style datasets use, each run through the
reward itself; and the grader's deadline."""

import threading
import time

import pytest

from common import MathVerifier, correctness_reward

GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")

CASES = [
    # fractions and decimals
    ("0.5", r"so the answer is \boxed{\frac{1}{2}}", True),
    ("3/4", r"\boxed{\dfrac{3}{4}}", True),
    (r"\frac{3}{4}", "0.75", True),
    (r"\frac{1}{2}", "The answer is 0.5", True),
    ("1/2", r"\boxed{2/4}", True),
    (r"\dfrac{7}{2}", r"\boxed{3.5}", True),
    ("2", r"\boxed{\frac{4}{2}}", True),
    # percentages
    ("50", r"\boxed{50\%}", True),
    (r"50\%", r"\boxed{50}", True),
    # roots and pi
    (r"2\sqrt{2}", r"\boxed{\sqrt{8}}", True),
    (r"\pi", r"\boxed{\pi}", True),
    (r"2\pi", r"\boxed{2 \pi}", True),
    (r"\frac{\pi}{2}", r"\boxed{\pi/2}", True),
    # negatives
    ("-3", r"\boxed{-3}", True),
    ("-3", r"\boxed{3}", False),
    # thousands separators
    ("1234", r"\boxed{1,234}", True),
    ("1,234", "#### 1234", True),
    ("1234567", r"\boxed{1{,}234{,}567}", True),
    # scientific notation
    ("1.5e3", r"\boxed{1500}", True),
    ("1500", r"\boxed{1.5 \times 10^{3}}", True),
    ("0.00012", r"\boxed{1.2 \times 10^{-4}}", True),
    # units and text around the number
    ("5", r"\boxed{5\text{ cm}}", True),
    ("5", r"The side is \boxed{5 \text{ cm}}.", True),
    ("18", r"She pays \boxed{\$18}.", True),
    ("12", r"\boxed{12 \text{ apples}}", True),
    # intervals
    ("(1, 3]", r"\boxed{(1,3]}", True),
    ("(1, 3]", r"\boxed{[1,3]}", False),
    (r"(-\infty, 2)", r"\boxed{(-\infty,2)}", True),
    # tuples and sets
    ("(1, 2)", r"\boxed{(1,2)}", True),
    ("(1, 2)", r"\boxed{(2,1)}", False),
    (r"\{1, 2, 3\}", r"\boxed{\{3, 2, 1\}}", True),
    # equations
    ("3", r"\boxed{x = 3}", True),
    ("x = 3", r"\boxed{3}", True),
    ("3", r"\boxed{x = 4}", False),
    ("x+1", r"\boxed{1+x}", True),
    # multiple-choice letters
    ("B", r"\boxed{B}", True),
    ("B", "The answer is (B).", True),
    ("B", r"\boxed{C}", False),
    ("(C)", "Answer: C", True),
    # GSM8K's gold format: reasoning, then '#### answer'
    (GSM8K_GOLD, "She sold 24 in May, so 48 + 24 = 72 in all. #### 72", True),
    (GSM8K_GOLD, r"48 + 24 = 72, so \boxed{72}", True),
    (GSM8K_GOLD, "#### 73", False),
    ("72", "She sold 72 clips", True),  # no explicit answer: the last expression counts
    # near misses
    ("1/3", r"\boxed{0.5}", False),
    ("0.5", r"\boxed{1/3}", False),
    ("12", r"\boxed{21}", False),
    (r"\frac{1}{2}", r"\boxed{2}", False),
    ("7", r"3 + 4 = 7, so 7. Wait, no: \boxed{8}", False),  # the answer only in the reasoning, another boxed
    ("8", r"3 + 4 = 7, so 7. Wait, no: \boxed{8}", True),
    ("10", "10 apples and 11 pears", False),
    ("12", "", False),
    ("13", "12 13", True),  # two numbers, the last one counts (not 1213)
    ("1213", "12 13", False),
]


def test_the_table_has_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("gold, completion, right", CASES)
def test_math_reward(gold, completion, right):
    assert correctness_reward([completion], [gold], exact=False).tolist() == [float(right)]


def test_a_batch_is_graded_in_order():
    golds, completions, right = zip(*CASES)
    assert correctness_reward(list(completions), list(golds), exact=False).tolist() == [float(r) for r in right]


def test_a_completion_that_cannot_be_graded_in_time_scores_zero_and_grading_goes_on():
    """math-verify's own timeout (signal.alarm, main thread only) is off in its child process; the deadline
    is the parent's. A power tower (sympy spends 5 s on it before math-verify's own default timeout, longer
    without it) scores 0 in about the deadline, and the next completion is graded by a fresh child."""
    grade = MathVerifier(timeout_s=1.0)
    assert grade("$1$", r"\boxed{1}")  # the child is up
    start = time.perf_counter()
    assert not grade("$1$", r"\boxed{9^{9^{9}}}")
    assert time.perf_counter() - start < 4.0 and grade.timeouts == 1  # the 1 s deadline, with slack for load
    assert grade("$1$", r"\boxed{1}") and grade.timeouts == 1


def test_grading_works_outside_the_main_thread():
    """No signal is used in this process, so the reward can be called from any thread."""
    results = []
    thread = threading.Thread(target=lambda: results.append(
        correctness_reward([r"\boxed{\frac{1}{2}}", r"\boxed{3}"], ["0.5", r"\sqrt{2}"], exact=False).tolist()))
    thread.start()
    thread.join(timeout=60)
    assert results == [[1.0, 0.0]]


def test_a_child_that_died_between_completions_is_started_again():
    """A grader child killed from outside (the OOM killer, a signal) is replaced, not written to."""
    grade = MathVerifier()
    assert grade("$1$", r"\boxed{1}")
    grade.child.kill()
    grade.child.wait()
    assert grade("$1$", r"\boxed{1}") and grade.timeouts == 0
