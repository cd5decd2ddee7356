"""Policy weights travel through the store: version ``v`` is one row of the pinned partition
``__weights__``, with one field per parameter, ``weights/<dtype>/<name>``, holding it flat, and a
manifest of the fields and the parameters' shapes: a store field keeps its dtype and cell shape
for the daemon's life, and a later run on the same daemon may train another model. Rollout
engines on the same host read the tensors as zero-copy views of store memory, and load the newest
version between generation batches."""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncflow.engines.errors import WeightLoadError
from asyncflow.errors import ConfigError, StoreError, UnknownIndexError
from asyncflow.store import Store
from asyncflow.weight_sync.source import WeightsNotHereError, WeightSource, load_into
from asyncflow.weight_sync.versions import put_version

if TYPE_CHECKING:
    from asyncflow.engines.base import RolloutEngine

PARTITION = "__weights__"
PREFIX = "weights/"
MANIFEST = PREFIX + "__manifest__"
#: Versions kept, the newest included (readers may still be loading the one before it).
KEEP_VERSIONS = 2
#: Seconds a watcher's poller waits in the store for a publication before reading again.
WAKE_WAIT = 1.0


#: Bytes of weights in one store put, and in one read: well under a daemon's ``--max-frame`` (1 GiB
#: by default), which a put or a reply over TCP may not exceed. A larger tensor goes in parts.
PIECE_BYTES = 256 << 20


