"""Builds the configured task."""

from __future__ import annotations

from asyncflow.config import DataConfig
from asyncflow.tasks.arithmetic import ArithmeticTask
from asyncflow.tasks.base import Task
from asyncflow.tasks.parquet import ParquetTask, read_problems


def load_task(data: DataConfig) -> Task:
    if data.task == "arithmetic":
        return ArithmeticTask(digits=data.digits, eval_size=data.eval_size)
    assert data.train_file is not None  # validated with the config
    train = read_problems(data.train_file, data.prompt_key, data.answer_key)
    if data.eval_file is not None:
        held_out = read_problems(data.eval_file, data.prompt_key, data.answer_key)
    else:
        held_out, train = train[: data.eval_size], train[data.eval_size :]
    return ParquetTask(train, held_out)
