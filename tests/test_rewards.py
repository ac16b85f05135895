"""The math reward of real data (common.correctness_reward with exact_match=False): a table of (gold answer,
completion, right?) cases in the forms MATH- and GSM8K-style datasets use, each run through the
reward itself; and math-verify's own timeout."""

import time

import pytest

from common import correctness_reward

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

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
    # letters, compared as symbols
    ("B", r"\boxed{B}", True),
    ("B", r"\boxed{C}", False),
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
    # a comma is a thousands separator only between groups of three digits; numbers compare exactly
    ("0,1", r"\boxed{1}", False),  # two answers, not the number 1
    ("123456789", r"\boxed{123456700}", False),
    ("0.1", r"\boxed{0.1000001}", False),
    # answers as MATH and GSM8K write them: a dollar sign, a thin space or {,} in thousands, a percent sign
    (r"\$18", r"\boxed{18}", True),
    (r"\$18.90", r"\boxed{\$18.90}", True),
    (r"\$32,\!348", r"\boxed{32348}", True),
    (r"\$32,\!348", r"\boxed{32349}", False),
    (r"1,\!000,\!000", r"\boxed{1{,}000{,}000}", True),
    # a base subscript is part of the answer, compared as text with its base (Python's Fraction reads '_' as
    # a digit separator, which made 10001_2 the number 100012)
    ("10001_2", r"\boxed{100012}", False),
    ("10001_2", r"\boxed{10001_2}", True),
    ("10001_2", r"\boxed{10001_{2}}", True),
    ("10001_2", r"\boxed{10011_2}", False),
    # scientific notation on both sides, exactly
    ("6.02e23", r"\boxed{6.02 \times 10^{23}}", True),
    ("6.02e23", r"\boxed{6.03 \times 10^{23}}", False),
    (r"6.02 \times 10^{23}", r"\boxed{602000000000000000000000}", True),
    ("1e-7", r"\boxed{10^{-7}}", True),
    ("1e309", r"\boxed{1 \times 10^{309}}", True),  # past a float's range: no OverflowError
    ("1e309", r"\boxed{2}", False),
    # GSM8K: the number right after the last '####'; what follows it is not part of the answer
    ("72", "#### 72 dollars", True),
    ("72", "#### 72.", True),
    ("72", "#### $72", True),
    ("5", "#### 5\n\nQuestion: Tom has 72 apples.", True),
    ("72", "#### 5\n\nQuestion: Tom has 72 apples.", False),
    ("1234", "#### 1,234 apples", True),
    # a completion cut off inside its final answer has none: never graded on an earlier number
    ("72", r"We start with 72 apples. Then we compute \boxed{\frac{3}{", False),
    ("72", "The total is 72.\n####", False),
    ("72", "The total is 72.\n#### ", False),
    ("72", r"\boxed{72} Wait, let me check: \boxed{7", False),
    # a JSON float is its shortest repr (16-17 digits): the same value in any notation is right, at that precision
    ("0.3333333333333333", r"\boxed{\frac{1}{3}}", True),
    ("0.3333333333333333", r"\boxed{1/3}", True),
    ("0.3333333333333333", r"\boxed{0.3333}", False),
    ("0.30000000000000004", r"\boxed{0.3}", False),  # 0.1 + 0.2: not the double nearest 0.3
    ("0.6666666666666666", r"\boxed{\dfrac{2}{3}}", True),
    # DAPO-Math-17k's prompt asks for a last line 'Answer: $Answer': math-verify reads the expression after the last
    # 'answer:' (any case, bold or not), lines after it left out; a \boxed{} anywhere comes first (rule 1)
    ("34", "Let me think.\nAnswer: 34", True),
    ("34", "Answer: 34\nThat is all, since the total is 12.", True),
    ("12", "Answer: 34\nCheck: 12", False),
    ("34", "answer: 34", True),
    ("42", "**Answer:** 42", True),
    (r"\frac{3}{4}", r"Answer: $\frac{3}{4}$", True),
    ("1000000", "Answer: 1,000,000", True),
    ("3", "Answer: x = 3", True),
    ("35", "Answer: 34", False),
    ("34", "Answer: 12\nWait. Answer: 34", True),
    ("12", "Answer: 12\nWait. Answer: 34", False),
    ("12", r"Answer: 34, so \boxed{12}", True),
    # exact fractions, also in LaTeX: not math-verify's float tolerance
    ("0.1", r"\boxed{\frac{100001}{1000000}}", False),
    (r"\frac{1}{3}", r"\boxed{0.3333333333333333}", False),
]


def test_the_table_has_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("gold, completion, right", CASES)
def test_math_reward(gold, completion, right):
    assert correctness_reward([completion], [gold], exact_match=False).tolist() == [float(right)]


def test_a_batch_is_graded_in_order():
    golds, completions, right = zip(*CASES)
    assert correctness_reward(list(completions), list(golds), exact_match=False).tolist() == [float(r) for r in right]


def test_a_completion_that_cannot_be_graded_in_time_scores_zero_and_grading_goes_on():
    """math-verify's own timeouts (5 s by default, as TRL's accuracy reward uses it): a power tower, which
    sympy would evaluate for far longer, scores 0 in about that time, and the next completion is graded."""
    start = time.perf_counter()
    assert correctness_reward([r"\boxed{9^{9^{9}}}", r"\boxed{1}"], ["1", "1"], exact_match=False).tolist() == [
        0.0,
        1.0,
    ]
    assert time.perf_counter() - start < 30  # the timeout, with slack for a loaded machine


@pytest.mark.parametrize(
    "gold, completion, right",
    [
        ("1", r"\boxed{1e99999999}", False),  # a Fraction of 10^99999999 took 224 s
        ("1e99999999", r"\boxed{10^{99999999}}", True),
        ("1e99999999", r"\boxed{2e99999999}", False),
        ("1", r"\boxed{1e999999999999999999999}", False),
        ("1", "#### " + "9" * 100_000, False),  # a number longer than Python's int conversion allows
        ("1", r"\boxed{\frac{1}{" + "7" * 100_000 + "}}", False),
    ],
)
def test_huge_numbers_are_graded_in_bounded_time(gold, completion, right):
    start = time.perf_counter()
    assert correctness_reward([completion], [gold], exact_match=False).tolist() == [float(right)]
    assert time.perf_counter() - start < 30  # math-verify's own timeout at most, with slack for a loaded machine
