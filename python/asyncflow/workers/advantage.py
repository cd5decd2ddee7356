"""Advantages: whole groups of rewarded responses -> advantages (GRPO, RLOO, REINFORCE++, or
GAE from the critic's per-token ``values``: PPO with a critic).

Groups the trainer must leave out get a NaN advantage: a group with a row no reward source could
score, and with ``algorithm.filter_groups`` a group whose rewards are all equal (no signal).
Overlong responses (cut at ``rollout.max_tokens``; in agent mode, trajectories that used up
``agent.max_tokens`` or whose last turn was cut) are either left out of the loss (advantage 0:
no policy gradient) or have their reward lowered before the advantages (soft penalty).

With GAE the worker also reads each sample's ``values`` (written by the critic worker) and writes
per-token ``token_advantages`` (whitened over the claim) and ``returns`` (the critic's targets,
NaN for rows left out); ``advantage`` then holds each row's mean token advantage, or NaN.
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
from asyncflow.algorithms.value import gae, token_rewards, whiten
from asyncflow.config import KL_IN_REWARD
from asyncflow.workers.base import Context, Worker


class AdvantageWorker(Worker):
    role = "advantage"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        a = self.config.algorithm
        self.fields = ["reward"]
        if a.overlong != "none":
            self.fields.append("response_ids")
            if self.config.agent.enabled:
                self.fields.append("agent_truncated")
        self.kl_in_reward = a.advantage in KL_IN_REWARD and self.config.trainer.kl_coef > 0
        if self.kl_in_reward:
            self.fields += ["behaviour_logprobs", "ref_logprobs"]
        if a.advantage == "gae":
            self.fields += [f for f in ("response_ids", "values") if f not in self.fields]
        #: Multi-turn rows: which response tokens the model wrote (the others are the
        #: environment's: no KL and no GAE step).
        self.masked = self.config.agent.enabled and (a.advantage == "gae" or self.kl_in_reward)
        if self.masked:
            self.fields.append("loss_mask")

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
            if self.config.algorithm.advantage == "gae":
                out = self.token_advantages(self.shaped_rewards, adv, data)
            else:
                out = {"advantage": adv}
            self.store.put(out, indexes=batch.indexes, ack=batch)
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
            state.progressed.notify_all()

    def token_advantages(
        self, rewards: np.ndarray, adv: np.ndarray, data: dict[str, list[object]]
    ) -> dict[str, object]:
        """GAE: per-token advantages (whitened over the claim's kept rows) and returns, from the
        critic's values and the rewards (``adv`` says which rows are kept: finite; and which
        are left out of the loss: 0)."""
        a, kl_coef = self.config.algorithm, self.config.trainer.kl_coef
        values = [np.asarray(v, np.float64) for v in data["values"]]
        masks = self.loss_masks(data, len(values))
        keep = np.flatnonzero(np.isfinite(adv))
        raw, returns = [], [np.full(v.size, np.nan, np.float32) for v in values]
        for i in keep.tolist():
            kl = None
            if self.kl_in_reward:
                behaviour = np.asarray(data["behaviour_logprobs"][i], np.float64)
                kl = behaviour - np.asarray(data["ref_logprobs"][i], np.float64)
            r = token_rewards(float(rewards[i]), values[i].size, kl, kl_coef, masks[i])
            advantages, returns[i] = gae(r, values[i], a.gamma, a.lam, masks[i])
            raw.append(advantages)
        token_adv = [np.zeros(v.size, np.float32) for v in values]
        # Whitened over the rows in the loss: one left out of it (overlong filtered: advantage
        # 0, no gradient from its tokens) moves no other row's advantages.
        learnt = [k for k, i in enumerate(keep.tolist()) if adv[i] != 0]
        white = whiten([raw[k] for k in learnt], [masks[keep[k]] for k in learnt])
        for k, w in zip(learnt, white, strict=True):
            token_adv[keep[k]] = w
        mean = np.full(adv.shape, np.nan, np.float32)
        mean[keep] = [float(token_adv[i].mean()) if token_adv[i].size else 0.0 for i in keep]
        return {
            "advantage": mean,
            "token_advantages": token_adv,
            "returns": [np.asarray(r, np.float32) for r in returns],
        }

    def loss_masks(self, data: dict[str, list[object]], rows: int) -> list[np.ndarray | None]:
        """Each of the ``rows`` rows' loss mask (multi-turn rows), or None for every row (all
        tokens written by the model)."""
        if not self.masked:
            return [None] * rows
        return [np.asarray(m).astype(bool) for m in data["loss_mask"]]

    def truncated(self, data: dict[str, list[object]]) -> tuple[np.ndarray, np.ndarray, int]:
        """Each response's length, whether it was cut short, and the length bound: a response
        cut at ``rollout.max_tokens`` without its end token; a trajectory that a budget cut
        (``agent.max_tokens``, or its last turn's ``rollout.max_tokens``), as its rollout
        recorded in ``agent_truncated``."""
        responses = [np.asarray(r) for r in data["response_ids"]]
        lengths = np.array([len(r) for r in responses])
        if self.config.agent.enabled:
            cut = np.array([bool(c) for c in data["agent_truncated"]], bool)
            return lengths, cut, self.config.agent.max_tokens
        stops = self.ctx.tokenizer.stop_ids
        ended = np.array([len(r) > 0 and int(r[-1]) in stops for r in responses])
        bound = self.config.rollout.max_tokens
        return lengths, (lengths >= bound) & ~ended, bound

    def advantages(
        self, rewards: np.ndarray, groups: np.ndarray, data: dict[str, list[object]]
    ) -> tuple[np.ndarray, int]:
        """Advantages of a claim's rows (NaN: leave the group out), and the groups filtered."""
        a = self.config.algorithm
        drop = failed_groups(rewards, groups)
        # Signal is judged on the sources' rewards, before length penalties and KL.
        flat = ~drop & ~informative_groups(np.nan_to_num(rewards), groups)
        truncated = np.zeros(rewards.shape, bool)
        if a.overlong != "none":
            lengths, truncated, max_tokens = self.truncated(data)
            if a.overlong == "penalty":
                rewards = rewards + overlong_penalty(
                    lengths, max_tokens, a.overlong_buffer, a.overlong_penalty
                )
        #: GAE's rewards: the sources' less length penalties (the KL goes on each token).
        self.shaped_rewards = rewards
        if self.kl_in_reward and a.advantage != "gae":
            rows = zip(
                data["behaviour_logprobs"],
                data["ref_logprobs"],
                self.loss_masks(data, len(rewards)),
                strict=True,
            )
            kl = np.array(
                [
                    float(
                        np.sum(
                            np.asarray(b, np.float64) - np.asarray(r, np.float64),
                            where=True if m is None else m,
                        )
                    )
                    for b, r, m in rows
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
            if a.advantage == "gae":
                adv[keep] = 1.0  # kept; the per-token advantages come from the critic's values
            elif a.advantage == "reinforce++":
                adv[keep] = batch_normalised(rewards[keep])
            else:
                adv[keep] = group_advantages(
                    rewards[keep], groups[keep], a.advantage, a.normalize_std
                )
        if a.overlong == "filter":
            adv[keep & truncated] = 0.0
        return adv, filtered
