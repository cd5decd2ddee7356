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
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from asyncflow.config import ConfigError
from asyncflow.tasks.base import Problem
from asyncflow.workers.base import Context, Worker

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
    role = "reward"

    def __init__(self, ctx: Context, fn: RewardFn) -> None:
        super().__init__(ctx)
        self.fn = fn

    def step(self) -> bool:
        batch = self.claim("reward", ["response_ids", "answer"], 256)
        if len(batch) == 0:
            return True
        with self.busy("verify"):
            data = batch.read()
            decode = self.ctx.tokenizer.decode
            extra = bool(self.config.data.extra_keys)
            rewards = []
            for ids, packed in zip(data["response_ids"], data["answer"], strict=True):
                truth, info = unpack_answer(packed, extra)
                text = decode(ids.tolist())
                score = self.fn(text, truth, extra_info=info) if extra else self.fn(text, truth)
                rewards.append(float(score))
            self.store.put({"reward": np.array(rewards, np.float32)}, indexes=batch.indexes)
        batch.ack()
        return True
