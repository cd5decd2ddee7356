"""Single workers against an embedded store: what each promises its neighbours."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.models.tokenizer import CharTokenizer
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks
from asyncflow.workers.base import PROMPTS, Context, RunState, step_partition
from asyncflow.workers.rollout import Rollout
from asyncflow.workers.trainer import Ledger, Trainer


def context(*overrides: str) -> Context:
    config = cfg.load(None, ["rollout.n=2", "trainer.groups_per_step=2", *overrides])
    store = af.Store()
    register_tasks(store, reference=False)
    return Context(store, config, CharTokenizer(), Tracer(), RunState())


def put_samples(store: af.Store, group: int) -> None:
    """One group of two samples of step 0, every field the trainer reads ready."""
    ids = [np.array([3, 4], np.int64)] * 2
    store.put(
        {
            "prompt_ids": ids,
            "response_ids": ids,
            "behaviour_logprobs": [np.zeros(2, np.float32)] * 2,
            "advantage": np.zeros(2, np.float32),
            "reward": np.zeros(2, np.float32),
        },
        partition=step_partition(0),
        groups=[group, group],
    )


def test_a_non_streaming_trainer_waits_for_the_whole_step(tmp_path: Path) -> None:
    ctx = context("trainer.streaming=false", "run.poll_interval=0.05")
    trainer = Trainer(ctx, None, MetricsLog(tmp_path), Ledger(tmp_path / "ledger"))  # type: ignore[arg-type]
    put_samples(ctx.store, group=0)
    assert not trainer._whole_step_ready(0)
    put_samples(ctx.store, group=1)
    assert trainer._whole_step_ready(0)
    # The barrier hands the step back: the micro-batch claims that follow get all of it.
    batch = ctx.store.claim("train", trainer.fields, 4, timeout=1, partition=step_partition(0))
    assert len(batch) == 4


class ReloadedMidCall(RolloutEngine):
    """An engine shared with another worker, which loads version 1 while this call runs."""

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self.version = 1
        return [[Completion([5, 1], [-0.1, -0.1], "2")] * sampling.n for _ in prompts]

    def load_weights(self, version: int, weights: object) -> None:
        self.version = version


def put_prompt(store: af.Store) -> None:
    store.put(
        {
            "prompt_ids": [np.array([3, 4], np.int64)],
            "answer": [b"2"],
            "target_step": np.zeros(1, np.int64),
        },
        partition=PROMPTS,
        groups=[0],
        group_size=1,
    )


def test_samples_carry_the_version_their_generation_started_with() -> None:
    ctx = context()
    put_prompt(ctx.store)
    Rollout(ctx, ReloadedMidCall()).step()
    assert list(ctx.store.rows(partition=step_partition(0)).versions) == [0, 0]


class Saturated(ReloadedMidCall):
    def wait_for_room(self, timeout: float) -> bool:
        return False


def test_a_rollout_worker_claims_no_prompts_while_its_engine_is_full() -> None:
    ctx = context()
    put_prompt(ctx.store)
    Rollout(ctx, Saturated()).step()
    assert len(ctx.store.rows(partition=step_partition(0))) == 0
    assert len(ctx.store.claim("rollout", "prompt_ids", 1, timeout=1)) == 1


def test_waiting_workers_see_new_weights_once_they_are_published() -> None:
    store = af.Store()
    watcher = weights.Watcher(store, interval=0.01)
    assert watcher.latest() is None
    publisher = threading.Timer(0.1, weights.publish, (store, 3, [("w", torch.zeros(2))]))
    publisher.start()
    started = time.monotonic()
    assert watcher.wait_for(3, timeout=10)
    assert time.monotonic() - started < 5
    assert watcher.latest() == 3
    assert not watcher.wait_for(4, timeout=0.1)
    publisher.join()
