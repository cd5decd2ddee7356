"""One optimiser step of the trainer: the loss of each of its micro-batches, and what it trained.

The loss is normalised by a constant (the step's rows times ``rollout.max_tokens`` for token
aggregation, its rows for sequence aggregation), so a micro-batch's gradient does not depend on
which other micro-batches share its step (or on which data-parallel rank trains it): the step's
gradient is the plain sum over its micro-batches, however many there are and wherever they run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow.algorithms.losses import ALIASES, LossSettings, policy_loss
from asyncflow.batch import Batch
from asyncflow.config import KL_IN_REWARD, Config
from asyncflow.engines.base import TrainBatch, TrainEngine
from asyncflow.workers.batches import (
    pack_rows,
    pack_width,
    pair_cost,
    prompt_units,
    split_micro_batches,
    to_train_batch,
    unit_lengths,
)

#: Fields a training step reads from each sample row.
SAMPLE_FIELDS = ["prompt_ids", "response_ids", "behaviour_logprobs", "advantage", "reward"]
#: An agent trajectory's figures (one number each, put by the agent rollout), read with its
#: sample to be reported as their means over each step's trained trajectories.
AGENT_FIGURES = ["agent_turns", "tool_seconds", "agent_truncated", "agent_errors"]
#: How far a shared-prompt layout's log-probs may be from the same samples' laid out apart, by
#: the model's dtype (rounding only), before :meth:`StepLoss.check_sharing` turns sharing off.
SHARING_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}

log = logging.getLogger(__name__)


def sample_fields(config: Config) -> list[str]:
    extra = ["ref_logprobs"] if config.algorithm.reference else []
    if config.algorithm.advantage == "gae":  # PPO with a critic: an advantage per token
        extra.append("token_advantages")
    if config.agent.enabled:  # multi-turn: only the model's own tokens are trained
        extra += ["loss_mask", *AGENT_FIGURES]
    return [*SAMPLE_FIELDS, *extra]


def kept_rows(
    batch: Batch, step: int, max_staleness: int, had: Sequence[int] = ()
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, list[Any]]]:
    """A claim of whole groups as step ``step`` trains it: each row's age (policy versions
    behind the step); which rows are left out, counted as dropped; which are left out uncounted;
    and the values of the rows kept. A group is dropped whole when a row of it is older than
    ``max_staleness`` (under partial rollout its rows' oldest tokens may come from different
    versions; a part of a group would lose its advantages' balance) or has no advantage (one the
    advantage worker left out: a failed reward, or a group without signal under
    ``algorithm.filter_groups``). A group the step ``had`` already (trained or dropped) is a
    second copy: put again by a rollout that died after putting it and before acking its
    prompts, once the first copy had been trained and freed."""
    age = step - batch.versions.astype(np.int64)
    claimed = batch.read()
    again = np.isin(batch.groups, np.asarray(had, np.int64))
    left_out = ~np.isfinite(np.array([float(a) for a in claimed["advantage"]]))
    stale = ((age > max_staleness) | left_out) & ~again
    stale |= np.isin(batch.groups, batch.groups[stale])
    keep = np.flatnonzero(~(stale | again))
    data = {name: [values[i] for i in keep] for name, values in claimed.items()}
    return age, stale, again, data


def figure_sums(data: Mapping[str, Sequence[Any]]) -> dict[str, float]:
    """The sums of the per-sample figures (``AGENT_FIGURES``) among ``data``'s fields."""
    return {
        name: float(np.sum(data[name], dtype=np.float64)) for name in AGENT_FIGURES if name in data
    }


