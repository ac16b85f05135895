"""A calculator for the chain task that runs offline (docs/environments.md): the chain model writes its partial sums
('12+7=19 19+30=49 #### 49'); here a turn that ends at '=' ('12+7=', a stop string) is a tool call, answered with the
sum as a tool message, and a turn that ends at EOS is the final answer, graded (the episode's return, 1 or 0).
benchmarks/lockstep.py --shape tool measures what stopping a turn at its stop string saves.

    python grpo.py --task chain --env examples/sums.py:Sums --max-turns 4 --max-new-tokens 96
"""


class Sums:
    stop = ["="]  # a turn also ends where a tool call does

    def __init__(self, row: dict):  # one per episode, from its dataset row
        self.answer = row["answer"]

    def step(self, action: str) -> tuple[str | dict | None, float, bool]:  # (observation, reward, done)
        if not action.endswith("="):  # the final answer
            return None, float(action.rsplit("####", 1)[-1].strip() == self.answer), True
        terms = action.rsplit(" ", 1)[-1].removesuffix("=").split("+")  # the call: '12+7'
        value = sum(map(int, terms)) if all(term.isdigit() for term in terms) else "not a sum"
        return {"role": "tool", "content": str(value)}, 0.0, False
