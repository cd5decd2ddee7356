"""A training step as one data-parallel rank runs it, in its own process.

Every rank asks the store for its part of the step with a shared claim: the first to ask claims
the step's whole batch, split into token-balanced parts with a GRPO group on one rank. A rank cuts
its part into token-budget micro-batches; since ZeRO-2/3 talk to the peers in every backward, the
ranks agree on the largest count and pad with empty micro-batches. The optimiser step reduces the
gradients across ranks; rank 0 publishes the new weights (through the store, or over the
weight-sync group to the job's process).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from asyncflow.batch import Batch
from asyncflow.config import Config
from asyncflow.engines.base import StepResult, TrainBatch, TrainEngine
from asyncflow.errors import StoreTimeoutError
from asyncflow.store import Store
from asyncflow.weight_sync import Publisher
from asyncflow.weight_sync.store_transport import StorePublisher
from asyncflow.workers.base import LEASES, StallError, step_partition
from asyncflow.workers.colocation import release_cached_gpu_memory
from asyncflow.workers.steps import (
    StepLoss,
    figure_sums,
    kept_rows,
    sample_fields,
    sample_lengths,
    update,
)


def agree_on_most(count: int) -> int:
    """The largest ``count`` over all ranks (a collective call)."""
    value = torch.tensor([count], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


class RankStep:
    """Runs training steps for rank ``rank`` of ``world_size``."""

    def __init__(
        self,
        store: Store,
        config: Config,
        engine: TrainEngine,
        pad_id: int,
        rank: int,
        world_size: int,
        stop: threading.Event,
        publisher: Publisher | None = None,
    ) -> None:
        """``publisher``: how rank 0 publishes each version (default: through ``store``)."""
        self.store = store
        self.publisher = publisher if publisher is not None else StorePublisher(store)
        self.config = config
        self.engine = engine
        self.rank = rank
        self.world_size = world_size
        self.stop = stop
        self.loss = StepLoss(config, pad_id, engine.model_config)
        self.fields = sample_fields(config)
        self._parent = os.getppid()

    def _claim(self, s: int) -> Batch | None:
        """This rank's part of step ``s``, once the whole step's samples are ready."""
        waited_since = time.monotonic()
        while not self.stop.is_set():
            try:
                return self.store.claim(
                    "train",
                    self.fields,
                    self.loss.rows_per_step,
                    timeout=self.config.run.poll_interval * 4,
                    partition=step_partition(s),
                    whole_groups=True,
                    step=s,
                    dp_rank=self.rank,
                    dp_size=self.world_size,
                    balance_field="response_ids",
                )
            except StoreTimeoutError:
                waited = time.monotonic() - waited_since
                if waited > self.config.run.stall_timeout:
                    raise StallError(
                        f"trainer rank {self.rank} has waited {waited:.0f}s for the samples of "
                        f"step {s}; is an upstream worker stuck or dead?"
                    ) from None
                if os.getppid() != self._parent:
                    return None  # the job that started this rank is gone
        return None

    def run(self, s: int) -> StepResult | None:
        started = time.perf_counter()
        batch = self._claim(s)
        if batch is None:
            return None
        result = StepResult(wait_seconds=time.perf_counter() - started)
        age, stale, _, data = kept_rows(batch, s, self.config.trainer.max_staleness)
        result.note(batch.groups, age, stale, data["reward"], figure_sums(data))
        with LEASES.kept([batch], self.config.store.lease_timeout):
            micro = self._micro_batches(data, result)
            for tb in micro:
                stats = self.engine.forward_backward(tb, self.loss)
                if tb.response_mask.any():  # padding micro-batches train nothing
                    result.loss_stats.append(stats)
            result.optimizer = update(self.engine, micro, self.loss, self.config.trainer.ppo_epochs)
        batch.ack()
        self.engine.version = s + 1
        started = time.perf_counter()
        self.publish()
        result.publish_seconds = time.perf_counter() - started
        if self.config.rollout.sleep_while_training:
            release_cached_gpu_memory()  # the engines sharing this GPU wake up next
        return result

    def _micro_batches(self, data: dict[str, list[Any]], result: StepResult) -> list[TrainBatch]:
        lengths = sample_lengths(data)
        count = agree_on_most(len(self.loss.parts(data)) if lengths else 0)
        parts = self.loss.parts(data, min_count=count)
        batches = self.loss.micro_batches(data, parts, self.config.algorithm.reference)
        for part, tb in zip(parts, batches, strict=True):
            if part:
                result.count_batch(tb, [lengths[i] for i in part])
            if self.config.trainer.ppo_epochs > 1:
                tb.extras["prox_logp"] = self.engine.logprobs(tb)
        return batches

    def publish(self) -> None:
        """Rank 0 publishes the current weights (gathering them is collective)."""
        exported = self.engine.export_weights()
        if self.rank == 0:
            self.publisher.publish(self.engine.version, exported)