class StepLoss:
    """Builds a step's micro-batches from sample rows and computes their share of its loss."""

    def __init__(self, config: Config, pad_id: int, model_config: Any = None) -> None:
        """``model_config``: the transformers config of the model trained (its sizes decide
        where sharing prompts pays; without it, prompts are not shared)."""
        t, a = config.trainer, config.algorithm
        self.settings = LossSettings(
            clip_eps=t.clip_eps,
            correction=t.correction,
            is_cap=t.is_cap,
            kl_coef=0.0 if a.advantage in KL_IN_REWARD else t.kl_coef,
            # GSPO's loss is a mean over sequences.
            aggregation="seq-mean-token-mean"
            if a.policy_loss == "gspo"
            else ALIASES.get(a.loss_aggregation, a.loss_aggregation),
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            ratio_level="sequence" if a.policy_loss == "gspo" else "token",
        )
        self.rows_per_step = t.groups_per_step * config.rollout.n
        self.budget = t.micro_batch_tokens
        self.max_tokens = config.rollout.max_tokens
        self.pad_id = pad_id
        self.packed = t.packing
        share = t.packing and t.share_prompts and model_config is not None
        #: Attention's cost per (query, key) pair against a token's; None: prompts not shared.
        self.pair_cost = pair_cost(model_config) if share else None
        self.tolerance = SHARING_TOLERANCE[config.model.dtype]

    def __call__(
        self, logp: torch.Tensor, batch: TrainBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        extras = batch.extras
        loss, stats = policy_loss(
            logp,
            extras["behaviour_logp"],
            extras["advantage"],
            batch.response_mask,
            self.settings,
            prox_logp=extras.get("prox_logp", logp.detach()),
            ref_logp=extras.get("ref_logp"),
            sequence_ids=batch.sequence_ids,
        )
        how = self.settings.aggregation
        if how == "token-mean":
            share = float(batch.response_mask.sum()) / (self.rows_per_step * self.max_tokens)
        elif how == "seq-mean-token-sum":  # sums scaled to the token mean's size
            share = batch.sequences / (self.rows_per_step * self.max_tokens)
        else:
            share = batch.sequences / self.rows_per_step
        return loss * share, stats

    def batch(
        self, data: Mapping[str, Sequence[Any]], width: int | None = None, shared: bool = False
    ) -> TrainBatch:
        """``data``'s samples as one micro-batch; packed, in rows of ``width`` (default: its
        longest sample or unit), consecutive samples with one prompt sharing it if ``shared``."""
        per_token = {"behaviour_logp": data["behaviour_logprobs"]}
        if "ref_logprobs" in data:
            per_token["ref_logp"] = data["ref_logprobs"]
        per_row = {"advantage": np.array([float(a) for a in data["advantage"]])}
        if "token_advantages" in data:
            per_token["advantage"] = data["token_advantages"]
            per_row = {}
        return to_train_batch(
            data["prompt_ids"],
            data["response_ids"],
            self.pad_id,
            per_token=per_token,
            per_row=per_row,
            packed=self.packed,
            width=width,
            loss_mask=data.get("loss_mask"),
            shared=shared,
        )

    def units(self, data: Mapping[str, Sequence[Any]]) -> list[list[int]] | None:
        """The samples of ``data`` by prompt, where training each prompt's samples as one unit
        costs less than training them one by one (counting the tensors' tokens, and their
        rows' attention at ``pair_cost`` a pair) and every unit fits the budget; else None."""
        if self.pair_cost is None:
            return None
        units = prompt_units(data["prompt_ids"])
        if len(units) == len(data["prompt_ids"]):
            return None
        lengths = _lengths(data, units)
        if max(lengths) > self.budget:
            return None
        if self._cost(lengths, dense=True) >= self._cost(sample_lengths(data), dense=False):
            return None
        return units

    def check_sharing(self, engine: TrainEngine) -> float | None:
        """Checks on one small group that ``engine``'s model attends as a shared-prompt unit
        says (a model that ignored the layout's attention mask would let responses see each
        other): the responses' log-probs laid out shared and apart must agree. Turns sharing
        off if they do not. Returns the largest difference (None: sharing is off already)."""
        if self.pair_cost is None:
            return None
        responses = [np.array([5, 6, 7]), np.array([8, 9]), np.array([10, 11, 12, 13])]
        data: dict[str, Sequence[Any]] = {
            "prompt_ids": [np.array([1, 2, 3, 4])] * 3,
            "response_ids": responses,
            "behaviour_logprobs": [np.zeros(len(r), np.float32) for r in responses],
            "advantage": [0.0] * 3,
        }
        shared, apart = self.batch(data, shared=True), self.batch(data)
        ours = engine.logprobs(shared)[shared.response_mask.bool()]
        theirs = engine.logprobs(apart)[apart.response_mask.bool()]
        gap = float((ours - theirs).abs().max())
        if not gap <= self.tolerance:
            log.warning(
                "the model does not attend as shared prompts need (log-probs %.3g apart); "
                "each sample is trained with its own copy of its prompt",
                gap,
            )
            self.pair_cost = None
        return gap

    def _cost(self, lengths: Sequence[int], dense: bool) -> float:
        """The cost of packed rows of these lengths, in tokens through the weights: each row's
        tokens, and the pairs its attention computes (``dense``: all of them, as under a mask
        of any shape; else half, as causal kernels can skip the rest: to err against
        sharing)."""
        assert self.pair_cost is not None
        width = pack_width(lengths)
        pairs = width * (1.0 if dense else 0.5) * self.pair_cost
        return len(pack_rows(lengths, width)) * width * (1 + pairs)

    def parts(self, data: Mapping[str, Sequence[Any]], min_count: int = 1) -> list[list[int]]:
        """The rows of ``data`` in micro-batches within the token budget, by their real token
        counts; at least ``min_count`` (the extra ones empty). A unit of shared prompt
        (:meth:`units`) stays whole, its samples one after another."""
        units = self.units(data)
        if units is None:
            return split_micro_batches(
                sample_lengths(data), self.budget, self.packed, min_count=min_count
            )
        parts = split_micro_batches(_lengths(data, units), self.budget, True, min_count)
        return [[i for u in part for i in units[u]] for part in parts]

    def micro_batches(
        self, data: Mapping[str, Sequence[Any]], parts: list[list[int]], with_reference: bool
    ) -> list[TrainBatch]:
        """One micro-batch per part (an empty part gives an :meth:`empty_batch`); packed, every
        one in rows as wide as :meth:`parts` counted them."""
        units = self.units(data)
        width = pack_width(_lengths(data, units))
        return [
            self.batch({k: [v[i] for i in part] for k, v in data.items()}, width, units is not None)
            if part
            else self.empty_batch(with_reference)
            for part in parts
        ]

    def empty_batch(self, with_reference: bool) -> TrainBatch:
        """A micro-batch that trains nothing (no response token): a data-parallel rank with
        fewer micro-batches than its peers runs these, so every rank joins every collective."""
        data: dict[str, Sequence[Any]] = {
            "prompt_ids": [np.full(2, self.pad_id, np.int64)],
            "response_ids": [np.zeros(0, np.int64)],
            "behaviour_logprobs": [np.zeros(0, np.float32)],
            "advantage": [0.0],
        }
        if with_reference:
            data["ref_logprobs"] = [np.zeros(0, np.float32)]
        return self.batch(data)


def sample_lengths(data: Mapping[str, Sequence[Any]]) -> list[int]:
    return [len(p) + len(r) for p, r in zip(data["prompt_ids"], data["response_ids"], strict=True)]


def _lengths(data: Mapping[str, Sequence[Any]], units: list[list[int]] | None) -> list[int]:
    """The tokens of each sample, or of each unit of shared prompt."""
    if units is None:
        return sample_lengths(data)
    return unit_lengths(data["prompt_ids"], data["response_ids"], units)


def update(
    engine: TrainEngine, batches: Sequence[TrainBatch], loss: StepLoss, epochs: int
) -> dict[str, float]:
    """The optimiser step on the accumulated gradients, then ``epochs - 1`` further passes over
    the step's micro-batches, each ending in an optimiser step; returns the last one's figures."""
    figures = engine.optimizer_step()
    for _ in range(epochs - 1):
        for tb in batches:
            engine.forward_backward(tb, loss)
        figures = engine.optimizer_step()
    return figures
