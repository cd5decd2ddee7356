"""Random calls of the Python API — values of every dtype NumPy has (and some it does not
take), random shapes and lengths, and options of the right type but any value — on the
embedded store and on a daemon. Whatever a call rejects, it rejects with a StoreError subclass
and leaves the store exactly as it was; whatever it accepts reads back with the dtype, shape and
bytes it was sent."""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
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
    """A field's value in a put: one array (a row per first-axis entry), a list of cells, or a
    :class:`asyncflow.Ragged` (values and row lengths, which may disagree)."""
    lengths = st.one_of(
        st.lists(st.integers(-2, 4), max_size=4), arrays(), st.integers(0, 3), st.none()
    )
    return st.one_of(
        arrays(),
        st.lists(cells(), min_size=0, max_size=4),
        st.builds(af.Ragged, arrays(), lengths),
    )


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


def stored_cells(value: Any) -> list[Any]:
    """What an accepted put of ``value`` holds, one cell per row (see ``asyncflow.columns``): an
    array's rows along its first axis; ``bytes`` for ``str``/``bytes`` rows; otherwise each
    row's value as an array."""
    if isinstance(value, np.ndarray):
        return [np.asarray(row) for row in value]
    if isinstance(value, af.Ragged):
        ends = np.cumsum(value.lengths)
        return [value.values[end - n : end] for n, end in zip(value.lengths, ends, strict=True)]
    if isinstance(value[0], (str, bytes)):
        return [v.encode() if isinstance(v, str) else bytes(v) for v in value]
    if isinstance(value[0], (bool, int, float, np.generic)):
        return [np.asarray(row) for row in np.asarray(value)]
    return [np.asarray(v) for v in value]


def assert_read_back(store: af.Store, indexes: Any, data: dict[str, Any]) -> None:
    """Every field of an accepted put reads back with the dtype, shape and bytes it was sent."""
    back = store.read(indexes, list(data))
    for name, value in data.items():
        sent = stored_cells(value)
        assert len(back[name]) == len(sent) == len(indexes), name
        for row, (want, got) in enumerate(zip(sent, back[name], strict=True)):
            if isinstance(want, bytes):
                assert got == want, (name, row)
                continue
            assert (got.dtype, got.shape) == (want.dtype, want.shape), (name, row)
            assert got.tobytes() == want.tobytes(), (name, row)


#: The dtypes a store column holds.
STORED_DTYPES = ["bool", "uint8", "int32", "int64", "float16", "float32", "float64"]
#: Python numbers of one kind per field: int64, float64 and bool columns.
NUMBERS = [st.integers(-(2**63), 2**63 - 1), st.floats(), st.booleans()]
#: Fresh field names: a well-formed put never meets a schema an earlier example made.
FRESH_NAMES = itertools.count()


@st.composite
def well_formed_columns(draw: st.DrawFn) -> dict[str, Any]:
    """One to three new fields over the same rows, each in one of the forms a put takes, with
    arbitrary bit patterns (NaN payloads, infinities, subnormals) in its numbers."""
    rows = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32)))

    def cell(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        if dtype == "bool":
            return rng.integers(0, 2, size=shape).astype(bool)
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return rng.integers(0, 256, size=size, dtype=np.uint8).view(dtype).reshape(shape)

    columns: dict[str, Any] = {}
    for _ in range(draw(st.integers(1, 3))):
        form = draw(st.sampled_from(["array", "ragged", "ragged-whole", "numbers", "bytes"]))
        dtype = draw(st.sampled_from(STORED_DTYPES))
        trailing = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        name = f"f{next(FRESH_NAMES)}"
        if form == "array":
            columns[name] = cell(dtype, (rows, *trailing))
        elif form == "ragged":
            firsts = draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows))
            columns[name] = [cell(dtype, (n, *trailing)) for n in firsts]
        elif form == "ragged-whole":
            firsts = draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows))
            columns[name] = af.Ragged(cell(dtype, (sum(firsts), *trailing)), firsts)
        elif form == "numbers":
            kind = draw(st.sampled_from(NUMBERS))
            columns[name] = draw(st.lists(kind, min_size=rows, max_size=rows))
        else:
            texts = st.one_of(st.binary(max_size=8), st.text(max_size=4))
            columns[name] = draw(st.lists(texts, min_size=rows, max_size=rows))
    return columns


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
    options = {
        "partition": partition,
        "groups": groups,
        "group_size": group_size,
        "version": version,
    }
    idx = attempt(seeded, lambda: seeded.put(data, **options, tags=tags, timeout=timeout))
    event("accepted" if idx is not None else "rejected")
    if idx is None:
        return
    assert_read_back(seeded, idx, data)
    rows = seeded.rows(idx)
    if partition is not None:
        assert rows.partitions == [partition] * len(idx)
    if tags is not None:
        assert rows.tags == [tags] * len(idx)
    if version is not None:
        versions = version if isinstance(version, list) else [version] * len(idx)
        assert list(rows.versions) == versions


@SETTINGS
@given(data=well_formed_columns(), fill=st.booleans())
def test_a_well_formed_put_or_fill_reads_back_exactly(
    seeded: af.Store, data: dict[str, Any], fill: bool
) -> None:
    names = list(data)
    if fill and len(names) > 1:  # the first field makes the rows, the others fill them in
        idx = seeded.put({names[0]: data[names[0]]}, partition="p")
        assert list(seeded.put({n: data[n] for n in names[1:]}, indexes=idx)) == list(idx)
    else:
        idx = seeded.put(data, partition="p")
    assert_read_back(seeded, idx, data)


@SETTINGS
@given(
    indexes=st.lists(INTS, max_size=4),
    data=st.dictionaries(st.sampled_from(FIELDS), values(), max_size=2),
)
def test_a_fill_of_any_rows_is_stored_or_rejected_cleanly(
    seeded: af.Store, indexes: list[int], data: dict[str, Any]
) -> None:
    idx = attempt(seeded, lambda: seeded.put(data, indexes=indexes))
    event("accepted" if idx is not None else "rejected")
    if idx is not None:
        assert list(idx) == indexes
        assert_read_back(seeded, idx, data)


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
