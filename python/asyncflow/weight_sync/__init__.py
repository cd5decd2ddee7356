"""Pluggable weight synchronisation: how each new policy version goes from the trainer into the
rollout engines (``weights.transport``).

A :class:`Publisher` runs where the trainer's rank 0 is and sends each version once; a
:class:`Receiver` runs in every process that holds rollout engines, says which version it can
load, and loads it into an engine in place (through the engine's ``load_weights``; no restart).
A receiver never hands an engine part of a version: a transfer that fails leaves the engine on
the version it had. See docs/weights.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

from asyncflow.engines.base import RolloutEngine

TRANSPORTS = ("store", "broadcast", "ipc")


class WeightSyncError(RuntimeError):
    """A version could not be sent or received; the message names the peer and the version."""


class Publisher(ABC):
    """The sending end, on the trainer's rank 0."""

    @abstractmethod
    def publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Sends ``weights`` as ``version``; returns once every receiver can load it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Frees the transport's resources."""


class Receiver(ABC):
    """The receiving end, one per process holding rollout engines."""

    @abstractmethod
    def latest(self) -> int | None:
        """The newest version this process can load now (None before the first)."""

    @abstractmethod
    def load(self, engine: RolloutEngine, version: int | None = None) -> int:
        """Loads ``version`` (default: the newest) into ``engine`` in place; returns it."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Frees the transport's resources."""
