"""The ``broadcast`` transport: the trainer's rank 0 sends each version over the weight-sync
group (see :mod:`asyncflow.weight_sync.group`) in fixed-size buckets, packing bucket ``i + 1``
while bucket ``i`` is on the wire. The store carries only each version's layout, which is also
the signal that a version is coming: a receiver enters a broadcast only once one is announced, so
an idle receiver never waits inside a collective (whose timeout is then a true fault bound).

Each receiving process receives into a staging buffer and swaps it in only once the whole version
is there: engines load from the last complete version, never from a half-received one. A load
holds the receiver's lock only to pick its buffer, so a version can arrive (and the group's
closing barrier pass) while an engine loads; a buffer an engine is still loading from is never
received into.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from asyncflow.engines.base import RolloutEngine
from asyncflow.errors import StoreError
from asyncflow.store import Store
from asyncflow.weight_sync import Publisher, Receiver, WeightSyncError
from asyncflow.weight_sync.group import Group
from asyncflow.weight_sync.layout import Layout, as_bytes, pack
from asyncflow.weight_sync.source import WeightsNotHereError, load_into
from asyncflow.weight_sync.versions import put_version

#: The store partition and field of the announced versions' layouts.
PARTITION = "__weight_layouts__"
LAYOUT = "weight_layout"
#: Layouts kept, the newest included.
KEEP_LAYOUTS = 2
#: int64 header sent before the buckets: version, total bytes, bucket size.
HEADER = 3


def announce(store: Store, layout: Layout, extra: dict[str, bytes] | None = None) -> None:
    """Puts ``layout`` (and the transport's ``extra`` fields) in the store, keeping the newest
    ``KEEP_LAYOUTS - 1`` older layouts (see :func:`put_version`)."""
    fields = {name: [value] for name, value in (extra or {}).items()}
    fields[LAYOUT] = [layout.to_json().encode()]
    put_version(store, PARTITION, fields, layout.version, KEEP_LAYOUTS)


def announced(store: Store) -> dict[int, int]:
    """The row of each announced version whose layout is in."""
    rows = store.rows(partition=PARTITION)
    if not len(rows):
        return {}
    try:
        ready = store.ready_fields(rows.indexes)
    except StoreError:
        return {}  # a version was deleted after the listing: the caller asks again
    return {
        int(v): int(i)
        for i, v, fields in zip(rows.indexes, rows.versions, ready, strict=True)
        if LAYOUT in fields
    }


class _PackingError(Exception):
    """The publisher's own work on a version failed (its cause says how), not the transfer."""


class BroadcastPublisher(Publisher):
    """Rank 0 of the group."""

    #: What the error messages call a transfer.
    what = "broadcasting"

    def __init__(self, store: Store, group: Group, bucket_size: int) -> None:
        if group.rank != 0:
            raise ValueError("the publisher is rank 0 of the weight-sync group")
        self.store, self.group, self.bucket_size = store, group, bucket_size
        self._buffers: list[torch.Tensor] = []
        #: Where the transfer in progress is, for error messages.
        self._progress = ""
        #: The failure that ended the group: a receiver may still be mid-version, so nothing
        #: more is sent (an ipc buffer rewritten under a late copy would mix two versions).
        self._failed: WeightSyncError | None = None
        #: The newest version sent: receivers take only newer ones.
        self._sent: int | None = None

    def _bucket_buffers(self) -> list[torch.Tensor]:
        """Two buckets: one on the wire, one being packed."""
        if not self._buffers:
            self._buffers = [
                torch.empty(self.bucket_size, dtype=torch.uint8, device=self.group.device)
                for _ in range(2)
            ]
        return self._buffers

    def publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._failed is not None:
            raise WeightSyncError(f"weights v{version} not sent: {self._failed}")
        if self._sent is not None and version <= self._sent:
            raise ValueError(
                f"weights v{version} not sent: v{self._sent} was, and receivers take only a "
                "newer version"
            )
        named = list(weights)
        layout = Layout.of(version, named, self.bucket_size)
        # Once here, not once per bucket a non-contiguous tensor's bytes fall in.
        tensors = [t if t.is_contiguous() else t.contiguous() for _, t in named]
        announce(self.store, layout, self._prepare(layout, tensors))
        started, self._progress = time.monotonic(), ""
        try:
            header = torch.tensor([version, layout.total, layout.bucket_size], dtype=torch.int64)
            self.group.broadcast(header.to(self.group.device)).wait()
            self._send(layout, tensors)
            self._progress = " at the closing barrier"
            self.group.barrier()  # every receiver has swapped the version in
            self._sent = version
        except _PackingError as e:  # this rank's own failure, not the wire's
            self._failed = WeightSyncError(
                f"weights v{version}: {self.group.labels[0]} failed to pack it{self._progress}: "
                f"{e.__cause__}"
            )
            raise self._failed from e.__cause__
        except RuntimeError as e:
            receivers = ", ".join(self.group.labels[1:])
            self._failed = WeightSyncError(
                f"weights v{version}: {self.what} to {receivers} failed{self._progress} after "
                f"{time.monotonic() - started:.1f}s (a receiver died or stalled): {e}"
            )
            raise self._failed from e

    def _prepare(self, layout: Layout, tensors: list[torch.Tensor]) -> dict[str, bytes]:
        """Runs before the layout is announced; returns fields to announce with it."""
        return {}

    def _send(self, layout: Layout, tensors: list[torch.Tensor]) -> None:
        """The segments: large tensors straight from their memory, the others packed into the
        two bucket buffers, the next while the one before is on the wire."""
        segments = layout.segments()
        try:
            buffers = self._bucket_buffers()
        except RuntimeError as e:  # (out of memory, say)
            raise _PackingError from e
        sending: list[Any] = [None, None]
        direct: list[Any] = []
        packed = 0
        for k, (start, end, index) in enumerate(segments):
            self._progress = f" at bucket {k + 1}/{len(segments)}"
            if index is not None and self._sendable(tensors[index]):
                offset = layout.tensors[index].offset
                source = as_bytes(tensors[index])[start - offset : end - offset]
                direct.append(self.group.broadcast(source))
                continue
            slot, packed = packed % 2, packed + 1
            if sending[slot] is not None:
                sending[slot].wait()
            try:
                bucket = pack(buffers[slot], start, end, layout, tensors)
            except RuntimeError as e:  # (a failed copy off the GPU, say)
                raise _PackingError from e
            sending[slot] = self.group.broadcast(bucket)
        for work in [*direct, *sending]:
            if work is not None:
                work.wait()

    def _sendable(self, tensor: torch.Tensor) -> bool:
        """Whether the group can send ``tensor``'s bytes from where they are."""
        return tensor.device == self.group.device and tensor.is_contiguous()

    def close(self) -> None:
        self.group.close()


class BroadcastReceiver(Receiver):
    """A member of rank >= 1: a thread receives each announced version into a staging buffer
    and swaps it in once complete; engines load from the swapped-in copy."""

    #: What the error messages call a transfer.
    what = "broadcast"

    def __init__(
        self,
        store: Store,
        group: Group,
        poll_interval: float = 0.05,
        device: torch.device | str | None = None,
    ) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 of the weight-sync group is the publisher")
        self.store, self.group, self.poll_interval = store, group, poll_interval
        #: Where the staging buffers live (default: the group's device).
        self.device = group.device if device is None else torch.device(device)
        #: Where the transfer in progress is, for error messages.
        self._progress = ""
        self._lock = threading.Lock()
        self._received = threading.Condition(self._lock)
        #: The newest complete version, its layout and its bytes.
        self._ready: tuple[Layout, torch.Tensor] | None = None
        self._spare: torch.Tensor | None = None
        #: Buffers engines are loading from (by ``id``), with how many loads each.
        self._loading: Counter[int] = Counter()
        self.error: WeightSyncError | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-sync", daemon=True)
        self._thread.start()

    # -- the receiving thread ---------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set():
            have = self.latest_received()
            try:
                newer = [v for v in announced(self.store) if v > (-1 if have is None else have)]
                if not newer:
                    self._closed.wait(self.poll_interval)
                    continue
                self._receive_one(have, max(newer))
            except Exception as e:
                with self._received:
                    self.error = (
                        e
                        if isinstance(e, WeightSyncError)
                        else WeightSyncError(
                            f"weight sync receiver {self.group.label!r}: {type(e).__name__}: {e}"
                        )
                    )
                    self._received.notify_all()
                return

    def _receive_one(self, have: int | None, announced_version: int) -> None:
        """Receives the version being sent (``announced_version``, the newest announced, names
        it in errors until the header says which it is)."""
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.group.device)
        started, version, self._progress = time.monotonic(), announced_version, ""
        try:
            self.group.broadcast(header).wait()
            version = int(header[0])
            layout = self._layout(version)
            buffer = self._staging(layout.total)
            self._fill(layout, buffer)
        except WeightSyncError:
            raise
        except RuntimeError as e:
            raise self._failure(version, have, started, e) from e
        with self._received:
            old = self._ready
            self._ready = (layout, buffer)
            self._spare = None if old is None else old[1]
            self._received.notify_all()
        self._progress = " at the closing barrier (the version is in)"
        try:
            self.group.barrier()
        except RuntimeError as e:
            raise self._failure(version, version, started, e) from e

    def _failure(
        self, version: int, have: int | None, started: float, error: Exception
    ) -> WeightSyncError:
        return WeightSyncError(
            f"weights v{version}: the {self.what} from {self.group.labels[0]} "
            f"failed{self._progress} after {time.monotonic() - started:.1f}s (it died or "
            f"stalled); engines keep v{have}: {error}"
        )

    def _fill(self, layout: Layout, buffer: torch.Tensor) -> None:
        """Receives the version's bytes into ``buffer``, segment by segment."""
        segments = layout.segments()
        works = [self.group.broadcast(buffer[start:end]) for start, end, _ in segments]
        for k, work in enumerate(works):
            self._progress = f" at bucket {k + 1}/{len(segments)}"
            work.wait()

    def _layout(self, version: int) -> Layout:
        layout = Layout.from_json(self._announced_field(version, LAYOUT))
        if layout.version != version:
            raise ValueError(f"the layout of weights v{version} says v{layout.version}")
        return layout

    def _announced_field(self, version: int, field: str) -> bytes:
        rows = announced(self.store)
        if version not in rows:
            raise LookupError(f"weights v{version} is being sent but its layout is gone")
        return bytes(self.store.read([rows[version]], field)[field][0])

    def _staging(self, total: int) -> torch.Tensor:
        """The buffer to receive into: the one of the version before the newest, unless an
        engine still loads from it (it cannot start to: loads take the newest)."""
        with self._lock:
            spare = self._spare
            if spare is not None and (spare.numel() != total or self._loading[id(spare)]):
                spare = None
        return torch.empty(total, dtype=torch.uint8, device=self.device) if spare is None else spare

    # -- the engines' side --------------------------------------------------------------------

    def latest_received(self) -> int | None:
        with self._lock:
            return None if self._ready is None else self._ready[0].version

    def latest(self) -> int | None:
        if self.error is not None:
            raise self.error
        return self.latest_received()

    def wait_for(self, version: int, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until ``version`` (or newer) is received."""
        with self._received:
            self._received.wait_for(
                lambda: (
                    self.error is not None
                    or (self._ready is not None and self._ready[0].version >= version)
                ),
                timeout,
            )
        if self.error is not None:
            raise self.error
        newest = self.latest_received()
        return newest is not None and newest >= version

    @contextlib.contextmanager
    def _held(self, version: int | None) -> Iterator[tuple[Layout, torch.Tensor]]:
        """The newest complete version (``version``, if given, must be it) and its buffer, which
        is not received into while held."""
        with self._lock:
            if self._ready is None:
                raise WeightsNotHereError("no policy weights have been received yet")
            layout, buffer = self._ready
            if version is not None and version != layout.version:
                # Not received yet, or replaced (only the newest is held).
                gone = WeightsNotHereError if version > layout.version else LookupError
                raise gone(f"weights v{version} is not here (have v{layout.version})")
            self._loading[id(buffer)] += 1
        try:
            yield layout, buffer
        finally:
            with self._lock:
                self._loading[id(buffer)] -= 1
                if not self._loading[id(buffer)]:
                    del self._loading[id(buffer)]

    def load(self, engine: RolloutEngine, version: int | None = None) -> int:
        with self._held(version) as (layout, buffer):
            load_into(engine, layout.version, layout.views(buffer))
            return layout.version

    def fetch(self, version: int | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """``(version, [(name, tensor)])`` of the version held (``version``, if given, must be
        it), as views of one copy of its bytes: the receiving thread reuses the buffer two
        versions later, and the caller may keep these past that."""
        with self._held(version) as (layout, buffer):
            return layout.version, layout.views(buffer.clone())

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=self.poll_interval * 4)
