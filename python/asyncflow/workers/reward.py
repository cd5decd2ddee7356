"""Reward: responses -> scalar rewards, by a rule-based verifier. Verifiers are plain Python
callables ``(response_text, ground_truth) -> float``, registered by name or given as
``module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np

from asyncflow.config import ConfigError
from asyncflow.workers.base import Context, Worker

RewardFn = Callable[[str, str], float]


def exact_match(response: str, truth: str) -> float:
    return 1.0 if response.strip() == truth.strip() else 0.0


def numeric_match(response: str, truth: str) -> float:
    """1 if the response's last number equals the ground truth's number."""
    words = [
        w for w in response.replace(",", " ").split() if w.lstrip("-").replace(".", "", 1).isdigit()
    ]
    try:
        return 1.0 if words and float(words[-1]) == float(truth.strip()) else 0.0
    except ValueError:
        return 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "numeric_match": numeric_match}


def register_reward(name: str, fn: RewardFn) -> None:
    REWARDS[name] = fn


def resolve_reward(spec: str) -> RewardFn:
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
            rewards = [
                float(self.fn(decode(ids.tolist()), answer.decode()))
                for ids, answer in zip(data["response_ids"], data["answer"], strict=True)
            ]
            self.store.put({"reward": np.array(rewards, np.float32)}, indexes=batch.indexes)
        batch.ack()
        return True