def publish(store: Store, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Puts ``weights`` as version ``version``, the store's newest from then on; of the older
    versions, the newest ``KEEP_VERSIONS - 1`` are kept (see :func:`put_version`). The version is
    one row, put in pieces of at most ``PIECE_BYTES``, its manifest last: it is published once the
    manifest is ready. A store whose memory limit cannot hold ``KEEP_VERSIONS`` versions of this
    size is refused before anything is put."""
    pieces: list[dict[str, object]] = [{}]
    piece_bytes = 0
    #: (field less the prefix, shape, parts, bytes)
    manifest: list[tuple[str, list[int], int, int]] = []
    for name, tensor in weights:
        flat = tensor.detach().cpu().contiguous().view(-1)
        field = f"{str(tensor.dtype).removeprefix('torch.')}/{name}"
        per = max(1, PIECE_BYTES // flat.element_size())
        parts = [flat[at : at + per] for at in range(0, max(flat.numel(), 1), per)]
        for k, part in enumerate(parts):
            size = part.numel() * part.element_size()
            if piece_bytes and piece_bytes + size > PIECE_BYTES:
                pieces.append({})
                piece_bytes = 0
            pieces[-1][_part(field, k)] = part.view(1, part.numel())
            piece_bytes += size
        manifest.append((field, list(tensor.shape), len(parts), flat.numel() * flat.element_size()))
    _check_room(store, sum(m[3] for m in manifest))
    pieces[-1][MANIFEST] = [json.dumps(manifest).encode()]
    put_version(store, PARTITION, pieces[0], version, KEEP_VERSIONS, pieces[1:])


def _part(field: str, k: int) -> str:
    """The store field of part ``k`` of a tensor's field (the first part is the field itself)."""
    return PREFIX + (field if k == 0 else f"part{k}/{field}")


def _check_room(store: Store, nbytes: int) -> None:
    """Refuses weights the store cannot keep ``KEEP_VERSIONS`` versions of: its put would wait for
    memory that never frees, and fail only after the put's timeout."""
    limit = store.stats().get("memory_limit")
    if limit and KEEP_VERSIONS * nbytes > limit:
        raise ConfigError(
            f"store.memory_limit: the store holds {KEEP_VERSIONS} versions of the policy weights "
            f"at a time ({KEEP_VERSIONS} x {nbytes / 2**20:.0f} MiB) besides the samples, more "
            f"than its limit of {limit / 2**20:.0f} MiB: raise store.memory_limit (or the "
            f"daemon's --memory-limit)"
        )


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


class Watcher(WeightSource):
    """The newest published version, as every worker of a process sees it (the weight source of
    ``weights.transport: store``). Workers waiting for new weights share one poller thread, which
    reads the newest version, then waits in the store for the next publication (a claim of its
    manifest by a task of this watcher's own), and wakes them only when the version changes.
    While the poller watches (from a wait until ``10 * wake_wait`` seconds after the last wait
    or :meth:`latest`), :meth:`latest` answers from what it read; otherwise it reads the store,
    at most every ``interval`` seconds."""

    keeps_previous = KEEP_VERSIONS > 1

    def __init__(
        self,
        store: Store,
        interval: float,
        stop: threading.Event | None = None,
        wake_wait: float = WAKE_WAIT,
    ) -> None:
        """``stop``: once it is set, waiters return as if their time were up: at :meth:`wake`,
        or within about ``wake_wait`` seconds."""
        self.store = store
        self.interval = interval
        self.stop = stop
        self.wake_wait = wake_wait
        #: The poller's task: a claim (acked at once) of the manifest of a version newer than
        #: the newest it read wakes it; registered when the poller first waits, scoped to the
        #: weights partition (which acks never free), so it keeps no other row.
        self._task = f"{PARTITION}watcher-{uuid.uuid4().hex[:16]}"
        self._registered = False
        lock = threading.Lock()
        self._changed = threading.Condition(lock)
        self._wanted = threading.Condition(lock)
        self._newest: int | None = None
        self._read_at = -math.inf
        self._waiters = 0
        self._poller: threading.Thread | None = None
        #: Whether the poller is between a read and the wake-up that will read again: then
        #: ``_newest`` is the newest version but for a publication of the last moment.
        self._watching = False
        #: When a waiter or :meth:`latest` last asked (monotonic seconds): the poller watches
        #: until ``10 * wake_wait`` seconds after it.
        self._asked_at = -math.inf
        #: One store read at a time: callers that queued behind it use what it read.
        self._reading = threading.Lock()
        #: ``(row, version)`` of the publications seen whole (their manifest ready): a row's
        #: readiness is asked for once, so a poll is a single listing of the partition.
        self._whole: set[tuple[int, int]] = set()

    def _newest_published(self) -> int | None:
        """:func:`latest_version`, asking for the readiness of rows not seen whole before only."""
        while True:
            rows = self.store.rows(partition=PARTITION)
            listed = set(zip(rows.indexes.tolist(), rows.versions.tolist(), strict=True))
            unknown = [pair for pair in listed if pair not in self._whole]
            if unknown:
                try:
                    ready = self.store.ready_fields([i for i, _ in unknown])
                except UnknownIndexError:
                    continue  # a publisher deleted an old version after the listing: list again
                self._whole.update(p for p, f in zip(unknown, ready, strict=True) if MANIFEST in f)
            self._whole &= listed
            return max((v for _, v in self._whole), default=None)

    def _read(self, fresh_since: float | None = None) -> int | None:
        """Reads the newest version from the store, unless a read that began after
        ``fresh_since`` (a monotonic time) has completed meanwhile."""
        with self._reading:
            if fresh_since is not None and self._read_at >= fresh_since:
                return self._newest
            started = time.monotonic()
            newest = self._newest_published()
            with self._changed:
                if newest != self._newest:
                    self._newest = newest
                    self._changed.notify_all()
                self._read_at = started
        return newest

    def latest(self) -> int | None:
        """The newest version: as the poller last read it while it watches, otherwise read
        from the store at most ``interval`` seconds ago."""
        now = time.monotonic()
        with self._changed:
            self._asked_at = now
            if self._watching or now - self._read_at < self.interval:
                return self._newest
        return self._read(fresh_since=now - self.interval)

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def wait_for(self, version: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds (or until ``stop`` is set) for ``version`` (or a
        newer one) to be published; returns whether it has been."""

        def published() -> bool:
            return self._newest is not None and self._newest >= version

        with self._changed:
            self._waiters += 1
            self._asked_at = time.monotonic()
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, name="weights", daemon=True)
                self._poller.start()
            self._wanted.notify()
            try:
                self._changed.wait_for(lambda: published() or self._stopped(), timeout)
                return published()
            finally:
                self._waiters -= 1

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _poll(self) -> None:
        while True:
            with self._wanted:
                self._wanted.wait_for(lambda: self._waiters > 0)
            try:
                self._watch()
            except StoreError:
                # A failed read (the store gone, a daemon restarting): read again after
                # ``interval`` while anyone waits, the task registered again (a daemon that
                # kept no journal has forgotten it), so that a store that comes back is watched.
                with self._changed:
                    self._registered = False
                time.sleep(self.interval)
                continue
            if self._stopped():
                with self._changed:
                    self._changed.notify_all()
                time.sleep(self.interval)

    def _watch(self) -> None:
        """Reads, then waits for the next publication, while anyone asked lately and the run
        goes on."""
        try:
            while True:
                self._read()
                with self._changed:
                    linger = time.monotonic() - self._asked_at < 10 * self.wake_wait
                    self._watching = not self._stopped() and (self._waiters > 0 or linger)
                    if not self._watching:
                        return
                self._await_publication()
        finally:
            with self._changed:
                self._watching = False

    def _await_publication(self) -> None:
        """Returns once the manifest of a version newer than the newest read is ready (at once
        if one became ready during that read), or after ``wake_wait`` seconds. Only a wake-up:
        the listing that follows says what is newest."""
        if not self._registered:
            self.store.register_task(self._task, partitions=[PARTITION])
            self._registered = True
        batch = self.store.claim(
            self._task,
            [MANIFEST],
            1,
            timeout=self.wake_wait,
            partition=PARTITION,
            min_version=0 if self._newest is None else self._newest + 1,
            allow_partial=True,
        )
        if len(batch):
            batch.ack()

    def load(self, engine: RolloutEngine, version: int) -> int:
        """Loads ``version`` into ``engine``, or the newest if newer ones have replaced it in the
        store meanwhile (it keeps the last few); returns the version loaded."""
        asked = version
        while True:
            try:
                got, tensors = fetch(self.store, version)
                break
            except LookupError as e:  # (a row deleted under the read, too)
                newest = latest_version(self.store)
                if newest is not None and newest > version:
                    version = newest  # replaced again while read: read the newest again
                elif isinstance(e, (WeightsNotHereError, UnknownIndexError)):
                    # Gone with nothing newer, or not yet here: nothing against the version.
                    raise WeightsNotHereError(f"weights v{version} is not in the store: {e}") from e
                elif version == asked:
                    raise
                else:  # the failure is the newer version's, not the one asked for
                    raise WeightLoadError(f"weights v{version}: {e}", version) from e
        load_into(engine, got, tensors)
        return got

    def fetch(self, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """:func:`fetch` from this watcher's store."""
        return fetch(self.store, version)


def fetch(store: Store, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """``(version, [(name, tensor)])`` of ``version`` (default: the newest). The tensors view
    store memory (no copy; a tensor put in parts is joined in a copy) and must not be written
    to. Fields are read a few at a time, at most ``PIECE_BYTES`` a read."""
    versions = published(store)
    if not versions:
        raise WeightsNotHereError("no policy weights have been published yet")
    wanted = max(versions) if version is None else version
    if wanted not in versions:
        # Not published yet (or gone, with none newer), or replaced by newer ones.
        gone = WeightsNotHereError if wanted > max(versions) else LookupError
        raise gone(f"weights version {wanted} is not in the store (have {sorted(versions)})")
    index = versions[wanted]
    manifest = store.read([index], MANIFEST)[MANIFEST][0]
    listed = json.loads(manifest)
    cells: dict[str, Any] = {}
    batch: list[str] = []
    batch_bytes = 0
    for field, _, parts, nbytes in listed:
        for k in range(parts):
            if batch and batch_bytes + nbytes / parts > PIECE_BYTES:
                cells |= store.read([index], batch)
                batch, batch_bytes = [], 0
            batch.append(_part(field, k))
            batch_bytes += nbytes / parts
    cells |= store.read([index], batch)
    tensors = []
    for field, shape, parts, _ in listed:
        pieces = [cells[_part(field, k)][0] for k in range(parts)]
        # Shaped by numpy, not torch: each torch call lets go of the GIL, and in a process of
        # busy threads (a rollout worker's) taking it back costs a wait for every tensor.
        whole = pieces[0] if parts == 1 else np.concatenate(pieces)
        tensors.append((field.split("/", 1)[1], _as_tensor(whole.reshape(shape))))
    return wanted, tensors


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # The views are read-only on purpose: engines copy them into their own parameters.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        if array.dtype == np.uint16:  # the store's bfloat16
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
