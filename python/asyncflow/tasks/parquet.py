"""Prompts from local parquet files with verl-style columns (read with pyarrow).

The prompt column holds text, or a chat (a list of ``{"role", "content"}`` messages, whose last
user message is used); the answer is found by a dotted path, e.g. ``reward_model.ground_truth``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from asyncflow.config import ConfigError
from asyncflow.tasks.base import Problem


def _dig(row: dict[str, Any], path: str) -> Any:
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"parquet rows have no {path!r} (missing {part!r})")
        node = node[part]
    return node


def _prompt_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        users = [m for m in value if m.get("role") == "user"] or value
        return str(users[-1].get("content", ""))
    raise ConfigError(f"cannot read a prompt from {type(value).__name__} values")


def read_problems(path: str | Path, prompt_key: str, answer_key: str) -> list[Problem]:
    table = pq.read_table(path)
    if table.num_rows == 0:
        raise ConfigError(f"{path} has no rows")
    return [
        Problem(_prompt_text(_dig(row, prompt_key)), str(_dig(row, answer_key)))
        for row in table.to_pylist()
    ]


class ParquetTask:
    name = "parquet"

    def __init__(self, train: list[Problem], held_out: list[Problem]) -> None:
        self._train = train
        self._eval = held_out

    def eval_set(self) -> list[Problem]:
        return list(self._eval)

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        """Epochs over the training rows, each in a fresh seeded order."""
        k, epoch = 0, 0
        while True:
            order = list(range(len(self._train)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            for i in order:
                if k >= start:
                    yield self._train[i]
                k += 1
            epoch += 1
