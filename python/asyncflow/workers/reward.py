"""Reward: responses -> scalar rewards, by a rule-based verifier. Verifiers are plain Python
callables ``(response_text, ground_truth) -> float``, registered by name or given as
``module:function``. With ``data.extra_keys`` they are called with the keyword ``extra_info``
too: those columns of the prompt's row, by dotted path.

A prompt row's ``answer`` field carries what the verifier needs: the ground truth as text, or
with extra keys a JSON object of the ground truth and the extra columns.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from asyncflow.batch import Batch
from asyncflow.config import Config
from asyncflow.errors import ConfigError
from asyncflow.tasks.base import Problem
from asyncflow.workers.base import Context, Worker
from asyncflow.workers.reward_sources import (
    Failure,
    FnSource,
    ModelSource,
    RewardRow,
    RewardSet,
    build_sources,
)

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]


def pack_answer(problem: Problem, with_extra: bool, with_prompt: bool = False) -> bytes:
    """A prompt row's ``answer``: the ground truth as text, or a JSON record of it with the
    extra info and (``with_prompt``: agent runs, whose environments are reset with the problem
    as the dataset gave it, not as the chat template framed it) the prompt's text."""
    if not (with_extra or with_prompt):
        return problem.answer.encode()
    record: dict[str, Any] = {"ground_truth": problem.answer, "extra_info": dict(problem.extra)}
    if with_prompt:
        record["prompt"] = problem.prompt
    return json.dumps(record).encode()


def unpack_answer(
    packed: bytes, with_extra: bool, with_prompt: bool = False
) -> tuple[str, dict[str, Any]]:
    """The ground truth and extra info of a :func:`pack_answer` made with the same flags (or,
    for an agent run's row restored from a checkpoint older than its prompt record, the plain
    answer it holds)."""
    record = _record(packed) if with_extra or with_prompt else None
    if record is None:
        return packed.decode(), {}
    return str(record["ground_truth"]), dict(record["extra_info"]) if with_extra else {}


def packed_prompt(packed: bytes) -> str | None:
    """The prompt's text of a :func:`pack_answer` made ``with_prompt`` (None for a row from an
    older checkpoint, which has none)."""
    record = _record(packed)
    return None if record is None or "prompt" not in record else str(record["prompt"])


