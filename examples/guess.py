"""The environment of `--task guess`, the built-in multi-turn game (docs/environments.md): a secret number from 0
to 99, the dataset row's answer. Each turn the policy guesses; the episode ends with reward 1 when the guess is
right, else the environment answers 'higher' or 'lower' (bisection finds any secret in 7 guesses)."""


class Guess:
    def __init__(self, row: dict):  # one per episode, from its dataset row
        self.secret = int(row["answer"])

    def step(self, action: str) -> tuple[str | None, float, bool]:  # (observation, reward, done)
        guess = int(action) if action.strip().isdigit() else -1  # not a number: 'higher'
        if guess == self.secret:
            return None, 1.0, True
        return "higher" if self.secret > guess else "lower", 0.0, False
