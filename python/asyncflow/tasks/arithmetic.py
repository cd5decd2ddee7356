"""The built-in task: n-digit addition, ``"37+48="`` -> ``"85"``.

Operands have exactly ``digits`` digits; the answer is written naturally (no leading zeros). A fixed
set of problems is held out for evaluation and never used for training, and neither is its
commuted twin (``48+37=`` has the answer of ``37+48=``): the split is by unordered pair. For the
supervised warm start, :func:`demonstration` can reproduce the classic mistake of dropping a
carry, which yields a model that often knows the right answer (sampling finds it) without
preferring it (greedy misses it) — the gap RL is good at closing.

:class:`LongTailAdditionTask` is its variant with a long tail of response lengths: operands of 2
to ``max_digits`` digits, each extra digit half as likely as the one before, and an answer worked
column by column before the result (``"7+8=15\n3+4+1=8\n#### 85"``), so a response grows with
its operands. It measures what long responses cost a step (``rollout.partial``).
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


def scratchpad(a: int, b: int, digits: int, drop: list[bool]) -> str:
    """``a + b`` worked one column a line from the units, then ``#### <sum>``; the carry out of
    column ``i`` is forgotten when ``drop[i]``, and the sum is what those columns give."""
    lines, carry, scale = [], 0, 1
    for i in range(digits):
        x, y = a // scale % 10, b // scale % 10
        s = x + y + carry
        lines.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry = 0 if drop[i] else s // 10
        scale *= 10
    return "\n".join([*lines, f"#### {add_dropping_carries(a, b, digits, drop)}"])


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


class LongTailAdditionTask:
    """Addition of two ``d``-digit numbers, ``d`` from 2 to ``max_digits`` with probability
    halving at each extra digit (``d = 2`` about half the problems), answered with a column-by-
    column scratchpad and ``#### <sum>`` (scored by the ``gsm8k`` reward). Held out by unordered
    pair, as :class:`ArithmeticTask`."""

    name = "addition-longtail"

    def __init__(self, max_digits: int = 6, eval_size: int = 200) -> None:
        if not 3 <= max_digits <= 9:
            raise ValueError(f"max_digits must be in 3..9, not {max_digits}")
        self.max_digits = max_digits
        self._weights = [0.5**d for d in range(max_digits - 1)]
        rng = random.Random(SPLIT_SEED)
        self._eval: list[tuple[int, int]] = []
        self._held: set[tuple[int, int]] = set()
        while len(self._eval) < eval_size:
            a, b = self._pair(rng)
            if (min(a, b), max(a, b)) not in self._held:
                self._held.add((min(a, b), max(a, b)))
                self._eval.append((a, b))

    def _pair(self, rng: random.Random) -> tuple[int, int]:
        digits = rng.choices(range(2, self.max_digits + 1), self._weights)[0]
        lo, hi = 10 ** (digits - 1), 10**digits - 1
        return rng.randint(lo, hi), rng.randint(lo, hi)

    def eval_set(self) -> list[Problem]:
        return [_problem(a, b) for a, b in self._eval]

    def longest_prompt(self) -> Problem:
        n = self.max_digits
        return _problem(10**n - 1, 10**n - 1)

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        rng = random.Random(seed)
        k = 0
        while True:
            a, b = self._pair(rng)
            if (min(a, b), max(a, b)) in self._held:
                continue
            if k >= start:
                yield _problem(a, b)
            k += 1

    def demonstration(self, problem: Problem, rng: random.Random, mistake_rate: float) -> str:
        """The worked answer, each carry dropped with probability ``mistake_rate`` (the result
        following the columns as written)."""
        assert isinstance(problem.prompt, str)
        a, b = (int(x) for x in problem.prompt.rstrip("=").split("+"))
        digits = len(str(a))
        return scratchpad(a, b, digits, [rng.random() < mistake_rate for _ in range(digits)])
