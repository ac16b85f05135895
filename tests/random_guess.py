"""The game of `--task guess` (examples/guess.py) with a reward that draws from Python's `random` and NumPy's, as an
environment that samples its secrets or its noise does: its runs repeat, and resume bitwise, only where --seed seeds
both generators and a checkpoint restores them (tests/test_resume.py, gvpo)."""

import random

import numpy as np

from examples.guess import Guess


class RandomGuess(Guess):
    def step(self, action: str):
        observation, reward, done = super().step(action)
        return observation, reward + (random.random() + np.random.rand()) / 100, done
