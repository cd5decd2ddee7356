"""The built-in multi-turn task: multiplying 3- and 4-digit numbers (``1234*567=``), which the
tiny model cannot do in its head but can do by calling the ``calculator`` tool and copying the
result. The right trajectory is two model turns: a Hermes-style tool call, then the number the
tool answered.

The warm start teaches the format imperfectly: with probability ``mistake_rate`` a
demonstration either skips the tool and guesses (a product with one digit wrong) or calls it and
copies the result with one digit wrong, half each. RL has to learn that calling and copying
faithfully is what pays. The held-out split is by unordered pair, as in the addition task.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from asyncflow.agents.parser import ToolCall, format_call
from asyncflow.tasks.base import Problem

SPLIT_SEED = 4321
#: ChatML's end of turn (the built-in tokenizer's eos), and how the agent loop wraps a tool's
#: answer (``agent.observation_template``'s default): demonstrations must match both.
END = "<|im_end|>"
OBSERVATION = "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


def _problem(a: int, b: int) -> Problem:
    return Problem(prompt=f"{a}*{b}=", answer=str(a * b))


def one_digit_wrong(value: int, rng: random.Random) -> int:
    """``value`` with one of its digits replaced by a different one (never a leading zero)."""
    digits = list(str(value))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


class MultiplyToolsTask:
    name = "multiply-tools"

    def __init__(self, eval_size: int = 200, low: int = 100, high: int = 9999) -> None:
        rng = random.Random(SPLIT_SEED)
        self.low, self.high = low, high
        held: set[tuple[int, int]] = set()
        self._eval: list[tuple[int, int]] = []
        while len(self._eval) < eval_size:
            a, b = rng.randint(low, high), rng.randint(low, high)
            pair = (min(a, b), max(a, b))
            if pair not in held:
                held.add(pair)
                self._eval.append((a, b))
        self._held = held

    def eval_set(self) -> list[Problem]:
        return [_problem(a, b) for a, b in self._eval]

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        rng = random.Random(seed)
        for k in itertools.count():
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            while (min(a, b), max(a, b)) in self._held:
                a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            if k >= start:
                yield _problem(a, b)

    def demonstration(self, problem: Problem, rng: random.Random, mistake_rate: float) -> str:
        """The response text a demonstrator writes (the warm start appends the final eos)."""
        assert isinstance(problem.prompt, str)
        expression = problem.prompt.rstrip("=")
        product = int(problem.answer)
        if rng.random() < mistake_rate:
            wrong = str(one_digit_wrong(product, rng))
            if rng.random() < 0.5:
                return wrong  # skips the tool, guesses
            return self._with_tool(expression, str(product), wrong)  # copies it wrong
        return self._with_tool(expression, str(product), str(product))

    @staticmethod
    def _with_tool(expression: str, result: str, answer: str) -> str:
        call = format_call(ToolCall("calculator", {"expression": expression}))
        observation = f"<tool_response>\n{result}\n</tool_response>"
        return call + END + OBSERVATION.format(observation=observation) + answer
