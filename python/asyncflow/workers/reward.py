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
from typing import Any

from asyncflow.config import ConfigError
from asyncflow.tasks.base import Problem
from asyncflow.workers.base import Context, Worker
from asyncflow.workers.reward_sources import (
    Failure,
    FnSource,
    RewardRow,
    RewardSet,
    build_sources,
)

log = logging.getLogger(__name__)

RewardFn = Callable[..., float]


def pack_answer(problem: Problem, with_extra: bool) -> bytes:
    if not with_extra:
        return problem.answer.encode()
    return json.dumps({"ground_truth": problem.answer, "extra_info": dict(problem.extra)}).encode()


def unpack_answer(packed: bytes, with_extra: bool) -> tuple[str, dict[str, Any]]:
    if not with_extra:
        return packed.decode(), {}
    record = json.loads(packed)
    return str(record["ground_truth"]), dict(record["extra_info"])


def exact_match(response: str, truth: str, extra_info: Mapping[str, Any] | None = None) -> float:
    return 1.0 if response.strip() == truth.strip() else 0.0


def numeric_match(response: str, truth: str, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the response's last number equals the ground truth's number."""
    words = [
        w for w in response.replace(",", " ").split() if w.lstrip("-").replace(".", "", 1).isdigit()
    ]
    try:
        return 1.0 if words and float(words[-1]) == float(truth.strip()) else 0.0
    except ValueError:
        return 0.0


#: GSM8K's final-answer line, as its reference solutions and the usual scorers write it.
FINAL_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")


def gsm8k_match(response: str, truth: str, extra_info: Mapping[str, Any] | None = None) -> float:
    """1 if the number after the response's last ``####`` equals the ground truth (commas
    ignored); a response without that line scores 0, as in the strict GSM8K scorers."""
    found = FINAL_ANSWER.findall(response)
    if not found:
        return 0.0
    try:
        return 1.0 if float(found[-1].replace(",", "")) == float(truth.replace(",", "")) else 0.0
    except ValueError:
        return 0.0


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


class RewardWorker(Worker):
    """Scores claimed responses with the configured sources (:mod:`reward_sources`). A row no
    source could score is reported, naming it and the source, and gets a NaN reward: the
    advantage worker then leaves its whole group out of training."""

    role = "reward"

    def __init__(self, ctx: Context, fn: RewardFn | None, sources: RewardSet | None = None) -> None:
        super().__init__(ctx)
        self.fn = fn
        extra = bool(self.config.data.extra_keys)
        self.sources = sources or build_sources(self.config.reward, fn, extra)
        self.fields = ["response_ids", "answer"]
        if any(not isinstance(s, FnSource) for s in self.sources.sources):
            self.fields.append("prompt_ids")  # models and judges read the prompt too
        #: Every failure so far, for the run's report.
        self.failures: list[Failure] = []

    def step(self) -> bool:
        batch = self.claim("reward", self.fields, 256)
        if len(batch) == 0:
            return True
        with self.busy("verify"):
            data = batch.read()
            decode = self.ctx.tokenizer.decode
            extra = bool(self.config.data.extra_keys)
            rows = []
            for i, (ids, packed) in enumerate(
                zip(data["response_ids"], data["answer"], strict=True)
            ):
                truth, info = unpack_answer(packed, extra)
                prompt = decode(data["prompt_ids"][i].tolist()) if "prompt_ids" in data else ""
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
            rewards, failures = self.sources.score(rows)
            for failure in failures:
                log.warning("%s; its group is left out of training", failure)
            if failures:
                self.failures += failures
                self.ctx.state.add(reward_failures=len(failures))
            self.store.put({"reward": rewards}, indexes=batch.indexes)
        batch.ack()
        return True
