"""Advantages: whole groups of rewarded responses -> group-relative advantages (GRPO or RLOO)."""

from __future__ import annotations

import numpy as np

from asyncflow.algorithms.advantages import group_advantages
from asyncflow.workers.base import Worker


class AdvantageWorker(Worker):
    role = "advantage"

    def step(self) -> bool:
        n = self.config.rollout.n
        batch = self.claim("advantage", ["reward"], n * 32, whole_groups=True)
        if len(batch) == 0:
            return True
        with self.busy("advantages"):
            rewards = np.array([float(r) for r in batch.read()["reward"]])
            adv = group_advantages(
                rewards,
                batch.groups,
                self.config.algorithm.advantage,
                self.config.algorithm.normalize_std,
            )
            self.store.put({"advantage": adv}, indexes=batch.indexes)
        batch.ack()
        return True
