"""Trainer: streams the samples of step ``s`` (partition ``step-s``) in whole-group claims as soon
as their advantages are ready, cuts each claim into micro-batches within the token budget by the
samples' real token counts, accumulates gradients on each as it arrives, steps the optimiser once
the step's groups are in, and publishes the new weights as version ``s + 1``.
Each micro-batch's loss is its fixed share of the step's (see :mod:`asyncflow.workers.steps`), so
it can be applied while later ones are still being generated.
With ``trainer.streaming: false`` it first waits for the whole step, as synchronous frameworks do.

With a :class:`~asyncflow.engines.base.StepTrainEngine` (data-parallel ranks in processes of
their own) the ranks claim and train the step themselves; the trainer then only records it.

Colocated (``rollout.sleep_while_training``), the rollout engines sleep through each step: once
the step's samples are all in, until its version is published (see
:mod:`asyncflow.workers.colocation`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from asyncflow import weights
from asyncflow.engines.base import StepResult, StepTrainEngine, TrainBatch, TrainEngine
from asyncflow.errors import StoreTimeoutError
from asyncflow.telemetry.metrics import MetricsLog, rewrite
from asyncflow.workers.base import Context, Worker, step_partition
from asyncflow.workers.steps import (
    StepLoss,
    figure_sums,
    kept_rows,
    sample_fields,
    sample_lengths,
    update,
)

#: Runs in the trainer's thread after each step (evaluation); returns extra metrics.
StepHook = Callable[[int], dict[str, Any]]
#: Runs in the trainer's thread once a step's record is logged (checkpoints).
LoggedHook = Callable[[int], None]


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
        rewrite(self.path, kept)


class Trainer(Worker):
    role = "trainer"

    def __init__(
        self,
        ctx: Context,
        engine: TrainEngine,
        metrics: MetricsLog,
        ledger: Ledger,
        after_step: StepHook | None = None,
        after_logged: LoggedHook | None = None,
    ) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.metrics = metrics
        self.ledger = ledger
        self.after_step = after_step
        #: After the record: a checkpoint taken before it, and a kill between the two, would
        #: resume past a step whose record was never written.
        self.after_logged = after_logged
        model_config = getattr(engine, "model_config", None)  # (tests run without an engine)
        self.loss = StepLoss(self.config, ctx.tokenizer.pad_id, model_config)
        self.loss.check_sharing(engine)
        self.fields = sample_fields(self.config)
        self.rows_per_step = self.loss.rows_per_step
        self._last_step_end = ctx.tracer.now()
        self._last_tokens = ctx.state.generated_tokens  # a resumed run's count goes on
        #: Tokens a sample is expected to take in a micro-batch, for claim sizes: at first the
        #: longest a sample can be (a guess without a prompt limit); packed, then the mean of
        #: the samples seen (padded, a micro-batch's rows all take its longest's length).
        prompt = ctx.prompts.max_length or self.config.rollout.max_tokens
        self._sample_tokens = float(prompt + self.config.rollout.max_tokens)

    def _claim_rows(self) -> int:
        """Rows to claim at once: whole groups that would fill about one micro-batch (at least
        one group). Only the claim's size rests on this estimate: the micro-batches are cut
        from the claimed samples' real lengths."""
        n = self.config.rollout.n
        per_group = max(1.0, self._sample_tokens * n)
        groups = max(1, int(self.config.trainer.micro_batch_tokens // per_group))
        return groups * n

    def step(self) -> bool:
        s = self.engine.version
        if s >= self.config.trainer.max_steps:
            return False
        sleep = self.ctx.engine_sleep
        if sleep is not None and not self._whole_step_ready(s):
            return True  # the engines generate on; asked again unless the run stops
        with contextlib.nullcontext() if sleep is None else sleep.training(self.busy):
            if isinstance(self.engine, StepTrainEngine):
                result = self._ranks_train(self.engine, s)
            else:
                result = self._train_here(s)
        if result is None:
            return False  # stopped mid-step
        self.engine.version = s + 1
        self._record(s, result)
        return True

    def _ranks_train(self, engine: StepTrainEngine, s: int) -> StepResult | None:
        """Step ``s`` as the ranks train it. On this worker's timeline the ranks' wait for the
        step's samples is a wait, and only the rest of the step (training, publishing) busy."""
        tracer = self.ctx.tracer
        start = tracer.now()
        result = engine.train_step(s, self.ctx.stop)
        end = tracer.now()
        ready = end if result is None else min(end, start + result.wait_seconds)
        tracer.record(self.role, "wait", f"step {s} samples", start, ready)
        tracer.record(self.role, "busy", f"ranks train step {s}", ready, end)
        return result

    def _train_here(self, s: int) -> StepResult | None:
        outcome = self._accumulate(s)
        if outcome is None:
            return None
        batches, result = outcome
        with self.busy("optimizer step"):
            result.optimizer = update(
                self.engine, batches, self.loss, self.config.trainer.ppo_epochs
            )
        started = time.perf_counter()
        with self.busy(f"publish v{s + 1}"):
            weights.publish(self.store, s + 1, self.engine.export_weights())
        result.publish_seconds = time.perf_counter() - started
        return result

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

    def _accumulate(self, s: int) -> tuple[list[TrainBatch], StepResult] | None:
        k = self.config.trainer.max_staleness
        if not self.config.trainer.streaming:
            while not self._whole_step_ready(s):
                if self.ctx.stop.is_set():
                    return None
        got = 0
        result = StepResult()
        kept_batches: list[TrainBatch] = []
        while got < (goal := self._rows_wanted(s)):
            if self.ctx.stop.is_set():
                return None
            want = min(self._claim_rows(), goal - got)
            batch = self.claim(
                "train", self.fields, want, partition=step_partition(s), whole_groups=True
            )
            if len(batch) == 0:
                continue
            # Too old (only under the "drop" policy), left out by the advantage worker, or a
            # second copy of a group this step had (see kept_rows).
            had = result.trained_groups + result.dropped_groups
            age, stale, again, data = kept_rows(batch, s, k, had)
            left_out = stale | again
            if some_left_out := bool(left_out.any()):
                batch.ack(batch.indexes[left_out])  # (which frees them: read before)
            if data["reward"]:
                with self.holding(batch):
                    kept_batches += self._train_on(data, result)
                batch.ack(batch.indexes[~left_out] if some_left_out else None)
            first = ~again
            result.note(
                batch.groups[first], age[first], stale[first], data["reward"], figure_sums(data)
            )
            got += int(first.sum())
        return kept_batches, result

    def _rows_wanted(self, s: int) -> int:
        """The step's rows: its groups, and those generated in place of groups left out."""
        with self.ctx.state.lock:
            extra = self.ctx.state.extra_groups[s]
        return self.rows_per_step + extra * self.config.rollout.n

    def _train_on(self, data: dict[str, list[Any]], result: StepResult) -> list[TrainBatch]:
        """Accumulates the gradients of claimed samples, micro-batch by micro-batch."""
        lengths = sample_lengths(data)
        if self.loss.packed:
            self._sample_tokens = float(np.mean(lengths))
        parts = self.loss.parts(data)
        batches = self.loss.micro_batches(data, parts, self.config.algorithm.reference)
        for part, tb in zip(parts, batches, strict=True):
            with self.busy("forward/backward"):
                if self.config.trainer.ppo_epochs > 1:
                    tb.extras["prox_logp"] = self.engine.logprobs(tb)
                result.loss_stats.append(self.engine.forward_backward(tb, self.loss))
            result.count_batch(tb, [lengths[i] for i in part])
        return batches

    def _record(self, s: int, result: StepResult) -> None:
        self.ledger.write(s, result.trained_groups, result.dropped_groups)
        state = self.ctx.state
        with state.lock:
            state.trained_steps = s + 1
            state.progressed.notify_all()
            state.dropped_samples += len(result.dropped_groups) * self.config.rollout.n
            state.staleness.update(result.staleness)
            tokens = state.generated_tokens
        now = self.ctx.tracer.now()
        rewards = result.rewards or [0.0]
        record: dict[str, Any] = {
            "step": s + 1,
            "time": round(now, 3),
            "reward_mean": float(np.mean(rewards)),
            "accuracy": float(np.mean(np.array(rewards) >= 1.0)),
            "staleness": {str(a): c for a, c in sorted(result.staleness.items())},
            "dropped_groups": len(result.dropped_groups),
            # Of the samples generated so far, those whose tokens span several policy versions.
            "multi_version_share": state.multi_version_share(),
            "version_spans": state.version_span_histogram(),
            "tokens_per_s": (tokens - self._last_tokens) / max(now - self._last_step_end, 1e-9),
            "busy": self.ctx.tracer.busy_fraction(self._last_step_end, now),
            **result.optimizer,
            **result.padding(),
            **result.sample_means(),
            **(
                {}
                if result.publish_seconds is None
                else {"publish_seconds": result.publish_seconds}
            ),
            **_mean_stats(result.loss_stats),
        }
        self._last_step_end, self._last_tokens = now, tokens
        if self.after_step is not None:
            record |= self.after_step(s + 1)
        self.metrics.log(record)
        if self.after_logged is not None:
            self.after_logged(s + 1)


def _mean_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for s in stats for k in s}
    return {k: float(np.mean([s[k] for s in stats if k in s])) for k in sorted(keys)}
