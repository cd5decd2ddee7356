"""Builds the configured task, its prompts checked against the model's tokenizer."""

from __future__ import annotations

import logging

import numpy as np

from asyncflow.config import DataConfig
from asyncflow.errors import ConfigError
from asyncflow.tasks.arithmetic import ArithmeticTask, LongTailAdditionTask
from asyncflow.tasks.base import Problem, Task
from asyncflow.tasks.dataset import DatasetTask, read_problems
from asyncflow.tasks.multiply_tools import MultiplyToolsTask
from asyncflow.tasks.prompts import PromptEncoder, PromptError

log = logging.getLogger(__name__)


def load_task(data: DataConfig, prompts: PromptEncoder) -> Task:
    if data.task == "multiply-tools":
        return MultiplyToolsTask(eval_size=data.eval_size)
    if data.task == "arithmetic":
        task = ArithmeticTask(digits=data.digits, eval_size=data.eval_size)
        _check_generated(prompts, task.eval_set()[0])
        return task
    if data.task == "addition-longtail":
        longtail = LongTailAdditionTask(max_digits=data.digits, eval_size=data.eval_size)
        _check_generated(prompts, longtail.longest_prompt())
        return longtail
    assert data.train_file is not None  # validated with the config
    train, too_long = read_problems(data.train_file, data, prompts)
    counts = {"train": too_long}
    if data.eval_file is not None:
        held_out, counts["eval"] = read_problems(data.eval_file, data, prompts)
        asked = {p.key for p in held_out}
        kept = [row for row in train if row.key not in asked]
        if len(kept) < len(train):  # held-out problems are never trained on
            log.warning(
                "%d rows of %s ask a prompt of %s: left out of training",
                len(train) - len(kept),
                data.train_file,
                data.eval_file,
            )
        train = kept
    else:
        held_out, train = split_held_out(train, data.eval_size)
    if not train:
        held = data.eval_file or f"data.eval_size={data.eval_size}"
        raise ConfigError(
            f"{data.train_file} has no training rows left once the prompts of {held} are held out"
        )
    return DatasetTask(train, held_out, counts)


def _check_generated(prompts: PromptEncoder, problem: Problem) -> None:
    """A generated task's longest prompt tells whether they all fit."""
    try:
        ids = prompts.render(problem.prompt)
    except PromptError as e:
        raise ConfigError(f"the built-in task's prompt {problem.prompt!r}: {e}") from None
    if not prompts.fits(ids):
        raise ConfigError(
            f"the built-in task's prompts take {len(ids)} tokens, more than the "
            f"{prompts.max_length} left for a prompt (raise model.max_positions, or "
            "lower rollout.max_tokens)"
        )


#: The held-out sample is the same for every run (and every ``run.seed``): seeds are compared on
#: the same problems.
HELD_OUT_SEED = 0


def split_held_out(rows: list[Problem], size: int) -> tuple[list[Problem], list[Problem]]:
    """Holds out ``size`` distinct prompts of ``rows`` drawn at random (a file sorted by kind or
    difficulty would otherwise give its first kind only), in file order; every row asking one
    of them, duplicates included, stays out of training, so no held-out prompt is trained on."""
    first: dict[str, Problem] = {}
    for row in rows:
        first.setdefault(row.key, row)
    keys = list(first)
    drawn = np.random.default_rng(HELD_OUT_SEED).permutation(len(keys))[:size]
    held = {keys[i] for i in drawn}
    train = [row for row in rows if row.key not in held]
    return [first[k] for k in keys if k in held], train
