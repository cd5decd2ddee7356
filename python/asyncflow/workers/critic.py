"""The critic (PPO's value model) as a task of its own in the dataflow, with two store tasks:

- ``critic``: claims samples (prompt and response ids) as rollout writes them, and writes each
  one's per-token ``values``, which the advantage worker turns into GAE advantages;
- ``critic_train``: claims samples whose ``returns`` the advantage worker has written, and takes
  one optimiser step of the clipped value loss on each claim (a mean over its tokens, in
  micro-batches within the trainer's token budget), the values they were scored with as the
  clip's anchor. Rows left out by the advantage worker (NaN returns) are acked untrained.

Scoring comes first in each turn (the advantages wait for it); the critic trains on its own
schedule, on whatever returns are ready, and scores later samples with its newer weights:
stale values, like stale samples, are what an asynchronous pipeline works with.

Checkpoints: a row the critic has trained on gets the field ``critic_trained`` before it is
acked, and a checkpoint takes the critic's state and the store's rows under the worker's
``lock``, so the two agree: a resumed run's critic skips the rows its weights have already
learnt from (rows the policy has still to train stay in flight), and learns from all others.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow.algorithms.value import value_loss
from asyncflow.columns import Ragged
from asyncflow.engines.base import TrainBatch
from asyncflow.engines.critic import CriticEngine, ValueLossFn
from asyncflow.workers.base import Context, Worker
from asyncflow.workers.batches import split_micro_batches, to_train_batch

SCORE_FIELDS = ["prompt_ids", "response_ids"]
TRAIN_FIELDS = ["prompt_ids", "response_ids", "values", "returns"]
#: Set on each row the critic has trained on (a checkpoint keeps it with the row).
TRAINED = "critic_trained"


class CriticWorker(Worker):
    role = "critic"

    def __init__(self, ctx: Context, engine: CriticEngine) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.pad_id = ctx.tokenizer.pad_id
        self.budget = self.config.trainer.micro_batch_tokens
        self.clip = self.config.critic.value_clip
        self.rows_per_update = self.config.trainer.groups_per_step * self.config.rollout.n
        #: Multi-turn rows: values are learnt only at the tokens the model wrote.
        self.train_fields = TRAIN_FIELDS + (["loss_mask"] if self.config.agent.enabled else [])
        #: Mean value loss of each optimiser step, in order.
        self.losses: list[float] = []
        #: Held from a training claim's read to its ack, and by a checkpoint.
        self.lock = threading.Lock()

    def step(self) -> bool:
        scored = self.score()
        trained = self.train()
        self.note_progress(scored or trained, "samples to score or returns to train on")
        return True

    def summary(self) -> dict[str, Any]:
        """The critic's optimiser steps and its value loss at the first and the last."""
        return {
            "updates": len(self.losses),
            "version": self.engine.version,
            "value_loss_first": self.losses[0] if self.losses else None,
            "value_loss_last": self.losses[-1] if self.losses else None,
        }

    def claim_quietly(self, task: str, fields: list[str], rows: int) -> Any:
        """A claim that leaves stall detection to :meth:`step` (either task may be idle)."""
        with self.waiting(f"claim {'+'.join(fields)}"):
            return self.store.claim(
                task, fields, rows, timeout=self.config.run.poll_interval / 2, allow_partial=True
            )

    def score(self) -> bool:
        batch = self.claim_quietly("critic", SCORE_FIELDS, 64)
        if len(batch) == 0:
            return False
        with self.busy("values"), self.holding(batch):
            data = batch.read()
            out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(batch)
            for part, tb in self.micro_batches(data):
                values = self.engine.values(tb).to(torch.float32)
                for row, i in enumerate(part):
                    p, r = len(data["prompt_ids"][i]), len(data["response_ids"][i])
                    out[i] = values[row, p : p + r].numpy()
            whole = Ragged(np.concatenate(out), [len(r) for r in data["response_ids"]])
            self.store.put({"values": whole}, indexes=batch.indexes, ack=batch)
        return True

    def train(self) -> bool:
        # Claimed under the lock too: a checkpoint saving the critic holds it, and a batch
        # claimed before it would wait out the checkpoint on its lease.
        with self.lock:
            batch = self.claim_quietly("critic_train", self.train_fields, self.rows_per_update)
            if len(batch) == 0:
                return False
            with self.busy("critic update"), self.holding(batch):
                data = batch.read()
                learnt = [TRAINED in f for f in self.store.ready_fields(batch.indexes)]
                kept = [
                    i
                    for i, r in enumerate(data["returns"])
                    if np.isfinite(np.asarray(r)).all() and not learnt[i]
                ]
                data = {k: [v[i] for i in kept] for k, v in data.items()}
                tokens = (
                    sum(int(np.count_nonzero(m)) for m in data["loss_mask"])
                    if "loss_mask" in data
                    else sum(len(r) for r in data["response_ids"])
                )
                if tokens:
                    loss, shares = self.loss_share(tokens), []
                    for _, tb in self.micro_batches(data, with_targets=True):
                        stats = self.engine.forward_backward(tb, loss)
                        share = float(tb.response_mask.sum()) / tokens
                        shares.append(stats["value_loss"] * share)
                    self.engine.optimizer_step()
                    self.losses.append(sum(shares))
                fresh = batch.indexes[[not seen for seen in learnt]]
                if len(fresh):
                    self.store.put({TRAINED: np.ones(len(fresh), np.uint8)}, indexes=fresh)
                batch.ack()
            return True

    def loss_share(self, tokens: int) -> ValueLossFn:
        """The value loss of a micro-batch, as its share of the mean over ``tokens`` tokens."""

        def loss(values: torch.Tensor, tb: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = tb.response_mask
            value, stats = value_loss(
                values, tb.extras["old_values"], tb.extras["returns"], mask, self.clip
            )
            return value * float(mask.sum()) / tokens, stats

        return loss

    def micro_batches(
        self, data: Mapping[str, Sequence[Any]], with_targets: bool = False
    ) -> list[tuple[list[int], TrainBatch]]:
        """The rows of ``data`` in padded micro-batches within the token budget."""
        prompts, responses = data["prompt_ids"], data["response_ids"]
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        out = []
        for part in split_micro_batches(lengths, self.budget, packed=False):
            per_token = None
            loss_mask = None
            if with_targets:
                per_token = {
                    "old_values": [data["values"][i] for i in part],
                    "returns": [data["returns"][i] for i in part],
                }
                if "loss_mask" in data:
                    loss_mask = [data["loss_mask"][i] for i in part]
            tb = to_train_batch(
                [prompts[i] for i in part],
                [responses[i] for i in part],
                self.pad_id,
                per_token=per_token,
                loss_mask=loss_mask,
            )
            out.append((part, tb))
        return out
