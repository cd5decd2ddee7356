"""What the workflow needs of a task: training prompts, held-out prompts, ground truths."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    name: str

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        """Training problems in a reproducible order, from position ``start`` on (for resume)."""
        ...

    def eval_set(self) -> list[Problem]:
        """Held-out problems, disjoint from training ones."""
        ...
