"""The sample store's Python surface, shared by the embedded store and daemon connections.

A row is a sample; each RL task's output is a field (column) of it. Tasks claim micro-batches of
rows as soon as the fields they need are ready, and ack them when done. Every blocking call
releases the GIL and can be interrupted with Ctrl-C; every failure raises a :class:`StoreError`
subclass and leaves the store unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np

from asyncflow import _native
from asyncflow.batch import Batch
from asyncflow.columns import to_native, uint64_array
from asyncflow.errors import BadRequestError, StoreError
from asyncflow.options import DEFAULT_TIMEOUT, ClaimOptions, Indexes, PutOptions
from asyncflow.units import parse_size

__all__ = ["DEFAULT_TIMEOUT", "ClaimOptions", "Indexes", "PutOptions", "Rows", "Store"]


P = ParamSpec("P")
R = TypeVar("R")
Opts = TypeVar("Opts", ClaimOptions, PutOptions)


def _options(cls: type[Opts], options: Opts | None, kwargs: dict[str, Any]) -> Opts | None:
    """``options`` with ``kwargs`` replacing its fields, or the options ``kwargs`` make; None (the
    native defaults) for neither. An unknown keyword raises ``TypeError`` (a ``BadRequestError``
    by ``_arguments``)."""
    if options is not None:
        return dataclasses.replace(options, **kwargs) if kwargs else options
    if not kwargs:
        return None
    if cls is ClaimOptions:
        try:
            return _claim_options(**kwargs)  # type: ignore[return-value]
        except TypeError:  # an unhashable value, or a keyword the options do not have
            pass
    return cls(**kwargs)


@functools.lru_cache(maxsize=1024, typed=True)
def _claim_options(**kwargs: Any) -> ClaimOptions:
    """The claim options of these keywords. Options are immutable, so one object serves every
    claim with the same keywords, and the native store reads it once: building a frozen
    dataclass and reading it back costs as much as an embedded claim. Cached by type as well
    (``typed``), so that a value Rust refuses (1 for a bool) is never answered with options built
    from one it accepts (True)."""
    return ClaimOptions(**kwargs)


def _arguments(method: Callable[P, R]) -> Callable[P, R]:
    """Turns an argument the native module cannot take at all (a negative or oversized
    integer, a value of the wrong type) into :class:`BadRequestError`, like every other
    rejection. The native call never started, so nothing changed."""

    @functools.wraps(method)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except (OverflowError, TypeError) as e:
            raise BadRequestError(f"{method.__name__}: {e}") from e

    return checked


@dataclass(frozen=True)
class Rows:
    """Metadata of a set of rows, one entry per row."""

    indexes: np.ndarray
    partitions: list[str]
    groups: np.ndarray
    versions: np.ndarray
    #: Each row's tags as the store sent them, ``(key, value)`` pairs (see ``tags``).
    tag_pairs: list[list[tuple[str, str]]] = field(repr=False)

    def __len__(self) -> int:
        return len(self.indexes)

    @functools.cached_property
    def tags(self) -> list[dict[str, str]]:
        """Each row's tags as a dict, made when first asked for: most listings look only at
        indexes and groups, and a dict per row costs about a third of a listing."""
        return [dict(t) for t in self.tag_pairs]


def _release_unwanted(claim: asyncio.Future[Batch]) -> None:
    """Hands back the rows of a claim whose caller stopped waiting for it."""
    if claim.cancelled() or claim.exception() is not None or not len(claim.result()):
        return
    with contextlib.suppress(StoreError):  # the lease ended, or the store is gone
        claim.result().release()


@contextlib.contextmanager
def _settling(batch: Batch | int | None, subset: np.ndarray | None, acked: bool) -> Iterator[None]:
    """Around a call that acks (``acked``) or releases ``batch``, or ``subset`` of its rows: a
    :class:`Batch` lets go of its claim's cells before the call, so that the daemon hears first
    that they are no longer viewed, and records what it settled once the call succeeded."""
    if isinstance(batch, Batch):
        batch._drop_cells()
    yield
    if isinstance(batch, Batch):
        if acked:
            batch._note_acked(subset)
        batch._settle(None if subset is None else len(subset))


def _index_array(indexes: Indexes) -> np.ndarray:
    return uint64_array(indexes, "row indexes")


class Store:
    """A sample store: embedded in this process (``Store(...)``) or a daemon (``connect(...)``).

    Args:
        shards: payload shards; writes to different shards never contend on one lock.
        memory_limit: payload bytes the store may hold (``"4GiB"``, an int, or None for no limit).
            A put waits (up to its timeout) for room, then raises ``MemoryLimitError``.
        lease_timeout: seconds a claim's lease lasts before its rows are delivered again.
    """

    @_arguments
    def __init__(
        self,
        shards: int = 8,
        memory_limit: int | str | None = None,
        lease_timeout: float = 30.0,
    ) -> None:
        self._native = _native.Store(
            shards=shards, memory_limit=parse_size(memory_limit), lease_timeout=lease_timeout
        )

    @classmethod
    def _over(cls, native: _native.Store) -> Store:
        """A store speaking through a native store made otherwise (``_native.Store.connect``)."""
        store = cls.__new__(cls)
        store._native = native
        return store

    def __repr__(self) -> str:
        # Cheap and safe for a debugger or a log line: no waiting on a daemon that is gone.
        try:
            s = self._native.stats()
        except StoreError as e:
            return f"<asyncflow.Store unreachable: {e}>"
        return f"<asyncflow.Store {s['transport']} rows={s['live_rows']} memory={s['memory_used']}>"

    @_arguments
    def register_task(self, name: str, partitions: Sequence[str] | None = None) -> None:
        """Declares a consumer. Rows are kept until every registered task has acked them.

        ``partitions`` limits the task to partitions whose names start with one of these
        prefixes: it can claim only their rows, and other partitions' rows are not kept for it.
        Registering the same name again is a no-op (with a different scope, an error).
        """
        if isinstance(partitions, str):  # one prefix, not its characters
            partitions = [partitions]
        # A scope is a set of prefixes: the same set in another order is the same scope.
        scope = None if partitions is None else sorted(set(partitions))
        self._native.register_task(name, scope)

    @_arguments
    def put(
        self,
        data: Mapping[str, Any],
        *,
        options: PutOptions | None = None,
        ack: Batch | int | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """Writes rows; returns their indexes (uint64). Each field's value is one array (a row per
        first-axis entry), a list with one value per row, or a :class:`~asyncflow.Ragged` (see
        :mod:`asyncflow.columns`). ``options`` (a :class:`PutOptions`, or its fields as keyword
        arguments: ``partition``, ``indexes``, ``groups``, ``group_size``, ``version``, ``tags``,
        ``timeout``) say which rows: new ones by default, or fields of existing ``indexes``. The
        new fields become ready, and claimable, only once the whole put is in place.

        ``ack``, a batch claimed from this store (or its lease), is acked whole once the put is
        in, in the same request: a stage's results and the commit of the rows they came from in
        one round trip. Nothing is acked if the put fails. If the ack fails (``LeaseError``: the
        lease ended), the put stays in place, as with a put and then an ack.
        """
        fields = to_native(data)
        put = _options(PutOptions, options, kwargs)
        lease = None if ack is None else self._lease(ack)
        if lease is None:  # (an empty batch holds no lease: nothing to ack)
            return self._native.put(fields, put)
        if isinstance(ack, Batch) and ack.store is not self:
            raise BadRequestError("put: the batch to ack was claimed from another store")
        with _settling(ack, None, acked=True):
            return self._native.put(fields, put, lease)

    def claim(
        self,
        task: str,
        fields: str | Sequence[str],
        batch_size: int,
        *,
        options: ClaimOptions | None = None,
        **kwargs: Any,
    ) -> Batch:
        """Leases up to ``batch_size`` rows ready for all ``fields`` and not yet taken by ``task``,
        oldest first. A field no put has written yet simply has no ready rows.

        ``options`` (a :class:`ClaimOptions`, or its fields as keyword arguments: ``timeout``,
        ``partition``, ``min_version``, ``whole_groups``, ``allow_partial``, and for a claim
        shared by the ranks of a training step ``step``, ``dp_rank``, ``dp_size``, ...) say how
        long to wait, which rows qualify, and how the batch is shared.
        """
        # As `_arguments` does, without its wrapper's call on the store's most frequent request.
        try:
            names = (fields,) if isinstance(fields, str) else tuple(fields)
            claim = _options(ClaimOptions, options, kwargs)
            lease, idx, versions, groups, left, cells = self._native.claim(
                task, list(names), batch_size, claim
            )
        except (OverflowError, TypeError) as e:
            raise BadRequestError(f"claim: {e}") from e
        return Batch(self, task, names, lease, idx, versions, groups, left, cells)

    @staticmethod
    def _lease(batch: Batch | int) -> int | None:
        return batch.lease if isinstance(batch, Batch) else int(batch)

    @_arguments
    def ack(self, batch: Batch | int, indexes: Indexes | None = None) -> None:
        """Commits a claimed batch (or only ``indexes`` of it) for its task. Raises
        ``LeaseError`` if the lease expired or was already acked; then nothing changes."""
        self._settle(batch, indexes, acked=True)

    @_arguments
    def release(self, batch: Batch | int, indexes: Indexes | None = None) -> None:
        """Hands a batch's rows (or ``indexes`` of them) back for immediate redelivery."""
        self._settle(batch, indexes, acked=False)

    def _settle(self, batch: Batch | int, indexes: Indexes | None, acked: bool) -> None:
        lease = self._lease(batch)
        if lease is None:
            return
        subset = None if indexes is None else _index_array(indexes)
        if subset is not None and len(np.unique(subset)) < len(subset):
            # Counted once by the store, twice by the batch: its other rows would go unsettled.
            raise BadRequestError("a row index is given twice")
        with _settling(batch, subset, acked):
            (self._native.ack if acked else self._native.release)(lease, subset)

    @_arguments
    def renew(self, batch: Batch | int, timeout: float | None = None) -> float:
        """Extends a lease to ``timeout`` seconds from now (default: the lease timeout)."""
        lease = self._lease(batch)
        if lease is None:
            raise BadRequestError("an empty batch holds no lease")
        return float(self._native.renew(lease, timeout))

    @_arguments
    def read(self, indexes: Indexes, fields: str | Sequence[str]) -> dict[str, list[Any]]:
        """``{field: [value per row]}`` of any live rows: read-only NumPy views (no copy), or
        ``bytes`` for bytes fields."""
        names = [fields] if isinstance(fields, str) else list(fields)
        return self._native.read(_index_array(indexes), names)

    @_arguments
    def rows(self, indexes: Indexes | None = None, *, partition: str | None = None) -> Rows:
        """Metadata of ``indexes``, or of every live row (of ``partition``), oldest first."""
        idx = None if indexes is None else _index_array(indexes)
        i, parts, groups, versions, tags = self._native.rows(idx, partition=partition)
        return Rows(i, parts, groups, versions, tags)

    @_arguments
    def ready_fields(self, indexes: Indexes) -> list[list[str]]:
        """The names of the fields ready on each row."""
        return self._native.ready_fields(_index_array(indexes))

    @_arguments
    def clear(self, partition: str) -> int:
        """Frees every row of ``partition``; returns how many rows were freed."""
        return int(self._native.clear(partition))

    @_arguments
    def delete(self, indexes: Indexes) -> None:
        """Frees the given rows (all of them, or none if any is unknown)."""
        self._native.delete(_index_array(indexes))

    @_arguments
    def schema(self, field: str) -> tuple[str, tuple[int, ...] | None]:
        """``(dtype, trailing shape)`` of a field; the shape is None for scalar fields."""
        dtype, trailing = self._native.schema(field)
        return dtype, None if trailing is None else tuple(trailing)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: rows, memory, leases, per-field readiness, per-task progress,
        and ``transport`` (the data path in use)."""
        return dict(self._native.stats())

    # -- asyncio twins: run the blocking call in a worker thread (the GIL is released there) --

    async def put_async(self, data: Mapping[str, Any], **kwargs: Any) -> np.ndarray:
        """``put`` for asyncio code."""
        return await asyncio.to_thread(self.put, data, **kwargs)

    async def claim_async(
        self, task: str, fields: str | Sequence[str], batch_size: int, **kwargs: Any
    ) -> Batch:
        """``claim`` for asyncio code. Cancelled, it hands back whatever the claim, still
        running in its thread, leases afterwards."""
        claim = asyncio.ensure_future(
            asyncio.to_thread(self.claim, task, fields, batch_size, **kwargs)
        )
        try:
            return await asyncio.shield(claim)
        except asyncio.CancelledError:
            claim.add_done_callback(_release_unwanted)
            raise

    async def ack_async(self, batch: Batch | int, indexes: Indexes | None = None) -> None:
        """``ack`` for asyncio code."""
        await asyncio.to_thread(self.ack, batch, indexes)
