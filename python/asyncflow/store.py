"""The sample store's Python surface, shared by the embedded store and daemon connections.

A row is a sample; each RL task's output is a field (column) of it. Tasks claim micro-batches of
rows as soon as the fields they need are ready, and ack them when done. Every blocking call
releases the GIL and can be interrupted with Ctrl-C; every failure raises a :class:`StoreError`
subclass and leaves the store unchanged.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np

from asyncflow import _native
from asyncflow.batch import Batch
from asyncflow.columns import to_native, uint64_array
from asyncflow.errors import BadRequestError
from asyncflow.scheduler import DEFAULT_LINEAR_WEIGHT, Cost
from asyncflow.units import parse_size

Indexes = Sequence[int] | np.ndarray

#: Default seconds a claim or put waits before raising ``TimeoutError`` / ``MemoryLimitError``.
DEFAULT_TIMEOUT = 60.0


P = ParamSpec("P")
R = TypeVar("R")


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
    tags: list[dict[str, str]]

    def __len__(self) -> int:
        return len(self.indexes)


def _index_array(indexes: Indexes) -> np.ndarray:
    return uint64_array(indexes, "row indexes")


def _per_row(value: int | Indexes | None, dtype: type) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.atleast_1d(np.asarray(value))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "ui"):
        raise BadRequestError(f"expected an integer or a 1-D sequence of integers, got {value!r}")
    if arr.size and arr.min() < 0:
        raise BadRequestError(f"expected non-negative integers, got {value!r}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _tags(
    tags: Mapping[str, str] | Sequence[Mapping[str, str]] | None,
) -> list[list[tuple[str, str]]] | None:
    if tags is None:
        return None
    rows = [tags] if isinstance(tags, Mapping) else list(tags)
    return [[(str(k), str(v)) for k, v in row.items()] for row in rows]


class Store:
    """A sample store: embedded in this process (``Store(...)``) or a daemon (``connect(...)``).

    Args:
        shards: payload shards; writes to different shards never contend on one lock.
        memory_limit: payload bytes the store may hold (``"4GiB"``, an int, or None for no limit).
            A put waits (up to its timeout) for room, then raises ``MemoryLimitError``.
        lease_timeout: seconds a claim's lease lasts before its rows are delivered again.
    """

    def __init__(
        self,
        shards: int = 8,
        memory_limit: int | str | None = None,
        lease_timeout: float = 30.0,
    ) -> None:
        self._native: Any = _native.Store(
            shards=shards, memory_limit=parse_size(memory_limit), lease_timeout=lease_timeout
        )

    @classmethod
    def _over(cls, backend: Any) -> Store:
        """A store speaking through another native backend with the same methods."""
        store = cls.__new__(cls)
        store._native = backend
        return store

    def __repr__(self) -> str:
        s = self.stats()
        return f"<asyncflow.Store {s['transport']} rows={s['live_rows']} memory={s['memory_used']}>"

    @_arguments
    def register_task(self, name: str, partitions: Sequence[str] | None = None) -> None:
        """Declares a consumer. Rows are kept until every registered task has acked them.

        ``partitions`` limits the task to partitions whose names start with one of these
        prefixes: it can claim only their rows, and other partitions' rows are not kept for it.
        Registering the same name again is a no-op (with a different scope, an error).
        """
        self._native.register_task(name, None if partitions is None else list(partitions))

    @_arguments
    def put(
        self,
        data: Mapping[str, Any],
        *,
        partition: str | None = None,
        indexes: Indexes | None = None,
        groups: int | Indexes | None = None,
        group_size: int | None = None,
        version: int | Indexes | None = None,
        tags: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> np.ndarray:
        """Writes rows; returns their indexes (uint64).

        Without ``indexes`` it creates new rows in ``partition`` (default ``"default"``), with
        optional GRPO ``groups`` (one id per row; ``group_size`` declares a group's full size
        when it is written over several puts), policy ``version`` (one, or one per row) and
        ``tags``. With ``indexes`` it fills (or replaces) fields of existing rows. The new
        fields become ready, and claimable, only once the whole put is in place.
        """
        fields = to_native(data)
        return self._native.put(  # type: ignore[no-any-return]
            fields,
            partition=partition,
            indexes=None if indexes is None else _index_array(indexes),
            groups=_per_row(groups, np.int64),
            group_size=group_size,
            versions=_per_row(version, np.uint64),
            tags=_tags(tags),
            timeout=timeout,
        )

    @_arguments
    def claim(
        self,
        task: str,
        fields: str | Sequence[str],
        batch_size: int,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        partition: str | None = None,
        min_version: int | None = None,
        whole_groups: bool = False,
        allow_partial: bool = False,
        step: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        replica: int = 0,
        replica_rank: int = 0,
        replica_size: int = 1,
        balance_field: str | None = None,
        cost: Cost = "tokens",
        linear_weight: float = DEFAULT_LINEAR_WEIGHT,
        equal_count: bool = False,
    ) -> Batch:
        """Leases up to ``batch_size`` rows ready for all ``fields`` and not yet taken by ``task``,
        oldest first.

        Waits up to ``timeout`` seconds (None: for ever) for a full batch; then returns what is
        ready if ``allow_partial`` (possibly nothing), else raises ``TimeoutError``. ``partition``
        and ``min_version`` filter rows; ``whole_groups`` delivers a GRPO group all together or not
        at all. A field no put has written yet simply has no ready rows.

        With ``step``, the claim is shared by the consumers of one training step: the first to ask
        claims the step's whole batch (``batch_size`` rows) and splits it into ``dp_size`` parts
        balanced by the token length (first dimension) of ``balance_field`` (default: the first of
        ``fields``) under ``cost``; data-parallel rank ``dp_rank`` gets part ``dp_rank``. The
        ``replica_size`` peers of a replica group (tensor/pipeline ranks, ``replica_rank`` each)
        get the same part, and its rows are committed once every peer has acked them. Every
        caller of a step repeats the same options; ``replica`` names independent groups that
        each claim their own batch per step. With ``whole_groups`` a GRPO group stays on one
        rank; ``equal_count`` gives ranks equally many rows (±1). Each part has its own lease:
        ranks commit independently; a release by any peer, or expiry, hands the part back for
        all its peers; a caller whose part has ended gets ``LeaseError``, and an ended step is
        never claimed afresh.
        """
        names = (fields,) if isinstance(fields, str) else tuple(fields)
        lease, idx, versions, groups, left, cells = self._native.claim(
            task,
            list(names),
            batch_size,
            timeout=timeout,
            partition=partition,
            min_version=min_version,
            whole_groups=whole_groups,
            allow_partial=allow_partial,
            step=step,
            replica=replica,
            dp_rank=dp_rank,
            dp_size=dp_size,
            replica_rank=replica_rank,
            replica_size=replica_size,
            balance_field=balance_field,
            cost=cost,
            linear_weight=linear_weight,
            equal_count=equal_count,
        )
        return Batch(self, task, names, lease, idx, versions, groups, left, cells)

    @staticmethod
    def _lease(batch: Batch | int) -> int | None:
        return batch.lease if isinstance(batch, Batch) else int(batch)

    @_arguments
    def ack(self, batch: Batch | int, indexes: Indexes | None = None) -> None:
        """Commits a claimed batch (or only ``indexes`` of it) for its task. Raises
        ``LeaseError`` if the lease expired or was already acked; then nothing changes."""
        lease = self._lease(batch)
        if lease is None:
            return
        subset = None if indexes is None else _index_array(indexes)
        if isinstance(batch, Batch):
            batch._drop_cells()
        self._native.ack(lease, subset)
        if isinstance(batch, Batch):
            batch._note_acked(subset)
            batch._settle(None if subset is None else len(subset))

    @_arguments
    def release(self, batch: Batch | int, indexes: Indexes | None = None) -> None:
        """Hands a batch's rows (or ``indexes`` of them) back for immediate redelivery."""
        lease = self._lease(batch)
        if lease is None:
            return
        subset = None if indexes is None else _index_array(indexes)
        if isinstance(batch, Batch):
            batch._drop_cells()
        self._native.release(lease, subset)
        if isinstance(batch, Batch):
            batch._settle(None if subset is None else len(subset))

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
        return self._native.read(_index_array(indexes), names)  # type: ignore[no-any-return]

    @_arguments
    def rows(self, indexes: Indexes | None = None, *, partition: str | None = None) -> Rows:
        """Metadata of ``indexes``, or of every live row (of ``partition``), oldest first."""
        idx = None if indexes is None else _index_array(indexes)
        i, parts, groups, versions, tags = self._native.rows(idx, partition=partition)
        return Rows(i, parts, groups, versions, [dict(t) for t in tags])

    @_arguments
    def ready_fields(self, indexes: Indexes) -> list[list[str]]:
        """The names of the fields ready on each row."""
        return self._native.ready_fields(_index_array(indexes))  # type: ignore[no-any-return]

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
        """``claim`` for asyncio code."""
        return await asyncio.to_thread(self.claim, task, fields, batch_size, **kwargs)

    async def ack_async(self, batch: Batch | int, indexes: Indexes | None = None) -> None:
        """``ack`` for asyncio code."""
        await asyncio.to_thread(self.ack, batch, indexes)
