"""Where the job's process reads policy versions from (``weights.transport``): the store
(:class:`asyncflow.weights.Watcher`), or this process's end of the weight-sync group
(:class:`ReceivedWeights`). The rollout workers, the evaluator and the final-weights read all go
through one :class:`WeightSource`, so none of them knows which transport runs."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from asyncflow.engines.base import RolloutEngine
from asyncflow.engines.errors import WeightLoadError

if TYPE_CHECKING:
    from asyncflow.weight_sync.broadcast import BroadcastReceiver


class WeightsNotHereError(LookupError):
    """The version asked for is not (or no longer) in the weight source, and no newer one is.
    That says nothing against the version's publication: it may arrive, or arrive again (a
    resumed run republishes on the same daemon), so a load that raises this is tried again
    later rather than the version given up."""


class WeightSource(ABC):
    """The policy versions this process can read."""

    #: Whether the version before the newest can still be loaded (the store keeps it).
    keeps_previous = False

    @abstractmethod
    def latest(self) -> int | None:
        """The newest version (None before the first)."""

    @abstractmethod
    def wait_for(self, version: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds (less once the run stops) for ``version`` or a newer
        one; returns whether it is here."""

    @abstractmethod
    def wake(self) -> None:
        """Makes waiters look again at once (the run has stopped: they return)."""

    @abstractmethod
    def load(self, engine: RolloutEngine, version: int) -> int:
        """Loads ``version`` (or, where the transport keeps only the newest, a newer one) into
        ``engine`` in place; returns the version loaded. Raises :class:`WeightsNotHereError` if
        neither it nor a newer one is here, LookupError if a part of it is missing."""

    @abstractmethod
    def fetch(self, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """``(version, [(name, tensor)])`` of ``version`` (default: the newest), to read only.
        Raises LookupError if it is not here."""


def load_into(
    engine: RolloutEngine, version: int, weights: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """``engine.load_weights``, a refusal naming ``version`` (see ``WeightLoadError.version``)."""
    try:
        engine.load_weights(version, weights)
    except WeightLoadError as e:
        if e.version is None:
            e.version = version
        raise


class ReceivedWeights(WeightSource):
    """The versions a :class:`~asyncflow.weight_sync.broadcast.BroadcastReceiver` of this
    process holds (only the newest). A receiver whose group broke raises its
    :class:`~asyncflow.weight_sync.WeightSyncError` from :meth:`latest` and :meth:`wait_for`,
    so the worker asking fails the run with it."""

    def __init__(
        self,
        receiver: BroadcastReceiver,
        interval: float = 0.1,
        stop: threading.Event | None = None,
    ) -> None:
        """``stop``: once set, waiters return within about ``interval`` as if their time were
        up."""
        self.receiver = receiver
        self.interval = interval
        self.stop = stop

    def latest(self) -> int | None:
        return self.receiver.latest()

    def wait_for(self, version: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if self.receiver.wait_for(version, max(0.0, min(left, self.interval))):
                return True
            if left <= 0 or (self.stop is not None and self.stop.is_set()):
                return False

    def wake(self) -> None:
        pass  # its waiters look at the stop every ``interval``

    def load(self, engine: RolloutEngine, version: int) -> int:
        newest = self.latest()
        if newest is None or newest < version:
            raise WeightsNotHereError(f"weights v{version} has not been received (have v{newest})")
        return self.receiver.load(engine)  # the newest, no older than ``version``

    def fetch(self, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        return self.receiver.fetch(version)
