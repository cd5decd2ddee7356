"""Policy weights travel through the store: version ``v`` is one row of the pinned partition
``__weights__``, with one field per parameter (``weights/<name>``) and a manifest of the names.
Rollout engines on the same host read the tensors as zero-copy views of store memory, and load
the newest version between generation batches."""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Iterable

import numpy as np
import torch

from asyncflow.errors import StoreError, UnknownIndexError
from asyncflow.store import Store

PARTITION = "__weights__"
PREFIX = "weights/"
MANIFEST = PREFIX + "__manifest__"
#: Older versions are deleted once this many newer ones exist (readers may still be loading).
KEEP_VERSIONS = 2


def publish(store: Store, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Puts ``weights`` as version ``version`` and deletes versions older than the last few."""
    fields: dict[str, object] = {}
    for name, tensor in weights:
        fields[PREFIX + name] = tensor.detach().cpu().contiguous().unsqueeze(0)
    names = "\n".join(f.removeprefix(PREFIX) for f in fields)
    fields[MANIFEST] = [names.encode()]
    store.put(fields, partition=PARTITION, version=version)
    rows = store.rows(partition=PARTITION)
    keep = sorted(int(v) for v in rows.versions)[-KEEP_VERSIONS:]
    stale = [int(i) for i, v in zip(rows.indexes, rows.versions, strict=True) if int(v) not in keep]
    if stale:
        store.delete(stale)


def published(store: Store) -> dict[int, int]:
    """The row of each published version. A row is listed as soon as its put is admitted, which
    on a store spread over several daemons is before its cells are in: a version is published
    once its manifest is ready."""
    while True:
        rows = store.rows(partition=PARTITION)
        if not len(rows):
            return {}
        try:
            ready = store.ready_fields(rows.indexes)
        except UnknownIndexError:
            continue  # a publisher deleted an old version after the listing: list again
        break
    return {
        int(v): int(i)
        for i, v, fields in zip(rows.indexes, rows.versions, ready, strict=True)
        if MANIFEST in fields
    }


def latest_version(store: Store) -> int | None:
    """The newest published version, or None before the first publication."""
    return max(published(store), default=None)


class Watcher:
    """The newest published version, as every worker of a process sees it. Workers waiting for
    new weights share one poller thread, which reads the store every ``interval`` seconds while
    anyone waits and wakes them only when the version changes."""

    def __init__(self, store: Store, interval: float) -> None:
        self.store = store
        self.interval = interval
        lock = threading.Lock()
        self._changed = threading.Condition(lock)
        self._wanted = threading.Condition(lock)
        self._newest: int | None = None
        self._read_at = -math.inf
        self._waiters = 0
        self._poller: threading.Thread | None = None

    def _read(self) -> int | None:
        newest = latest_version(self.store)
        with self._changed:
            if newest != self._newest:
                self._newest = newest
                self._changed.notify_all()
            self._read_at = time.monotonic()
        return newest

    def latest(self) -> int | None:
        """The newest version, read from the store at most ``interval`` seconds ago."""
        with self._changed:
            if time.monotonic() - self._read_at < self.interval:
                return self._newest
        return self._read()

    def wait_for(self, version: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for ``version`` (or a newer one) to be published;
        returns whether it has been."""
        with self._changed:
            self._waiters += 1
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, name="weights", daemon=True)
                self._poller.start()
            self._wanted.notify()
            try:
                return self._changed.wait_for(
                    lambda: self._newest is not None and self._newest >= version, timeout
                )
            finally:
                self._waiters -= 1

    def _poll(self) -> None:
        while True:
            with self._wanted:
                self._wanted.wait_for(lambda: self._waiters > 0)
            try:
                self._read()
            except StoreError:
                return  # the store is gone: the run is over
            time.sleep(self.interval)


def fetch(store: Store, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """``(version, [(name, tensor)])`` of ``version`` (default: the newest). The tensors view
    store memory (no copy) and must not be written to."""
    versions = published(store)
    if not versions:
        raise LookupError("no policy weights have been published yet")
    wanted = max(versions) if version is None else version
    if wanted not in versions:
        raise LookupError(f"weights version {wanted} is not in the store (have {sorted(versions)})")
    index = versions[wanted]
    manifest = store.read([index], MANIFEST)[MANIFEST][0]
    names = manifest.decode().split("\n")
    cells = store.read([index], [PREFIX + n for n in names])
    return wanted, [(n, _as_tensor(cells[PREFIX + n][0])) for n in names]


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # The views are read-only on purpose: engines copy them into their own parameters.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        if array.dtype == np.uint16:  # the store's bfloat16
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
