"""Advantages: whole groups of rewarded responses -> advantages (GRPO, RLOO, or REINFORCE++).

Groups the trainer must leave out get a NaN advantage: a group with a row no reward source could
score, and with ``algorithm.filter_groups`` a group whose rewards are all equal (no signal).
Overlong responses (cut at ``rollout.max_tokens``) are either left out of the loss (advantage 0:
no policy gradient) or have their reward lowered before the advantages (soft penalty).
"""

from __future__ import annotations

import numpy as np

from asyncflow.algorithms.advantages import (
    batch_normalised,
    failed_groups,
    group_advantages,
    informative_groups,
    overlong_penalty,
)
from asyncflow.workers.base import Context, Worker


class AdvantageWorker(Worker):
    role = "advantage"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        a = self.config.algorithm
        self.fields = ["reward"]
        if a.overlong != "none":
            self.fields.append("response_ids")
        self.kl_in_reward = a.advantage == "reinforce++" and self.config.trainer.kl_coef > 0
        if self.kl_in_reward:
            self.fields += ["behaviour_logprobs", "ref_logprobs"]

    def step(self) -> bool:
        n = self.config.rollout.n
        batch = self.claim("advantage", self.fields, n * 32, whole_groups=True)
        if len(batch) == 0:
            return True
        with self.busy("advantages"):
            data = batch.read()
            rewards = np.array([float(r) for r in data["reward"]])
            adv, filtered = self.advantages(rewards, batch.groups, data)
            if filtered:
                self.ctx.state.add(filtered_groups=filtered)
            if self.config.algorithm.filter_groups:
                # Before the advantages are put: the trainer that claims these rows then knows
                # its step is waiting for their replacements.
                self.ask_for_replacements(batch.indexes, batch.groups, adv)
            self.store.put({"advantage": adv}, indexes=batch.indexes)
        batch.ack()
        return True

    def ask_for_replacements(
        self, indexes: np.ndarray, groups: np.ndarray, adv: np.ndarray
    ) -> None:
        """Asks the feeder for a new prompt group for each group left out (NaN advantages), up
        to ``algorithm.max_extra_groups`` per step."""
        a = self.config.algorithm
        cap = a.max_extra_groups
        left_out = ~np.isfinite(adv)
        if cap == 0 or not left_out.any():
            return
        partitions = self.store.rows(indexes[left_out]).partitions
        by_step: dict[int, set[int]] = {}
        for partition, group in zip(partitions, groups[left_out].tolist(), strict=True):
            by_step.setdefault(int(partition.rsplit("-", 1)[1]), set()).add(int(group))
        state = self.ctx.state
        with state.lock:
            for step, left in by_step.items():
                state.extra_groups[step] += max(0, min(len(left), cap - state.extra_groups[step]))

    def advantages(
        self, rewards: np.ndarray, groups: np.ndarray, data: dict[str, list[object]]
    ) -> tuple[np.ndarray, int]:
        """Advantages of a claim's rows (NaN: leave the group out), and the groups filtered."""
        a, max_tokens = self.config.algorithm, self.config.rollout.max_tokens
        drop = failed_groups(rewards, groups)
        # Signal is judged on the sources' rewards, before length penalties and KL.
        flat = ~drop & ~informative_groups(np.nan_to_num(rewards), groups)
        truncated = np.zeros(rewards.shape, bool)
        if a.overlong != "none":
            eos = self.ctx.tokenizer.eos_id
            responses = [np.asarray(r) for r in data["response_ids"]]
            lengths = np.array([len(r) for r in responses])
            ended = np.array([len(r) > 0 and int(r[-1]) == eos for r in responses])
            truncated = (lengths >= max_tokens) & ~ended
            if a.overlong == "penalty":
                rewards = rewards + overlong_penalty(
                    lengths, max_tokens, a.overlong_buffer, a.overlong_penalty
                )
        if self.kl_in_reward:
            kl = np.array(
                [
                    float(np.sum(np.asarray(b, np.float64) - np.asarray(r, np.float64)))
                    for b, r in zip(data["behaviour_logprobs"], data["ref_logprobs"], strict=True)
                ]
            )
            rewards = rewards - self.config.trainer.kl_coef * kl
        filtered = 0
        if a.filter_groups:
            filtered = len(np.unique(groups[flat]))
            drop |= flat
        adv = np.full(rewards.shape, np.nan, np.float32)
        keep = ~drop
        if keep.any():
            if a.advantage == "reinforce++":
                adv[keep] = batch_normalised(rewards[keep])
            else:
                adv[keep] = group_advantages(
                    rewards[keep], groups[keep], a.advantage, a.normalize_std
                )
        if a.overlong == "filter":
            adv[keep & truncated] = 0.0
        return adv, filtered