def _record(packed: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(packed)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "ground_truth" in record else None


def exact_match(response: str, truth: str, extra_info: Mapping[str, Any] | None = None) -> float:
    return 1.0 if response.strip() == truth.strip() else 0.0


#: A number in text, with thousands separators or not: ``-1,234.5``. Commas count only between
#: groups of three digits: ``2,3`` is two numbers, not 23.
NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?")
#: GSM8K's final-answer line, as its reference solutions and the usual scorers write it.
FINAL_ANSWER = re.compile(rf"####\s*({NUMBER.pattern})")


def _last_is(found: list[str], truth: str) -> float:
    """1 if the last of the numbers ``found`` equals the ground truth's (thousands separators
    ignored in both: ``1,234`` is 1234); 0 when none was found or the truth is no number."""
    if not found:
        return 0.0
    try:
        return 1.0 if float(found[-1].replace(",", "")) == float(truth.replace(",", "")) else 0.0
    except ValueError:
        return 0.0


def numeric_match(response: str, truth: str, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the response's last number equals the ground truth's number."""
    return _last_is(NUMBER.findall(response), truth)


def gsm8k_match(response: str, truth: str, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the number after the response's last ``####`` equals the ground truth (commas
    ignored); a response without that line scores 0, as in the strict GSM8K scorers."""
    return _last_is(FINAL_ANSWER.findall(response), truth)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "gsm8k": gsm8k_match,
}


def register_reward(name: str, fn: RewardFn) -> None:
    REWARDS[name] = fn


def takes_extra_info(fn: RewardFn) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: assume it does
        return True
    return any(
        p.name == "extra_info" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )


def resolve_reward(spec: str, extra_keys: bool = False) -> RewardFn:
    """The reward function named by ``spec``; with ``extra_keys`` it must take ``extra_info``."""
    fn = _resolve(spec)
    if extra_keys and not takes_extra_info(fn):
        raise ConfigError(
            f"reward.fn {spec!r} takes no extra_info argument, but data.extra_keys are set"
        )
    return fn


def _resolve(spec: str) -> RewardFn:
    if spec in REWARDS:
        return REWARDS[spec]
    module, sep, attr = spec.partition(":")
    if not sep:
        raise ConfigError(f"unknown reward {spec!r}; known: {sorted(REWARDS)} or module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward.fn {spec!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ConfigError(f"reward.fn {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def separate_reward_model(config: Config) -> bool:
    """Whether the reward model runs as a worker of its own (the local launcher; elsewhere it
    runs inside the reward worker)."""
    return config.launcher == "local" and "model" in (config.reward.sources or [config.reward.type])


class RewardModelWorker(Worker):
    """The reward model as its own task in the dataflow: claims responses, scores them in
    batches on the model's own device, and writes ``model_score`` (NaN where it could not), which
    the reward worker weighs in with the other sources."""

    role = "reward_model"

    def __init__(self, ctx: Context, source: ModelSource | None = None) -> None:
        super().__init__(ctx)
        self.source = source or ModelSource(self.config.reward.model)
        self.failures: list[Failure] = []

    def step(self) -> bool:
        batch = self.claim("reward_model", ["prompt_ids", "response_ids", "answer"], 256)
        if len(batch) == 0:
            return True
        with self.busy("score"), self.holding(batch):
            rows = claimed_rows(batch, self.ctx, self.config)
            scores = self.source.score(rows)
            values = np.full(len(rows), np.nan, np.float32)
            for i, score in enumerate(scores):
                if isinstance(score, Failure):
                    log.warning("%s; its group is left out of training", score)
                    self.failures.append(score)
                else:
                    values[i] = score
            failed = len(rows) - int(np.isfinite(values).sum())
            if failed:
                self.ctx.state.add(reward_failures=failed)
            self.store.put({"model_score": values}, indexes=batch.indexes, ack=batch)
        return True


def claimed_rows(batch: Batch, ctx: Context, config: Config) -> list[RewardRow]:
    """The claimed rows as reward sources read them: texts decoded, ground truths unpacked."""
    data = batch.read()
    decode = ctx.tokenizer.decode
    extra = bool(config.data.extra_keys)
    rows = []
    for i, (ids, packed) in enumerate(zip(data["response_ids"], data["answer"], strict=True)):
        truth, info = unpack_answer(packed, extra, config.agent.enabled)
        prompt = ctx.tokenizer.text(data["prompt_ids"][i].tolist()) if "prompt_ids" in data else ""
        rows.append(
            RewardRow(
                int(batch.indexes[i]),
                int(batch.groups[i]),
                prompt,
                decode(ids.tolist()),
                truth,
                info,
            )
        )
    return rows


class RewardWorker(Worker):
    """Scores claimed responses with the configured sources (:mod:`reward_sources`). A row no
    source could score is reported, naming it and the source, and gets a NaN reward: the
    advantage worker then leaves its whole group out of training."""

    role = "reward"

    def __init__(
        self,
        ctx: Context,
        fn: RewardFn | None,
        sources: RewardSet | None = None,
        model_worker: bool = False,
    ) -> None:
        """With ``model_worker`` the reward model's scores come from a
        :class:`RewardModelWorker` (field ``model_score``) rather than from a source here."""
        super().__init__(ctx)
        self.fn = fn
        extra = bool(self.config.data.extra_keys)
        r = self.config.reward
        kinds = r.sources or [r.type]
        weights = r.weights or [1.0] * len(kinds)
        #: The reward model's weight when its scores come from its own worker.
        self.model_weight: float | None = None
        if sources is None and model_worker:
            self.model_weight = weights[kinds.index("model")]
            others = [(k, w) for k, w in zip(kinds, weights, strict=True) if k != "model"]
            sources = (
                build_sources(
                    replace(r, sources=[k for k, _ in others], weights=[w for _, w in others]),
                    fn,
                    extra,
                )
                if others
                else RewardSet([])
            )
        self.sources = sources or build_sources(r, fn, extra)
        self.fields = ["response_ids", "answer"]
        if any(not isinstance(s, FnSource) for s in self.sources.sources):
            self.fields.append("prompt_ids")  # models and judges read the prompt too
        if self.model_weight is not None:
            self.fields.append("model_score")
        #: Every failure so far, for the run's report.
        self.failures: list[Failure] = []

    def step(self) -> bool:
        if self.config.agent.enabled:
            return self._pass_on_agent_rewards()
        batch = self.claim("reward", self.fields, 256)
        if len(batch) == 0:
            return True
        with self.busy("verify"), self.holding(batch):
            rows = claimed_rows(batch, self.ctx, self.config)
            rewards, failures = self.sources.score(rows)
            if self.model_weight is not None:  # NaN where the model worker failed (reported)
                scores = np.array([float(v) for v in batch.read()["model_score"]], np.float32)
                rewards = rewards + np.float32(self.model_weight) * scores
            for failure in failures:
                log.warning("%s; its group is left out of training", failure)
            if failures:
                self.failures += failures
                self.ctx.state.add(reward_failures=len(failures))
            self.store.put({"reward": rewards}, indexes=batch.indexes, ack=batch)
        return True

    def _pass_on_agent_rewards(self) -> bool:
        """Agent runs: the agent loop scored each trajectory already (``agent.reward``: the
        verifier on its last model turn, the environment's rewards, or both), as it alone knows
        where the answer ends and tool output begins. A NaN one it failed to score (counted in
        the trajectory's errors): its group is left out of training."""
        batch = self.claim("reward", ["agent_reward"], 256)
        if len(batch) == 0:
            return True
        rewards = np.array([float(r) for r in batch.read()["agent_reward"]], np.float32)
        if failed := int(np.isnan(rewards).sum()):
            log.warning("%d trajectories could not be scored; their groups are left out", failed)
            self.ctx.state.add(reward_failures=failed)
        self.store.put({"reward": rewards}, indexes=batch.indexes, ack=batch)
        return True
