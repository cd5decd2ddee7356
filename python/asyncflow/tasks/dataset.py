"""A dataset task: prompts and ground truths from local files with verl-style columns.

Every row is checked, and its prompt rendered, when the task is built, before any worker starts:
a prompt column of the wrong type, a chat without a user message, a template that fails, a
missing answer or extra key is refused naming the file, the row and the key. Prompts longer than
``data.max_prompt_length`` are left out under the ``filter`` policy, and counted.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncflow.config import DataConfig
from asyncflow.tasks.base import Problem
from asyncflow.tasks.prompts import PromptEncoder, PromptError
from asyncflow.tasks.records import DatasetError, read_records

_MISSING = object()


def dig(row: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` into a row's nested columns, or ``_MISSING``."""
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _problem(row: dict[str, Any], data: DataConfig, where: str) -> Problem:
    values = {}
    demo = [data.demonstration_key] if data.demonstration_key else []
    for key in [data.prompt_key, data.answer_key, *data.extra_keys, *demo]:
        value = dig(row, key)
        if value is _MISSING or value is None:
            raise DatasetError(f"{where} has no {key!r}")
        values[key] = value
    prompt = values[data.prompt_key]
    if not isinstance(prompt, (str, list)):
        raise DatasetError(
            f"{where} key {data.prompt_key!r}: a prompt is text or a list of "
            f"{{role, content}} messages, not {type(prompt).__name__} ({prompt!r:.60})"
        )
    answer = values[data.answer_key]
    if isinstance(answer, (dict, list)):
        raise DatasetError(
            f"{where} key {data.answer_key!r}: the ground truth must be a scalar, not "
            f"{type(answer).__name__}"
        )
    # The values a reward function is given are what the store carries for training (JSON),
    # the same for held-out evaluation: refused here, naming the row, if JSON cannot hold them.
    extra = {}
    for key in data.extra_keys:
        try:
            extra[key] = json.loads(json.dumps(values[key], allow_nan=False))
        except (TypeError, ValueError) as e:
            raise DatasetError(
                f"{where} key {key!r}: an extra value must be what JSON holds "
                f"(text, numbers, lists, maps): {e}"
            ) from None
    demonstration = str(values[data.demonstration_key]) if data.demonstration_key else None
    return Problem(prompt, _text(answer), extra, demonstration)


def _text(answer: Any) -> str:
    """A ground truth as text; a whole number read as a float (an integer column with a missing
    value becomes floats) is written as the integer it is: ``2``, not ``2.0``."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer)


def read_problems(
    path: str | Path, data: DataConfig, prompts: PromptEncoder
) -> tuple[list[Problem], int]:
    """The usable problems of a file, and how many were left out for being too long."""
    rows = read_records(path, data.format)
    if not rows:
        raise DatasetError(f"{path} has no rows")
    problems, too_long = [], 0
    for i, row in enumerate(rows):
        where = f"{path} row {i}"
        problem = _problem(row, data, where)
        try:
            ids = prompts.render(problem.prompt)
        except PromptError as e:
            raise DatasetError(f"{where} key {data.prompt_key!r}: {e}") from None
        if not ids:
            raise DatasetError(f"{where} key {data.prompt_key!r}: the prompt has no tokens")
        if not prompts.fits(ids) and prompts.truncation == "filter":
            too_long += 1
            continue
        problems.append(problem)
    if not problems:
        raise DatasetError(
            f"{path}: no row is left once the {too_long} prompts longer than "
            f"data.max_prompt_length = {prompts.max_length} tokens are left out"
        )
    return problems, too_long


class DatasetTask:
    name = "dataset"

    def __init__(
        self, train: list[Problem], held_out: list[Problem], too_long: dict[str, int]
    ) -> None:
        self._train = train
        self._eval = held_out
        #: Prompts left out for being longer than ``data.max_prompt_length``, by split.
        self.too_long = too_long

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
