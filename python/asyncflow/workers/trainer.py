"""Trainer: streams the samples of step ``s`` (partition ``step-s``) in whole-group micro-batches
as soon as their advantages are ready, accumulates gradients on each as it arrives, steps the
optimiser once the step's groups are in, and publishes the new weights as version ``s + 1``.
With ``trainer.streaming: false`` it first waits for the whole step, as synchronous frameworks do.

The loss is normalised by a constant (the step's rows times ``rollout.max_tokens`` for token
aggregation, its rows for sequence aggregation), so a micro-batch's gradient does not depend on
which other micro-batches share its step and can be applied while later ones are still being
generated.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncflow import weights
from asyncflow.algorithms.losses import LossSettings, policy_loss
from asyncflow.engines.base import TrainBatch, TrainEngine
from asyncflow.errors import StoreTimeoutError
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.workers.base import Context, Worker, step_partition
from asyncflow.workers.batches import to_train_batch

#: Runs in the trainer's thread after each step (evaluation, checkpoints); returns extra metrics.
StepHook = Callable[[int], dict[str, Any]]


class Ledger:
    """Which groups each optimiser step trained (or dropped): the record that resume keeps
    exactly-once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, step: int, trained: list[int], dropped: list[int]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "trained": trained, "dropped": dropped}) + "\n")

    def truncate(self, before_step: int) -> None:
        """Forgets steps from ``before_step`` on (they are redone after a resume)."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if json.loads(line)["step"] < before_step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))


class Trainer(Worker):
    role = "trainer"

    def __init__(
        self,
        ctx: Context,
        engine: TrainEngine,
        metrics: MetricsLog,
        ledger: Ledger,
        after_step: StepHook | None = None,
    ) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.metrics = metrics
        self.ledger = ledger
        self.after_step = after_step
        t, a = self.config.trainer, self.config.algorithm
        self.loss_settings = LossSettings(
            clip_eps=t.clip_eps,
            correction=t.correction,
            is_cap=t.is_cap,
            kl_coef=t.kl_coef,
            aggregation=a.loss_aggregation,
        )
        self.fields = ["prompt_ids", "response_ids", "behaviour_logprobs", "advantage", "reward"]
        if a.reference:
            self.fields.append("ref_logprobs")
        self.rows_per_step = t.groups_per_step * self.config.rollout.n
        self._last_step_end = ctx.tracer.now()
        self._last_tokens = 0

    def _micro_batch_rows(self) -> int:
        """Rows per micro-batch: whole groups fitting the token budget (at least one group)."""
        n = self.config.rollout.n
        longest = 2 * self.config.data.digits + 2 + self.config.rollout.max_tokens
        groups = max(1, self.config.trainer.micro_batch_tokens // (longest * n))
        return groups * n

    def _loss(self, logp: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        extras = batch.extras
        loss, stats = policy_loss(
            logp,
            extras["behaviour_logp"],
            extras["advantage"],
            batch.response_mask,
            self.loss_settings,
            prox_logp=extras.get("prox_logp", logp.detach()),
            ref_logp=extras.get("ref_logp"),
        )
        if self.loss_settings.aggregation == "token":
            share = float(batch.response_mask.sum()) / (
                self.rows_per_step * self.config.rollout.max_tokens
            )
        else:
            share = batch.input_ids.shape[0] / self.rows_per_step
        return loss * share, stats

    def _train_batch(self, data: dict[str, list[Any]]) -> TrainBatch:
        per_token = {"behaviour_logp": data["behaviour_logprobs"]}
        if "ref_logprobs" in data:
            per_token["ref_logp"] = data["ref_logprobs"]
        return to_train_batch(
            data["prompt_ids"],
            data["response_ids"],
            self.ctx.tokenizer.pad_id,
            per_token=per_token,
            per_row={"advantage": np.array([float(a) for a in data["advantage"]])},
        )

    def step(self) -> bool:
        s = self.engine.version
        if s >= self.config.trainer.max_steps:
            return False
        outcome = self._train_step(s)
        if outcome is None:
            return False  # stopped mid-step
        self._finish_step(s, *outcome)
        return True

    def _whole_step_ready(self, s: int) -> bool:
        """Whether every sample of step ``s`` is ready for training (the barrier of
        ``trainer.streaming: false``): claims the whole step at once, then hands it straight back
        to the micro-batch claims that follow."""
        try:
            with self.waiting("whole step"):
                whole = self.store.claim(
                    "train",
                    self.fields,
                    self.rows_per_step,
                    timeout=self.config.run.poll_interval,
                    partition=step_partition(s),
                    whole_groups=True,
                )
        except StoreTimeoutError:
            self.note_progress(False, f"all samples of step {s}")
            return False
        whole.release()
        return True

    def _train_step(self, s: int) -> tuple[list[TrainBatch], dict[str, Any]] | None:
        k = self.config.trainer.max_staleness
        if not self.config.trainer.streaming:
            while not self._whole_step_ready(s):
                if self.ctx.stop.is_set():
                    return None
        got, trained, dropped = 0, [], []
        ages: Counter[int] = Counter()
        rewards: list[float] = []
        stats: list[dict[str, float]] = []
        kept_batches: list[TrainBatch] = []
        while got < self.rows_per_step:
            if self.ctx.stop.is_set():
                return None
            want = min(self._micro_batch_rows(), self.rows_per_step - got)
            batch = self.claim(
                "train", self.fields, want, partition=step_partition(s), whole_groups=True
            )
            if len(batch) == 0:
                continue
            age = s - batch.versions.astype(np.int64)
            stale = age > k
            if stale.any():  # only under the "drop" policy can samples arrive too old
                batch.ack(batch.indexes[stale])
                dropped += sorted({int(g) for g in batch.groups[stale]})
                got += int(stale.sum())
            keep = np.flatnonzero(~stale)
            if keep.size:
                data = {name: [values[i] for i in keep] for name, values in batch.read().items()}
                tb = self._train_batch(data)
                with self.busy("forward/backward"):
                    if self.config.trainer.ppo_epochs > 1:
                        tb.extras["prox_logp"] = self.engine.logprobs(tb)
                    stats.append(self.engine.forward_backward(tb, self._loss))
                kept_batches.append(tb)
                batch.ack(batch.indexes[keep])
                got += int(keep.size)
                ages.update(int(a) for a in age[keep])
                rewards += [float(r) for r in data["reward"]]
                trained += sorted({int(g) for g in batch.groups[keep]})
        summary = {
            "trained_groups": trained,
            "dropped_groups": dropped,
            "staleness": {str(a): c for a, c in sorted(ages.items())},
            "rewards": rewards,
            "loss_stats": stats,
        }
        return kept_batches, summary

    def _finish_step(self, s: int, batches: list[TrainBatch], summary: dict[str, Any]) -> None:
        with self.busy("optimizer step"):
            opt = self.engine.optimizer_step()
            for _ in range(self.config.trainer.ppo_epochs - 1):
                for tb in batches:
                    self.engine.forward_backward(tb, self._loss)
                opt = self.engine.optimizer_step()
        self.engine.version = s + 1
        with self.busy(f"publish v{s + 1}"):
            weights.publish(self.store, s + 1, self.engine.export_weights())
        self.ledger.write(s, summary["trained_groups"], summary["dropped_groups"])
        state = self.ctx.state
        with state.lock:
            state.trained_steps = s + 1
            state.dropped_samples += len(summary["dropped_groups"]) * self.config.rollout.n
            for age, count in summary["staleness"].items():
                state.staleness[int(age)] += count
            tokens = state.generated_tokens
        now = self.ctx.tracer.now()
        rewards = summary["rewards"] or [0.0]
        record: dict[str, Any] = {
            "step": s + 1,
            "time": round(now, 3),
            "reward_mean": float(np.mean(rewards)),
            "accuracy": float(np.mean(np.array(rewards) >= 1.0)),
            "staleness": summary["staleness"],
            "dropped_groups": len(summary["dropped_groups"]),
            "tokens_per_s": (tokens - self._last_tokens) / max(now - self._last_step_end, 1e-9),
            "busy": self.ctx.tracer.busy_fraction(self._last_step_end, now),
            **opt,
            **_mean_stats(summary["loss_stats"]),
        }
        self._last_step_end, self._last_tokens = now, tokens
        if self.after_step is not None:
            record |= self.after_step(s + 1)
        self.metrics.log(record)


def _mean_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for s in stats for k in s}
    return {k: float(np.mean([s[k] for s in stats if k in s])) for k in sorted(keys)}
