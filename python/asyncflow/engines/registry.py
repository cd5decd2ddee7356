"""Engines by name. Built-ins register themselves lazily; users add theirs either with
:func:`register_rollout_engine` / :func:`register_train_engine` or through the entry point groups
``asyncflow.rollout_engines`` / ``asyncflow.train_engines`` — no change to this package needed.

A factory is called as ``factory(model_dir, config)`` and returns the engine; a train engine that
runs as data-parallel ranks in processes of their own (``trainer.dp_size > 1``, or a weight
transport that sends from the trainer's process) is called as ``factory(model_dir, config,
rendezvous)`` in each rank's process, with where the ranks meet.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.config import Config, resolve_engine_name
from asyncflow.engines.base import RolloutEngine, TrainEngine
from asyncflow.errors import ConfigError

RolloutFactory = Callable[[Path, Config], RolloutEngine]
TrainFactory = Callable[[Path, Config], TrainEngine]

_ROLLOUT: dict[str, RolloutFactory | str] = {
    "hf": "asyncflow.engines.hf:HFRolloutEngine",
    "vllm": "asyncflow.engines.vllm:VLLMRolloutEngine",
}
_TRAIN: dict[str, TrainFactory | str] = {
    "hf": "asyncflow.engines.hf:HFTrainEngine",
    "deepspeed": "asyncflow.engines.deepspeed:DeepSpeedTrainEngine",
    "fsdp": "asyncflow.engines.fsdp:FSDPTrainEngine",
}
_GROUPS = {"rollout": "asyncflow.rollout_engines", "train": "asyncflow.train_engines"}


def register_rollout_engine(name: str, factory: RolloutFactory) -> None:
    _ROLLOUT[name] = factory


def register_train_engine(name: str, factory: TrainFactory) -> None:
    _TRAIN[name] = factory


def _lookup(kind: str, table: dict[str, Any], name: str) -> Callable[[Path, Config], Any]:
    entry = table.get(name)
    if entry is None:
        for ep in importlib.metadata.entry_points(group=_GROUPS[kind]):
            if ep.name == name:
                entry = ep.load()
                table[name] = entry
    if entry is None:
        known = ", ".join(_known(kind, table))
        raise ConfigError(f"unknown {kind} engine {name!r}; known: {known}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        table[name] = entry
    return entry  # type: ignore[no-any-return]


def _known(kind: str, table: dict[str, Any]) -> list[str]:
    return sorted(table) + [ep.name for ep in importlib.metadata.entry_points(group=_GROUPS[kind])]


def check_engine_names(config: Config) -> None:
    """Refuses an engine name that nothing here provides, before the run starts: it failed only
    when the engines were made, after the warm start. Under Ray the engines are made on other
    nodes, which may have engines of their own installed: not checked."""
    if config.launcher != "local":
        return
    for kind, table, key, name in (
        ("rollout", _ROLLOUT, "rollout.engine", config.rollout.engine),
        ("train", _TRAIN, "trainer.engine", config.trainer.engine),
    ):
        known = _known(kind, table)
        if resolve_engine_name(kind, name) not in known:
            raise ConfigError(f"{key}: unknown {kind} engine {name!r}; known: {', '.join(known)}")


def create_rollout_engine(name: str, model_dir: Path, config: Config) -> RolloutEngine:
    engine = _lookup("rollout", _ROLLOUT, resolve_engine_name("rollout", name))(model_dir, config)
    if not isinstance(engine, RolloutEngine):
        raise ConfigError(f"rollout engine {name!r} did not return a RolloutEngine")
    return engine


def create_train_engine(
    name: str, model_dir: Path, config: Config, rendezvous: Any = None
) -> TrainEngine:
    """The train engine ``name``; with ``rendezvous``, one data-parallel rank of it."""
    factory = _lookup("train", _TRAIN, resolve_engine_name("train", name))
    args = (model_dir, config) if rendezvous is None else (model_dir, config, rendezvous)
    engine = factory(*args)
    if not isinstance(engine, TrainEngine):
        raise ConfigError(f"train engine {name!r} did not return a TrainEngine")
    return engine
