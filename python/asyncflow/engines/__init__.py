"""Engines behind two small interfaces: :class:`RolloutEngine` generates, :class:`TrainEngine`
trains. The workflow only ever talks to these, so any engine registered by name plugs in."""

from asyncflow.config import resolve_engine_name
from asyncflow.engines.base import (
    Completion,
    RolloutEngine,
    Sampling,
    TrainBatch,
    TrainEngine,
)
from asyncflow.engines.registry import (
    create_rollout_engine,
    create_train_engine,
    register_rollout_engine,
    register_train_engine,
)

__all__ = [
    "Completion",
    "RolloutEngine",
    "Sampling",
    "TrainBatch",
    "TrainEngine",
    "create_rollout_engine",
    "create_train_engine",
    "register_rollout_engine",
    "register_train_engine",
    "resolve_engine_name",
]
