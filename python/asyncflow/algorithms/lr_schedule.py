"""The learning-rate schedule of RL training, as a factor of ``trainer.lr`` per optimiser step;
every train engine applies the same one."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from asyncflow.config import TrainerConfig


def lr_factor(t: TrainerConfig) -> Callable[[int], float]:
    """Linear warm-up over ``warmup_steps`` (from ``1/warmup_steps``, so no step is wasted at
    zero), then constant, or a cosine decay to ``min_lr_ratio`` at ``max_steps``. Steps are RL
    steps: the ``ppo_epochs`` optimiser steps of one share its rate."""

    def factor(optimiser_step: int) -> float:
        step = optimiser_step // t.ppo_epochs
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        span = max(1, t.max_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def reapply(schedule: torch.optim.lr_scheduler.LambdaLR, t: TrainerConfig) -> None:
    """This run's ``trainer.lr`` and ``trainer.weight_decay`` on an optimiser and its schedule
    just loaded from a checkpoint, which brought back the ones they were saved with: a resume
    may change them. The rate in effect is the new one at the schedule's place (this run's
    schedule, should ``trainer.max_steps`` or the warm-up have changed)."""
    optimizer = schedule.optimizer
    schedule.base_lrs = [t.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas, strict=True):
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * factor(schedule.last_epoch)
        group["weight_decay"] = t.weight_decay
    schedule._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr says
