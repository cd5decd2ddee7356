"""The built-in task: n-digit addition, ``"37+48="`` -> ``"85"``.

Operands have exactly ``digits`` digits; the answer is written naturally (no leading zeros). A fixed
set of problems is held out for evaluation and never used for training, and neither is its
commuted twin (``48+37=`` has the answer of ``37+48=``): the split is by unordered pair. For the
supervised warm start, :func:`demonstration` can reproduce the classic mistake of dropping a
carry, which yields a model that often knows the right answer (sampling finds it) without
preferring it (greedy misses it) — the gap RL is good at closing.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from asyncflow.tasks.base import Problem

#: The held-out split is the same for every run and seed.
SPLIT_SEED = 1234


def _problem(a: int, b: int) -> Problem:
    return Problem(prompt=f"{a}+{b}=", answer=str(a + b))


def add_dropping_carries(a: int, b: int, digits: int, drop: list[bool]) -> int:
    """``a + b`` computed digit by digit, forgetting the carry out of position ``i`` when
    ``drop[i]`` (position 0 is the units)."""
    total, carry, scale = 0, 0, 1
    for i in range(digits):
        s = a // scale % 10 + b // scale % 10 + carry
        total += s % 10 * scale
        carry = 0 if drop[i] else s // 10
        scale *= 10
    return total + carry * scale


def has_carry(a: int, b: int, digits: int) -> bool:
    return add_dropping_carries(a, b, digits, [True] * digits) != a + b


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, digits: int = 2, eval_size: int = 200) -> None:
        lo, hi = 10 ** (digits - 1), 10**digits
        unordered = [(a, b) for a in range(lo, hi) for b in range(a, hi)]
        if eval_size >= len(unordered) // 2:
            raise ValueError(f"eval_size {eval_size} leaves too few training problems")
        rng = random.Random(SPLIT_SEED)
        rng.shuffle(unordered)
        # Each held-out pair is asked in one order, drawn at random; neither order is trained on.
        self.digits = digits
        self._eval = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in unordered[:eval_size]]
        self._train = [
            ordered
            for a, b in unordered[eval_size:]
            for ordered in ([(a, b)] if a == b else [(a, b), (b, a)])
        ]

    def eval_set(self) -> list[Problem]:
        return [_problem(a, b) for a, b in self._eval]

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        rng = random.Random(seed)
        for k in itertools.count():
            a, b = self._train[rng.randrange(len(self._train))]
            if k >= start:
                yield _problem(a, b)

    def demonstration(self, problem: Problem, rng: random.Random, mistake_rate: float) -> str:
        """The answer text a demonstrator writes: correct, except that each carry is dropped with
        probability ``mistake_rate``."""
        assert isinstance(problem.prompt, str)  # this task's prompts are text
        a, b = (int(x) for x in problem.prompt.rstrip("=").split("+"))
        drop = [rng.random() < mistake_rate for _ in range(self.digits)]
        return str(add_dropping_carries(a, b, self.digits, drop))
