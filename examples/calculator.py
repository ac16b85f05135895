"""A calculator tool for multi-turn RL, the worked example of docs/environments.md: copy it and change `step`.

The policy may write an arithmetic expression between <calc> and </calc>; its turn ends there (a stop string),
and the environment answers with the value as a tool message. A turn that ends at EOS without a call is the
final answer, graded against the row's answer by the project's grader (1 right, 0 wrong: the episode's return).

    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset train.jsonl --env examples/calculator.py:Calculator \\
        --max-turns 4 --max-new-tokens 512
"""

import ast
import operator

from common import math_reward

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float:
    """The value of +, -, *, /, ** and parentheses over numbers; anything else raises (no `eval`: the policy's text
    is not code to run). Exponents are capped so that a call cannot take the process's memory."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    return value(ast.parse(expression.strip(), mode="eval").body)


class Calculator:
    stop = ["</calc>"]  # a turn also ends where a tool call does

    def __init__(self, row: dict):  # one per episode, from its dataset row
        self.answer = row["answer"]

    def step(self, action: str) -> tuple[str | dict | None, float, bool]:  # (observation, reward, done)
        if action.rstrip().endswith("</calc>"):  # a tool call: answer it, no reward yet
            expression = action.rsplit("<calc>", 1)[-1].rstrip().removesuffix("</calc>")
            try:
                result = f"{calculate(expression):g}"
            except (ValueError, SyntaxError, ArithmeticError, RecursionError) as error:
                result = f"error: {error}"
            return {"role": "tool", "content": result}, 0.0, False
        return None, float(math_reward(action, self.answer)), True  # the final answer
