"""The ``store`` transport: the store carries whole versions (see :mod:`asyncflow.weights`).
Portable (any machine the store reaches), and on one host the engine copies straight from
zero-copy views of store memory."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from asyncflow import weights
from asyncflow.engines.base import RolloutEngine
from asyncflow.store import Store
from asyncflow.weight_sync import Publisher, Receiver


class StorePublisher(Publisher):
    def __init__(self, store: Store) -> None:
        self.store = store

    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights.publish(self.store, version, tensors)


class StoreReceiver(Receiver):
    def __init__(self, store: Store) -> None:
        self.store = store

    def latest(self) -> int | None:
        return weights.latest_version(self.store)

    def load(self, engine: RolloutEngine, version: int | None = None) -> int:
        got, tensors = weights.fetch(self.store, version)
        engine.load_weights(got, tensors)
        return got
