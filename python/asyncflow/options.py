"""The options of a claim and of a put, one frozen dataclass each.

``Store.claim`` and ``Store.put`` take one as ``options=`` or build it from their keyword
arguments (keywords given with ``options=`` replace its fields). The native store reads the
object attribute by attribute; the claim options' defaults are the Rust core's
(``_native.claim_defaults()``), so this class is the one Python list of claim options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncflow import _native
from asyncflow.columns import uint64_array
from asyncflow.errors import BadRequestError
from asyncflow.scheduler import Cost

#: Row indexes as the store takes them.
Indexes = Sequence[int] | np.ndarray

#: Default seconds a claim or put waits before raising ``TimeoutError`` / ``MemoryLimitError``.
DEFAULT_TIMEOUT: float = _native.DEFAULT_TIMEOUT

_CLAIM: dict[str, Any] = _native.claim_defaults()


@dataclass(frozen=True, kw_only=True)
class ClaimOptions:
    """How ``Store.claim`` leases rows.

    A claim waits up to ``timeout`` seconds (None: for ever) for a full batch; then it returns
    what is ready if ``allow_partial`` (possibly nothing), else raises ``TimeoutError``. With
    ``allow_partial`` and ``partial_after``, it settles for part of a batch, but not for none,
    once ``partial_after`` seconds have passed: a consumer with nothing to do waits for its
    first rows in one request, yet does not wait on for a full batch.
    ``partition`` and ``min_version`` filter rows; ``whole_groups`` delivers a GRPO group all
    together or not at all.

    With ``step``, the claim is shared by the consumers of one training step: the first to ask
    claims the step's whole batch (``batch_size`` rows) and splits it into ``dp_size`` parts
    balanced by the token length (first dimension) of ``balance_field`` (default: the first of
    the claimed fields) under ``cost`` (``linear_weight`` weighs the attention model's linear
    term); data-parallel rank ``dp_rank`` gets part ``dp_rank``. The ``replica_size`` peers of a
    replica group (tensor/pipeline ranks, ``replica_rank`` each) get the same part, and its rows
    are committed once every peer has acked them. Every caller of a step repeats the same
    options; ``replica`` names independent groups that each claim their own batch per step. With
    ``whole_groups`` a GRPO group stays on one rank; ``equal_count`` gives ranks equally many
    rows (±1). Each part has its own lease: ranks commit independently; a release by any peer,
    or expiry, hands the part back for all its peers; a caller whose part has ended gets
    ``LeaseError``, and an ended step is never claimed afresh. Without ``step`` the sharing
    options must keep their defaults.
    """

    timeout: float | None = _CLAIM["timeout"]
    partition: str | None = _CLAIM["partition"]
    min_version: int | None = _CLAIM["min_version"]
    whole_groups: bool = _CLAIM["whole_groups"]
    allow_partial: bool = _CLAIM["allow_partial"]
    partial_after: float | None = _CLAIM["partial_after"]
    step: int | None = _CLAIM["step"]
    replica: int = _CLAIM["replica"]
    dp_rank: int = _CLAIM["dp_rank"]
    dp_size: int = _CLAIM["dp_size"]
    replica_rank: int = _CLAIM["replica_rank"]
    replica_size: int = _CLAIM["replica_size"]
    balance_field: str | None = _CLAIM["balance_field"]
    cost: Cost = _CLAIM["cost"]
    linear_weight: float | None = _CLAIM["linear_weight"]
    equal_count: bool = _CLAIM["equal_count"]


@dataclass(frozen=True, kw_only=True)
class PutOptions:
    """How ``Store.put`` writes.

    Without ``indexes`` a put creates new rows in ``partition`` (default ``"default"``), with
    optional GRPO ``groups`` (one id per row; ``group_size`` declares a group's
    full size when it is written over several puts), policy ``version`` (one, or one per row)
    and ``tags`` (one mapping for every row, or one per row); per-row values are kept as arrays,
    and tags as one dict per row. With ``indexes`` it fills (or
    replaces) fields of those existing rows, and the options that describe new rows must be left
    out. A put waits up to ``timeout`` seconds for memory (None: the default) before raising
    ``MemoryLimitError``.
    """

    partition: str | None = None
    indexes: Indexes | None = None
    groups: int | Indexes | None = None
    group_size: int | None = None
    version: int | Indexes | None = None
    tags: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None
    timeout: float | None = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        # Per-row values are kept as the native store reads them, checked once, here: indexes,
        # groups and versions as 1-D integer arrays, tags as one ``{str: str}`` dict per row.
        if self.indexes is not None:
            object.__setattr__(self, "indexes", uint64_array(self.indexes, "row indexes"))
        if self.groups is not None:
            object.__setattr__(self, "groups", _per_row(self.groups, np.int64))
        if self.version is not None:
            object.__setattr__(self, "version", _per_row(self.version, np.uint64))
        if self.tags is not None:
            object.__setattr__(self, "tags", _tag_rows(self.tags))


def _per_row(value: int | Indexes, dtype: type) -> np.ndarray:
    arr = np.atleast_1d(np.asarray(value))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "ui"):
        raise BadRequestError(f"expected an integer or a 1-D sequence of integers, got {value!r}")
    if arr.size and arr.min() < 0:
        raise BadRequestError(f"expected non-negative integers, got {value!r}")
    return np.ascontiguousarray(arr, dtype=dtype)


def _tag_rows(tags: Mapping[str, str] | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    rows = [tags] if isinstance(tags, Mapping) else tags
    if isinstance(rows, (str, bytes)) or not all(isinstance(r, Mapping) for r in rows):
        raise BadRequestError(f"tags must be a mapping or one mapping per row, not {tags!r:.80}")
    return [{str(k): str(v) for k, v in row.items()} for row in rows]
