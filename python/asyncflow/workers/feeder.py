"""Prompt feeder: dataset -> prompt rows, one GRPO group per prompt, one training step's worth at
a time, never more than the staleness bound allows ahead of the trainer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import numpy as np

from asyncflow.tasks.base import Problem, Task
from asyncflow.workers.base import PROMPTS, Context, Worker
from asyncflow.workers.reward import pack_answer

#: Group ids of prompts generated in place of groups left out, apart from the main stream's
#: (whose group ``g`` is trained at step ``g // groups_per_step``); and the seed offset of their
#: problems' stream.
EXTRA_GROUPS = 1 << 40
EXTRA_SEED = 7919


class Feeder(Worker):
    role = "feeder"

    def __init__(self, ctx: Context, task: Task, start_group: int = 0) -> None:
        super().__init__(ctx)
        #: Groups issued so far; group ``g`` is trained at step ``g // groups_per_step``.
        self.next_group = start_group
        self.total_groups = self.config.trainer.max_steps * self.config.trainer.groups_per_step
        self._problems: Iterator[Problem] = task.train_stream(self.config.run.seed, start_group)
        ctx.state.issued_groups = start_group
        a = self.config.algorithm
        #: Whether groups left out by ``algorithm.filter_groups`` are replaced: new prompts, from
        #: a stream of their own, with group ids from ``EXTRA_GROUPS`` on.
        self.refills = a.filter_groups and a.max_extra_groups != 0
        self._extra_problems: Iterator[Problem] = task.train_stream(
            self.config.run.seed + EXTRA_SEED, 0
        )
        self._extra_issued: Counter[int] = Counter()
        self._next_extra = EXTRA_GROUPS

    def _replacements(self) -> bool:
        """Puts the prompt groups asked for in place of groups left out; whether it put any."""
        if not self.refills:
            return False
        state = self.ctx.state
        with state.lock:
            wanted = {s: n - self._extra_issued[s] for s, n in state.extra_groups.items()}
        wanted = {s: n for s, n in wanted.items() if n > 0}
        if not wanted:
            return False
        with self.ctx.state.snapshot_lock, self.busy("feed replacements"):
            for target, count in sorted(wanted.items()):
                self._put(
                    [next(self._extra_problems) for _ in range(count)], target, self._next_extra
                )
                self._next_extra += count
                self._extra_issued[target] += count
        return True

    def _put(self, problems: list[Problem], target: int, first_group: int) -> None:
        encode = self.ctx.prompts.encode
        extra = bool(self.config.data.extra_keys)
        count = len(problems)
        self.store.put(
            {
                "prompt_ids": [np.array(encode(p.prompt), np.int64) for p in problems],
                "answer": [pack_answer(p, extra, self.config.agent.enabled) for p in problems],
                "target_step": np.full(count, target, np.int64),
            },
            partition=PROMPTS,
            groups=np.arange(first_group, first_group + count),
            group_size=1,
        )

    def _progress(self) -> tuple[int, int]:
        """What the feeder waits on: the steps trained, and the replacement groups asked for."""
        state = self.ctx.state
        return state.trained_steps, state.extra_groups.total()

    def _wait(self, seen: tuple[int, int], what: str) -> None:
        """Waits until :meth:`_progress` differs from ``seen`` (read before), or the idle wait
        has passed (the run's stop is noticed then, at the latest)."""
        state = self.ctx.state
        with self.waiting(what), state.lock:
            state.progressed.wait_for(lambda: self._progress() != seen, self._idle_wait)

    def step(self) -> bool:
        per_step = self.config.trainer.groups_per_step
        with self.ctx.state.lock:
            seen = self._progress()
        if self._replacements():
            return True
        trained = seen[0]
        if self.next_group >= self.total_groups:
            if not self.refills or trained >= self.config.trainer.max_steps:
                return False
            self._wait(seen, "groups to replace")  # the last steps may still ask for some
            return True
        target = self.next_group // per_step
        ahead = self.config.trainer.max_staleness + 1
        if target > trained + ahead:
            self._wait(seen, "trainer progress")
            return True
        with self.ctx.state.snapshot_lock, self.busy("feed"):
            count = min(per_step - self.next_group % per_step, self.total_groups - self.next_group)
            problems = [next(self._problems) for _ in range(count)]
            self._put(problems, target, self.next_group)
            self.next_group += count
            self.ctx.state.issued_groups = self.next_group
        return True
