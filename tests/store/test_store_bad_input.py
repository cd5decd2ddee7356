"""Bad input gets a clear StoreError subclass and leaves the store exactly as it was."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncflow as af

STABLE_STATS = ("live_rows", "memory_used", "rows_put", "field_ready_updates", "rows_acked")


@pytest.fixture
def seeded(store: af.Store) -> tuple[af.Store, np.ndarray]:
    store.register_task("t")
    idx = store.put({"ids": [np.arange(4), np.arange(2)], "r": [1.0, 2.0]}, partition="p")
    return store, idx


def snapshot(store: af.Store) -> dict[str, Any]:
    s = store.stats()
    return {k: s[k] for k in STABLE_STATS} | {"fields": s["fields"]}


def rejected(
    store: af.Store,
    error: type[af.StoreError],
    call: Callable[[], object],
    match: str | None = None,
) -> None:
    before = snapshot(store)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(store) == before, "a failed call must leave the store unchanged"


def test_wrong_dtype_for_an_existing_field(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.SchemaError, lambda: store.put({"ids": [np.ones(3, np.float32)]}), "ids")


def test_wrong_trailing_shape_for_an_existing_field(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.SchemaError, lambda: store.put({"ids": [np.zeros((2, 2), np.int64)]}))


def test_scalar_given_where_arrays_were_written(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.SchemaError, lambda: store.put({"ids": [1, 2]}))


def test_unequal_row_counts_across_fields(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.SchemaError, lambda: store.put({"a": [1, 2, 3], "b": [1.0, 2.0]}), "rows")


def test_rows_of_one_field_that_disagree(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.SchemaError, lambda: store.put({"m": [np.zeros(2), np.zeros((2, 2))]}))


def test_unknown_index_in_a_fill(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, idx = seeded
    bad = [int(idx[0]), 10**9]
    rejected(store, af.UnknownIndexError, lambda: store.put({"adv": [0.1, 0.2]}, indexes=bad))


def test_fill_with_wrong_number_of_indexes(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, idx = seeded
    rejected(store, af.SchemaError, lambda: store.put({"adv": [0.1]}, indexes=idx))


def test_unknown_field_on_read(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, idx = seeded
    rejected(store, af.UnknownFieldError, lambda: store.read(idx, "nope"))


def test_unknown_index_on_read(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.UnknownIndexError, lambda: store.read([12345], "ids"))


def test_unknown_task_on_claim(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.UnknownTaskError, lambda: store.claim("nobody", "ids", 1, timeout=0))


@pytest.mark.parametrize("size", [0, -3])
def test_zero_or_negative_batch_size(seeded: tuple[af.Store, np.ndarray], size: int) -> None:
    store, _ = seeded
    rejected(store, af.BadRequestError, lambda: store.claim("t", "ids", size, timeout=0))


def test_object_arrays(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    objs = np.array([{"a": 1}, None], dtype=object)
    rejected(store, af.SchemaError, lambda: store.put({"o": objs}), "object")


def test_unsupported_dtypes(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.SchemaError, lambda: store.put({"c": np.zeros(2, np.complex64)}))
    rejected(store, af.SchemaError, lambda: store.put({"s": np.array(["a", "b"])}))


def test_ragged_values_whose_lengths_do_not_fit_them(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    values = np.arange(6)
    for lengths, error, match in [
        ([2, 3], af.SchemaError, "add up to 5, the values have 6"),
        ([2, 5], af.SchemaError, "add up to 7, the values have 6"),
        ([-1, 7], af.BadRequestError, "cannot be negative"),
        ([[6]], af.BadRequestError, "1-D sequence of integers"),
        ([], af.SchemaError, "no rows"),
    ]:
        rejected(store, error, lambda ls=lengths: store.put({"v": af.Ragged(values, ls)}), match)
    rejected(store, af.SchemaError, lambda: store.put({"v": af.Ragged(np.int64(3), [1])}), "axis")
    # Rows of an existing field keep its schema, given whole or not.
    rejected(store, af.SchemaError, lambda: store.put({"ids": af.Ragged(np.ones(3), [3])}))


def test_a_single_put_larger_than_the_memory_limit(make_store: Callable[..., af.Store]) -> None:
    store = make_store(memory_limit="1KiB")
    rejected(store, af.MemoryLimitError, lambda: store.put({"x": [np.zeros(2048, np.uint8)]}))


def test_acking_an_unknown_lease(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.LeaseError, lambda: store.ack(987654))


def test_acking_rows_the_lease_does_not_hold(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, idx = seeded
    batch = store.claim("t", "ids", 1, timeout=1)
    other = [int(i) for i in idx if i not in batch.indexes]
    rejected(store, af.LeaseError, lambda: store.ack(batch, other), "not held")


def test_negative_group_ids_and_bad_versions(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.BadRequestError, lambda: store.put({"x": [1]}, groups=[-1]))
    rejected(store, af.BadRequestError, lambda: store.put({"x": [1, 2]}, version=[1, 2, 3]))


def test_group_overflowing_its_declared_size(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.BadRequestError, lambda: store.put({"x": [1, 1, 1]}, groups=3, group_size=2))


def test_empty_puts_and_non_mappings(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.BadRequestError, lambda: store.put({}))
    rejected(store, af.BadRequestError, lambda: store.put({"x": []}))
    rejected(store, af.BadRequestError, lambda: store.put([1, 2]))  # type: ignore[arg-type]


def test_bad_timeouts(seeded: tuple[af.Store, np.ndarray]) -> None:
    store, _ = seeded
    rejected(store, af.BadRequestError, lambda: store.claim("t", "ids", 1, timeout=-1))
    with pytest.raises(af.BadRequestError):
        af.Store(lease_timeout=0)
    # Values no duration holds are refused, never a panic.
    for huge in (1e20, 1e300):
        claim = functools.partial(store.claim, "t", "ids", 1, timeout=huge)
        rejected(store, af.BadRequestError, claim)
        with pytest.raises(af.BadRequestError, match="lease_timeout"):
            af.Store(lease_timeout=huge)


def test_a_row_index_given_twice_to_a_partial_ack_is_refused(
    seeded: tuple[af.Store, np.ndarray],
) -> None:
    """Counted once by the store, it would have counted twice in the batch: its other row was
    then left unsettled by the block's end, delivered again once its lease ran out."""
    store, _ = seeded
    with store.claim("t", ["ids"], 2, timeout=1) as batch:
        first = int(batch.indexes[0])
        rejected(store, af.BadRequestError, lambda: batch.ack([first, first]), "given twice")
    again = store.claim("t", ["ids"], 2, timeout=0.1, allow_partial=True)
    assert len(again) == 0, "the block acked both rows"


@pytest.mark.parametrize("tags", [[("k", "v")], "abc", [None]])
def test_tags_that_are_not_mappings_are_refused(
    seeded: tuple[af.Store, np.ndarray], tags: object
) -> None:
    store, _ = seeded
    rejected(store, af.BadRequestError, lambda: store.put({"r": [1.0]}, tags=tags), "tags must")
