"""Builds the configured task."""

from __future__ import annotations

from asyncflow.config import ConfigError, DataConfig
from asyncflow.tasks.arithmetic import ArithmeticTask
from asyncflow.tasks.base import Problem, Task
from asyncflow.tasks.parquet import ParquetTask, read_problems


def load_task(data: DataConfig) -> Task:
    if data.task == "arithmetic":
        return ArithmeticTask(digits=data.digits, eval_size=data.eval_size)
    assert data.train_file is not None  # validated with the config
    train = read_problems(data.train_file, data.prompt_key, data.answer_key)
    if data.eval_file is not None:
        held_out = read_problems(data.eval_file, data.prompt_key, data.answer_key)
    else:
        held_out, train = split_held_out(train, data.eval_size)
    if not train:
        raise ConfigError(
            f"{data.train_file} has no training rows left once data.eval_size="
            f"{data.eval_size} prompts are held out"
        )
    return ParquetTask(train, held_out)


def split_held_out(rows: list[Problem], size: int) -> tuple[list[Problem], list[Problem]]:
    """Holds out the first ``size`` distinct prompts of ``rows``; every row asking one of them,
    later duplicates included, stays out of training, so no held-out prompt is ever trained on."""
    held_out: dict[str, Problem] = {}
    for row in rows:
        if len(held_out) == size:
            break
        held_out.setdefault(row.prompt, row)
    train = [row for row in rows if row.prompt not in held_out]
    return list(held_out.values()), train
