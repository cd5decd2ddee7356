"""Consumers of the samples that an earlier run registered on the same store daemon and this run
does not have (a reference model, a critic, a separate reward model): the store keeps a row until
every consumer registered for its partition has acked it, so this run acks its samples for them,
or none would ever be freed."""

from __future__ import annotations

from collections.abc import Sequence

from asyncflow.workers.base import Context, Worker


class AbsentConsumers(Worker):
    role = "absent consumers"

    def __init__(self, ctx: Context, tasks: Sequence[str]) -> None:
        super().__init__(ctx)
        self.tasks = list(tasks)

    def step(self) -> bool:
        for task in self.tasks:
            batch = self.claim(task, ["response_ids"], 1024)
            if len(batch):
                batch.ack()
        return True
