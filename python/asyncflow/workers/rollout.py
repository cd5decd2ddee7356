"""Rollout: prompt groups -> n responses each, with per-token behaviour log-probs and the policy
version used. New weights are loaded between generation batches (deferred update), never mid-batch.

Staleness: the samples of training step ``S`` must come from policy version ``>= S - k``. Under
``wait`` the worker waits for such weights before generating; under ``drop`` it generates with
what it has and the trainer discards samples that turn out too stale.
"""

from __future__ import annotations

import numpy as np

from asyncflow import weights
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.workers.base import Context, Worker, step_partition


class Rollout(Worker):
    role = "rollout"

    def __init__(self, ctx: Context, engine: RolloutEngine, name: str = "rollout") -> None:
        super().__init__(ctx)
        self.engine = engine
        self.role = name
        r = self.config.rollout
        self.sampling = Sampling(n=r.n, temperature=r.temperature, max_tokens=r.max_tokens)

    def sync_weights(self) -> None:
        """Loads the newest published weights if they are newer than the engine's."""
        newest = self.ctx.weights.latest()
        if newest is not None and newest > self.engine.version:
            with self.busy(f"load weights v{newest}"):
                version, tensors = weights.fetch(self.store, newest)
                self.engine.load_weights(version, tensors)

    def step(self) -> bool:
        self.sync_weights()
        with self.waiting("engine room"):
            if not self.engine.wait_for_room(self.config.run.poll_interval):
                return True
        batch = self.claim(
            "rollout", ["prompt_ids", "answer", "target_step"], self.config.rollout.groups_per_call
        )
        if len(batch) == 0:
            return True
        data = batch.read()
        targets = np.array([int(t) for t in data["target_step"]])
        target = int(targets.min())
        later = targets > target
        if later.any():  # one target step per call, oldest first
            batch.release(batch.indexes[later])
        keep = ~later
        if self.config.trainer.staleness_policy == "wait":
            oldest_allowed = target - self.config.trainer.max_staleness
            if self.engine.version < oldest_allowed:
                batch.release(batch.indexes[keep])
                with self.waiting(f"weights v{oldest_allowed}"):
                    self.ctx.weights.wait_for(oldest_allowed, self.config.run.poll_interval)
                self.note_progress(False, f"policy weights version {oldest_allowed}")
                return True
        prompts = [data["prompt_ids"][i] for i in np.flatnonzero(keep)]
        answers = [data["answer"][i] for i in np.flatnonzero(keep)]
        groups = batch.groups[keep]
        # Read before generating: an engine shared by several workers may load newer weights while
        # this call is in flight, and a sample is as old as the oldest policy that wrote it.
        version = self.engine.version
        with self.busy(f"generate v{version}"):
            outputs = self.engine.generate([p.tolist() for p in prompts], self.sampling)
        with self.ctx.state.snapshot_lock:
            self._put_samples(target, version, prompts, answers, groups, outputs)
            batch.ack(batch.indexes[keep])
        return True

    def _put_samples(
        self,
        target: int,
        version: int,
        prompts: list[np.ndarray],
        answers: list[bytes],
        groups: np.ndarray,
        outputs: list[list[Completion]],
    ) -> None:
        n = self.sampling.n
        rows_prompt, rows_resp, rows_lp, rows_ans, rows_group = [], [], [], [], []
        tokens = 0
        for prompt, answer, group, completions in zip(
            prompts, answers, groups, outputs, strict=True
        ):
            for c in completions:
                rows_prompt.append(prompt)
                rows_resp.append(np.array(c.token_ids, np.int64))
                rows_lp.append(np.array(c.logprobs, np.float32))
                rows_ans.append(answer)
                rows_group.append(int(group))
                tokens += len(c.token_ids)
        with self.busy("put samples"):
            self.store.put(
                {
                    "prompt_ids": rows_prompt,
                    "response_ids": rows_resp,
                    "behaviour_logprobs": rows_lp,
                    "answer": rows_ans,
                },
                partition=step_partition(target),
                groups=np.array(rows_group),
                group_size=n,
                version=version,
            )
        self.ctx.state.add(generated_tokens=tokens, generated_samples=len(rows_resp))
