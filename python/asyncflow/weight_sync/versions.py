"""Versions kept in a pinned partition of the store (the weights themselves, or the layouts of
a weight-sync group's versions): one row per version, the newest few kept for readers."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from asyncflow.errors import StoreError
from asyncflow.store import Store


def put_version(
    store: Store,
    partition: str,
    fields: Mapping[str, Any],
    version: int,
    keep: int,
    more: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Puts ``fields`` as ``version`` of ``partition``, first deleting the rows no reader needs
    any more: every row of that version or a newer one (left by an earlier run against the same
    daemon, or a version published again) and all but the newest ``keep - 1`` older ones. So at
    most ``keep`` versions hold memory while the new one goes in, and the newest is the one
    just put. ``more`` are put into the same row after it, one put each (a daemon refuses a put
    over its ``--max-frame``); if one fails, the row is deleted again."""
    rows = store.rows(partition=partition)
    kept = set(sorted({int(v) for v in rows.versions if int(v) < version})[::-1][: keep - 1])
    stale = [int(i) for i, v in zip(rows.indexes, rows.versions, strict=True) if int(v) not in kept]
    if stale:
        store.delete(stale)
    row = store.put(dict(fields), partition=partition, version=version)
    try:
        for piece in more:
            store.put(dict(piece), indexes=row)
    except BaseException:
        with contextlib.suppress(StoreError):  # the store gone: so is the row
            store.delete(row)
        raise
