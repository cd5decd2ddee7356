"""Random calls of the Python API — values of every dtype NumPy has (and some it does not
take), random shapes and lengths, and options of the right type but any value — on the
embedded store and on a daemon. Whatever a call rejects, it rejects with a StoreError subclass
and leaves the store exactly as it was."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncflow as af

DTYPES = [
    "bool", "uint8", "int8", "uint16", "int16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "U3", "S3", "O", "M8[s]",
]  # fmt: skip
FIELDS = ["ids", "r", "text", "new"]
INTS = st.integers(min_value=-(2**65), max_value=2**65)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
#: ``make reliability`` runs many more examples than CI.
SETTINGS = settings(
    max_examples=int(os.environ.get("AF_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def arrays() -> st.SearchStrategy[np.ndarray]:
    shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)

    def build(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 100, size=shape)
        if dtype == "O":
            return np.array(raw.tolist(), dtype=object) if shape else np.array(1, dtype=object)
        return raw.astype(dtype)

    return st.builds(build, st.sampled_from(DTYPES), shapes, st.integers(0, 2**32))


def cells() -> st.SearchStrategy[Any]:
    return st.one_of(
        arrays(),
        st.integers(-(2**70), 2**70),
        FLOATS,
        st.booleans(),
        st.binary(max_size=8),
        st.text(max_size=4),
        st.none(),
        st.lists(st.integers(0, 5), max_size=3),
    )


def values() -> st.SearchStrategy[Any]:
    """A field's value in a put: one array (a row per first-axis entry) or a list of cells."""
    return st.one_of(arrays(), st.lists(cells(), min_size=0, max_size=4))


def snapshot(store: af.Store) -> dict[str, Any]:
    s = store.stats()
    keys = ("live_rows", "memory_used", "rows_put", "field_ready_updates", "rows_acked")
    return {k: s[k] for k in keys} | {
        "fields": s["fields"],
        "tasks": s["tasks"],
        "partitions": s["partitions"],
        "active_leases": s["active_leases"],
    }


def attempt(store: af.Store, call: Any) -> Any:
    """Runs ``call``; a rejection must be a StoreError subclass that changed nothing."""
    before = snapshot(store)
    try:
        return call()
    except af.StoreError:
        assert snapshot(store) == before, "a rejected call changed the store"
    return None


@pytest.fixture
def seeded(store: af.Store) -> af.Store:
    store.register_task("t")
    store.put(
        {"ids": [np.arange(3), np.arange(1)], "r": [1.0, 2.0], "text": ["a", "bc"]},
        partition="p",
    )
    return store


@SETTINGS
@given(
    data=st.dictionaries(st.sampled_from(FIELDS), values(), max_size=3),
    partition=st.one_of(st.none(), st.text(max_size=3)),
    groups=st.one_of(st.none(), INTS, st.lists(INTS, max_size=4)),
    group_size=st.one_of(st.none(), INTS),
    version=st.one_of(st.none(), INTS, st.lists(INTS, max_size=4)),
    tags=st.one_of(st.none(), st.dictionaries(st.text(max_size=2), st.text(max_size=2))),
    timeout=st.one_of(st.none(), FLOATS),
)
def test_a_put_of_anything_is_stored_or_rejected_cleanly(
    seeded: af.Store,
    data: dict[str, Any],
    partition: str | None,
    groups: Any,
    group_size: int | None,
    version: Any,
    tags: dict[str, str] | None,
    timeout: float | None,
) -> None:
    options = dict(partition=partition, groups=groups, group_size=group_size, version=version)
    attempt(seeded, lambda: seeded.put(data, **options, tags=tags, timeout=timeout))


@SETTINGS
@given(
    indexes=st.lists(INTS, max_size=4),
    data=st.dictionaries(st.sampled_from(FIELDS), values(), max_size=2),
)
def test_a_fill_of_any_rows_is_stored_or_rejected_cleanly(
    seeded: af.Store, indexes: list[int], data: dict[str, Any]
) -> None:
    attempt(seeded, lambda: seeded.put(data, indexes=indexes))


@SETTINGS
@given(
    task=st.sampled_from(["t", "nobody", ""]),
    fields=st.lists(st.sampled_from([*FIELDS, ""]), max_size=3),
    batch_size=INTS,
    timeout=st.one_of(st.none(), st.floats(max_value=0.05), st.just(float("nan"))),
    partition=st.one_of(st.none(), st.text(max_size=2)),
    min_version=st.one_of(st.none(), INTS),
    whole_groups=st.booleans(),
    allow_partial=st.booleans(),
    step=st.one_of(st.none(), INTS),
    dp=st.tuples(INTS, INTS),
    replica=st.tuples(INTS, INTS, INTS),
    cost=st.sampled_from(["tokens", "attention", "quadratic"]),
    linear_weight=FLOATS,
)
def test_a_claim_with_any_options_is_served_or_rejected_cleanly(
    seeded: af.Store,
    task: str,
    fields: list[str],
    batch_size: int,
    timeout: float | None,
    partition: str | None,
    min_version: int | None,
    whole_groups: bool,
    allow_partial: bool,
    step: int | None,
    dp: tuple[int, int],
    replica: tuple[int, int, int],
    cost: Any,
    linear_weight: float,
) -> None:
    def claim() -> af.Batch:
        return seeded.claim(
            task, fields, batch_size, timeout=0.0 if timeout is None else timeout,
            partition=partition, min_version=min_version, whole_groups=whole_groups,
            allow_partial=allow_partial, step=step, dp_rank=dp[0], dp_size=dp[1],
            replica=replica[0], replica_rank=replica[1], replica_size=replica[2],
            cost=cost, linear_weight=linear_weight,
        )  # fmt: skip

    batch = attempt(seeded, claim)
    if batch is not None and batch.lease is not None:
        seeded.release(batch)


@SETTINGS
@given(
    lease=INTS,
    indexes=st.one_of(st.none(), st.lists(INTS, max_size=3)),
    fields=st.lists(st.sampled_from([*FIELDS, "zz"]), max_size=3),
    name=st.text(max_size=3),
)
def test_acks_reads_deletes_and_names_of_anything_are_rejected_cleanly(
    seeded: af.Store,
    lease: int,
    indexes: list[int] | None,
    fields: list[str],
    name: str,
) -> None:
    rows = indexes or []
    attempt(seeded, lambda: seeded.ack(lease, indexes))
    attempt(seeded, lambda: seeded.release(lease, indexes))
    attempt(seeded, lambda: seeded.renew(lease, 1.0))
    attempt(seeded, lambda: seeded.read(rows, fields))
    attempt(seeded, lambda: seeded.rows(rows))
    attempt(seeded, lambda: seeded.ready_fields(rows))
    attempt(seeded, lambda: seeded.schema(name))
    attempt(seeded, lambda: seeded.register_task(name, [name]))
    if rows:
        attempt(seeded, lambda: seeded.delete(rows))
