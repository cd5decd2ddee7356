"""Prompt feeder: dataset -> prompt rows, one GRPO group per prompt, one training step's worth at
a time, never more than the staleness bound allows ahead of the trainer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from asyncflow.tasks.base import Problem, Task
from asyncflow.workers.base import PROMPTS, Context, Worker
from asyncflow.workers.reward import pack_answer


class Feeder(Worker):
    role = "feeder"

    def __init__(self, ctx: Context, task: Task, start_group: int = 0) -> None:
        super().__init__(ctx)
        #: Groups issued so far; group ``g`` is trained at step ``g // groups_per_step``.
        self.next_group = start_group
        self.total_groups = self.config.trainer.max_steps * self.config.trainer.groups_per_step
        self._problems: Iterator[Problem] = task.train_stream(self.config.run.seed, start_group)
        ctx.state.issued_groups = start_group

    def step(self) -> bool:
        per_step = self.config.trainer.groups_per_step
        if self.next_group >= self.total_groups:
            return False
        target = self.next_group // per_step
        ahead = self.config.trainer.max_staleness + 1
        if target > self.ctx.state.trained_steps + ahead:
            with self.waiting("trainer progress"):
                self.ctx.stop.wait(0.05)
            return True
        with self.ctx.state.snapshot_lock, self.busy("feed"):
            count = min(per_step - self.next_group % per_step, self.total_groups - self.next_group)
            problems = [next(self._problems) for _ in range(count)]
            encode = self.ctx.prompts.encode
            extra = bool(self.config.data.extra_keys)
            self.store.put(
                {
                    "prompt_ids": [np.array(encode(p.prompt), np.int64) for p in problems],
                    "answer": [pack_answer(p, extra) for p in problems],
                    "target_step": np.full(count, target, np.int64),
                },
                partition=PROMPTS,
                groups=np.arange(self.next_group, self.next_group + count),
                group_size=1,
            )
            self.next_group += count
            self.ctx.state.issued_groups = self.next_group
        return True
