"""The Python surface of the store: puts, claims, reads, acks, options and lifetimes."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import asyncflow as af


def test_put_returns_fresh_indexes_and_claim_returns_them_oldest_first(store: af.Store) -> None:
    store.register_task("gen")
    a = store.put({"x": [np.arange(3), np.arange(2)]})
    b = store.put({"x": [np.arange(1)]})
    assert a.dtype == np.uint64 and len(set(a) | set(b)) == 3
    batch = store.claim("gen", "x", 3, timeout=1)
    assert list(batch.indexes) == [*a, *b]


@pytest.mark.parametrize(
    "dtype",
    [np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64],
)
def test_every_numeric_dtype_round_trips_exactly(store: af.Store, dtype: type) -> None:
    rng = np.random.default_rng(0)
    rows = [(rng.random((n, 3)) * 100).astype(dtype) for n in (0, 1, 5)]
    idx = store.put({"v": rows})
    back = store.read(idx, "v")["v"]
    for sent, got in zip(rows, back, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        np.testing.assert_array_equal(got, sent)


def test_bfloat16_tensors_come_back_as_bfloat16(store: af.Store) -> None:
    store.register_task("t")
    t = torch.randn(4, 3).to(torch.bfloat16)
    store.put({"w": t})
    assert store.schema("w") == ("bf16", ())
    out = store.claim("t", "w", 4, timeout=1).to_torch()["w"]
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, t)


@pytest.mark.parametrize("pad_value", [1.0, -100.0, float("nan")])
def test_ragged_bfloat16_rows_are_padded_with_the_value_asked(
    store: af.Store, pad_value: float
) -> None:
    store.register_task("t")
    rows = [torch.tensor([0.5, 2.0]).to(torch.bfloat16), torch.tensor([3.0]).to(torch.bfloat16)]
    store.put({"w": rows})
    out = store.claim("t", "w", 2, timeout=1).to_torch(pad_value=pad_value)["w"]
    assert out.dtype == torch.bfloat16 and out[0].tolist() == [0.5, 2.0] and out[1, 0] == 3.0
    torch.testing.assert_close(out[1, 1].float(), torch.tensor(pad_value), equal_nan=True)


def test_a_partition_prefix_given_as_one_string_is_one_prefix(store: af.Store) -> None:
    store.register_task("t", partitions="s-1")
    store.put({"x": [1.0]}, partition="s-1")
    store.put({"x": [2.0]}, partition="e")  # "e" is a character of "s-1", not a prefix
    batch = store.claim("t", "x", 2, timeout=0.2, allow_partial=True)
    assert [float(v) for v in batch.read()["x"]] == [1.0]


def test_a_task_registered_again_with_its_prefixes_in_another_order_is_the_same_task(
    store: af.Store,
) -> None:
    store.register_task("t", partitions=["a", "b"])
    store.register_task("t", partitions=["b", "a", "b"])  # the same set: a no-op
    with pytest.raises(af.BadRequestError):
        store.register_task("t", partitions=["a"])


def test_a_list_of_claimed_indexes_and_plain_ints_is_read(store: af.Store) -> None:
    idx = store.put({"x": [1.0, 2.0]})
    mixed = [idx[0], int(idx[1])]  # NumPy alone would make float64 of these
    assert [float(v) for v in store.read(mixed, "x")["x"]] == [1.0, 2.0]


def test_the_repr_of_a_store_that_cannot_answer_says_so_at_once(store: af.Store) -> None:
    class Gone:
        def stats(self) -> dict[str, Any]:
            raise af.ConnectionError("the daemon is gone")

    store._native = Gone()  # type: ignore[assignment]
    assert repr(store) == "<asyncflow.Store unreachable: the daemon is gone>"


def test_scalars_ragged_arrays_and_text_keep_their_shapes(store: af.Store) -> None:
    idx = store.put(
        {"reward": [1.0, 0.5], "ids": [np.array([1, 2, 3]), np.array([4])], "text": ["a", b"bc"]}
    )
    got = store.read(idx, ["reward", "ids", "text"])
    assert [float(r) for r in got["reward"]] == [1.0, 0.5]
    assert got["reward"][0].shape == ()
    assert [list(x) for x in got["ids"]] == [[1, 2, 3], [4]]
    assert got["text"] == [b"a", b"bc"]
    assert store.schema("reward") == ("f64", None)


def test_a_ragged_column_given_whole_reads_back_row_by_row(store: af.Store) -> None:
    values = np.arange(14, dtype=np.float32).reshape(7, 2)
    idx = store.put({"v": af.Ragged(values, [3, 0, 4]), "ids": af.Ragged(np.arange(3), [1, 1, 1])})
    got = store.read(idx, ["v", "ids"])
    assert [g.tolist() for g in got["v"]] == [values[:3].tolist(), [], values[3:].tolist()]
    assert got["v"][1].shape == (0, 2)
    assert [g.tolist() for g in got["ids"]] == [[0], [1], [2]]
    # The same column as a list of per-row arrays: one schema.
    store.put({"v": [values[:1]]})
    assert store.schema("v") == ("f32", (2,))


def test_reads_are_read_only_views_that_share_store_memory(store: af.Store) -> None:
    # 32 KiB: over shared memory, a put of a few KiB travels in its request and is read as copies.
    idx = store.put({"x": [np.arange(8192, dtype=np.float32)]})
    first = store.read(idx, "x")["x"][0]
    second = store.read(idx, "x")["x"][0]
    assert np.shares_memory(first, second), "both reads view the same store bytes"
    assert not first.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        first[0] = 1.0


def test_a_view_keeps_its_payload_alive_after_the_row_is_freed(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [np.full(4096, 7.0)]})
    with store.claim("t", "x", 1, timeout=1) as batch:
        view = batch.read()["x"][0]
    assert store.stats()["live_rows"] == 0
    assert store.stats()["memory_used"] > 0, "the view still holds the chunk"
    assert float(view.sum()) == 7.0 * 4096
    del view
    gc.collect()
    assert store.stats()["memory_used"] == 0


def test_to_torch_pads_ragged_rows_with_the_pad_value(store: af.Store) -> None:
    store.register_task("t")
    store.put({"ids": [np.array([1, 2, 3]), np.array([4])], "r": [1.0, 2.0]})
    out = store.claim("t", ["ids", "r"], 2, timeout=1).to_torch(pad_value=-1)
    assert out["ids"].tolist() == [[1, 2, 3], [4, -1, -1]]
    assert out["r"].tolist() == [1.0, 2.0]


def test_non_contiguous_arrays_are_copied_not_rejected(store: af.Store) -> None:
    base = np.arange(20, dtype=np.int64).reshape(4, 5)
    idx = store.put({"col": base[:, 1]})  # strided view
    assert [int(v) for v in store.read(idx, "col")["col"]] == [1, 6, 11, 16]


def test_context_manager_acks_on_success_and_releases_on_error(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [1, 2]})
    with pytest.raises(RuntimeError), store.claim("t", "x", 2, timeout=1):
        raise RuntimeError("worker failed")
    with store.claim("t", "x", 2, timeout=0) as again:  # released rows come back at once
        assert len(again) == 2
    assert store.stats()["rows_acked"] == 2
    assert store.stats()["live_rows"] == 0


def test_partial_acks_then_exit_acks_the_rest(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [1, 2, 3]})
    with store.claim("t", "x", 3, timeout=1) as batch:
        batch.ack(batch.indexes[:1])
    assert store.stats()["rows_acked"] == 3


def test_a_put_that_acks_a_batch_writes_its_results_and_commits_the_rows(store: af.Store) -> None:
    store.register_task("t")
    store.register_task("later")  # (which keeps the rows once "t" acked them)
    store.put({"x": [1, 2, 3]})
    with store.claim("t", "x", 3, timeout=1) as batch:
        store.put({"y": np.array([4, 5, 6])}, indexes=batch.indexes, ack=batch)
        # Acked: nothing is left for the context manager to settle (an ack again would raise).
    assert store.stats()["rows_acked"] == 3
    assert [int(v) for v in store.read(batch.indexes, "y")["y"]] == [4, 5, 6]
    assert len(store.claim("t", "x", 3, timeout=0, allow_partial=True)) == 0
    # New rows elsewhere, and the rows they came from acked, in one call.
    store.put({"x": [7]})
    source = store.claim("t", "x", 1, timeout=1)
    new = store.put({"x": [8, 9]}, partition="next", ack=source)
    assert store.rows(new).partitions == ["next", "next"]
    assert store.stats()["rows_acked"] == 4
    # An empty batch holds no lease: the put alone.
    empty = store.claim("t", "x", 1, timeout=0, allow_partial=True, partition="none")
    assert len(store.put({"x": [10]}, partition="none", ack=empty)) == 1


def test_a_put_that_fails_acks_nothing_and_an_ack_that_fails_leaves_the_put(
    store: af.Store,
) -> None:
    store.register_task("t")
    store.put({"x": [1, 2]})
    batch = store.claim("t", "x", 2, timeout=1)
    # A put refused (one value for two rows): the lease still holds its rows, unacked.
    with pytest.raises(af.SchemaError):
        store.put({"y": np.array([1.0])}, indexes=batch.indexes, ack=batch)
    assert store.stats()["rows_acked"] == 0
    assert len(store.claim("t", "x", 2, timeout=0, allow_partial=True)) == 0
    # A batch claimed from another store is refused before anything is written.
    other = af.Store()
    other.register_task("t")
    other.put({"x": [1]})
    foreign = other.claim("t", "x", 1, timeout=1)
    with pytest.raises(af.BadRequestError, match="another store"):
        store.put({"z": np.array([1, 2])}, indexes=batch.indexes, ack=foreign)
    assert store.ready_fields(batch.indexes) == [["x"], ["x"]]
    batch.ack()
    # Its lease ended: the put is in, the ack refused, as a put and then an ack would be.
    store.put({"x": [3]})
    late = store.claim("t", "x", 1, timeout=1)
    late.ack()
    row = store.put({"x": [4]})
    with pytest.raises(af.LeaseError):
        store.put({"w": np.array([5])}, indexes=row, ack=late.lease)
    assert [int(v) for v in store.read(row, "w")["w"]] == [5]


def test_claim_options_filter_by_partition_version_and_group(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [0, 0]}, partition="old", version=1)
    new = store.put({"x": [1, 1]}, partition="new", version=2)
    assert list(store.claim("t", "x", 2, partition="new", timeout=1).indexes) == list(new)

    store.register_task("v")
    assert list(store.claim("v", "x", 2, min_version=2, timeout=1).indexes) == list(new)

    store.register_task("g")
    g = store.put({"x": [5, 5, 5]}, groups=[9, 9, 9])
    batch = store.claim("g", "x", 3, partition="default", whole_groups=True, timeout=1)
    assert list(batch.indexes) == list(g)
    assert list(batch.groups) == [9, 9, 9]


def test_a_group_is_not_delivered_until_its_declared_size_is_reached(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [1, 1]}, groups=[4, 4], group_size=3)
    assert len(store.claim("t", "x", 3, whole_groups=True, timeout=0, allow_partial=True)) == 0
    store.put({"x": [1]}, groups=[4], group_size=3)
    assert len(store.claim("t", "x", 3, whole_groups=True, timeout=1)) == 3


def test_timeouts_raise_or_return_what_is_ready(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [1]})
    with pytest.raises(af.TimeoutError) as err:
        store.claim("t", ["x", "never_written"], 1, timeout=0.05)
    assert isinstance(err.value, TimeoutError) and isinstance(err.value, af.StoreError)
    assert "never_written" in str(err.value)
    batch = store.claim("t", "x", 5, timeout=0.05, allow_partial=True)
    assert len(batch) == 1


def test_after_partial_after_a_claim_takes_part_of_a_batch_but_waits_on_for_a_first_row(
    store: af.Store,
) -> None:
    store.register_task("t")
    settle = {"allow_partial": True, "partial_after": 0.05}
    # Nothing ready: it waits to its deadline, then returns nothing.
    started = time.monotonic()
    assert len(store.claim("t", "x", 5, timeout=0.3, **settle)) == 0
    assert time.monotonic() - started >= 0.3
    # Part of a batch ready: taken long before the deadline (60 s) is reached.
    store.put({"x": [1, 2]})
    started = time.monotonic()
    assert len(store.claim("t", "x", 5, timeout=60, **settle)) == 2
    assert time.monotonic() - started < 30
    # A row that comes while the claim waits is taken at once.
    late = threading.Timer(0.2, lambda: store.put({"x": [3]}))
    late.start()
    started = time.monotonic()
    assert len(store.claim("t", "x", 5, timeout=60, **settle)) == 1
    assert time.monotonic() - started < 30
    late.join()


@pytest.mark.parametrize(
    "options",
    [{"partial_after": 0.1}, {"partial_after": -1, "allow_partial": True}],
)
def test_partial_after_needs_allow_partial_and_a_number_of_seconds(
    store: af.Store, options: dict[str, Any]
) -> None:
    store.register_task("t")
    store.put({"x": [1]})
    with pytest.raises(af.BadRequestError, match="partial_after"):
        store.claim("t", "x", 2, timeout=0, **options)
    assert len(store.claim("t", "x", 2, timeout=0, allow_partial=True)) == 1


def test_partial_after_is_not_for_a_claim_shared_by_a_step(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [1]})
    with pytest.raises(af.BadRequestError, match="partial_after"):
        store.claim("t", "x", 2, timeout=0, allow_partial=True, partial_after=0, step=0)


def test_an_expired_lease_is_redelivered_and_its_late_ack_changes_nothing(
    store: af.Store,
) -> None:
    store.register_task("t")
    store.put({"x": [1, 2]})
    first = store.claim("t", "x", 2, timeout=1)
    # The fixture's leases last 30 s: the first one is cut to end a second from now, and the next
    # claim waits (up to 30 s) until it has, while every other step has 30 s to spare.
    first.renew(1.0)
    again = store.claim("t", "x", 2, timeout=30)
    assert list(again.indexes) == list(first.indexes)
    before = store.stats()
    with pytest.raises(af.LeaseError, match="expired"):
        store.ack(first)
    assert store.stats()["rows_acked"] == before["rows_acked"]
    store.ack(again)
    with pytest.raises(af.LeaseError):
        store.ack(again)
    # The rows are freed now: the first holder, reading late, hears that its lease ended.
    with pytest.raises(af.LeaseError, match="lease ended"):
        first.read()


def test_reading_rows_after_acking_them_says_the_batch_acked_them(store: af.Store) -> None:
    store.register_task("t")
    store.put({"x": [1, 2]})
    batch = store.claim("t", "x", 2, timeout=1)
    batch.ack()
    with pytest.raises(af.LeaseError, match="this batch acked them") as err:
        batch.read()
    assert "expired" not in str(err.value)


def test_renew_extends_a_lease(make_store: af.Store) -> None:
    store = make_store(lease_timeout=3.0)  # type: ignore[operator]
    store.register_task("t")
    store.put({"x": [1]})
    batch = store.claim("t", "x", 1, timeout=1)
    assert batch.renew(60.0) > 50
    # Waits until well past the first deadline: the renewed lease still holds the row.
    assert len(store.claim("t", "x", 1, timeout=5.0, allow_partial=True)) == 0
    batch.ack()


def test_rows_are_freed_when_every_task_acked_or_the_partition_is_cleared(store: af.Store) -> None:
    store.register_task("a")
    store.register_task("b")
    store.put({"x": [1, 2]}, partition="p")
    store.claim("a", "x", 2, timeout=1).ack()
    assert store.stats()["live_rows"] == 2
    store.claim("b", "x", 2, timeout=1).ack()
    assert store.stats()["live_rows"] == 0
    store.put({"x": [3]}, partition="q")
    assert store.clear("q") == 1
    assert store.stats()["memory_used"] == 0


def test_pinned_partitions_are_kept_until_cleared(store: af.Store) -> None:
    store.register_task("t")
    idx = store.put({"w": [np.ones(8)]}, partition="__weights__", version=5)
    store.claim("t", "w", 1, timeout=1).ack()
    rows = store.rows(partition="__weights__")
    assert list(rows.indexes) == list(idx) and list(rows.versions) == [5]
    store.delete(idx)
    assert len(store.rows(partition="__weights__")) == 0


def test_row_metadata_is_reported(store: af.Store) -> None:
    idx = store.put(
        {"x": [1, 2]}, partition="step-3", groups=[7, 7], version=[3, 4], tags={"src": "gsm"}
    )
    rows = store.rows(idx)
    assert rows.partitions == ["step-3", "step-3"]
    assert list(rows.groups) == [7, 7] and list(rows.versions) == [3, 4]
    assert rows.tags == [{"src": "gsm"}, {"src": "gsm"}]


def test_a_put_waits_for_memory_then_fails_with_memory_limit_error(make_store: af.Store) -> None:
    store = make_store(memory_limit=4096)  # type: ignore[operator]
    store.register_task("t")
    store.put({"x": [np.zeros(3000, dtype=np.uint8)]})
    with pytest.raises(af.MemoryLimitError):
        store.put({"x": [np.zeros(3000, dtype=np.uint8)]}, timeout=0.05)
    with pytest.raises(af.MemoryLimitError, match="never"):
        store.put({"x": [np.zeros(5000, dtype=np.uint8)]})
    assert store.stats()["live_rows"] == 1


def test_async_twins_interleave_with_asyncio(store: af.Store) -> None:
    store.register_task("t")

    async def main() -> list[int]:
        consumer = asyncio.create_task(store.claim_async("t", "x", 2, timeout=5))
        await asyncio.sleep(0.05)
        await store.put_async({"x": [10, 20]})
        batch = await consumer
        values = [int(v) for v in batch.read()["x"]]
        await store.ack_async(batch)
        return values

    assert asyncio.run(main()) == [10, 20]
    assert store.stats()["rows_acked"] == 2


def test_a_cancelled_async_claim_hands_back_the_rows_its_thread_leased(store: af.Store) -> None:
    # The claim runs on in its thread after its caller is cancelled: the rows it then leased
    # were held by nobody until the lease ran out (30 s by default).
    store.register_task("t")

    async def main() -> list[int]:
        await store.put_async({"x": [10, 20]})
        abandoned = asyncio.create_task(store.claim_async("t", "x", 2, timeout=30))
        await asyncio.sleep(0)  # its claim is on its way in its thread
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        batch = await store.claim_async("t", "x", 2, timeout=20)
        values = sorted(int(v) for v in batch.read()["x"])
        await store.ack_async(batch)
        return values

    assert asyncio.run(main()) == [10, 20]
    assert store.stats()["rows_acked"] == 2


def test_stats_report_fields_tasks_and_transport(store: af.Store, transport: str) -> None:
    store.register_task("t")
    store.put({"x": [1, 2]}, partition="p")
    s = store.stats()
    assert s["transport"] == transport
    assert s["fields"]["x"][1] == 2
    assert s["tasks"]["t"] == (0, 0)
    assert s["partitions"] == {"p": 2}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("512MB", 512_000_000),
        ("1.5KiB", 1536),
        (1024, 1024),
        (None, None),
        # As YAML spells integers (a config's text setting keeps them as written).
        ("4_000_000_000", 4_000_000_000),
        ("0x4000000", 1 << 26),
        ("0o10", 8),
    ],
)
def test_sizes_are_parsed(text: str | int | None, expected: int | None) -> None:
    assert af.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "0x", "0o9", "_"])
def test_bad_sizes_are_rejected(text: str) -> None:
    with pytest.raises(af.BadRequestError):
        af.parse_size(text)


def test_a_scoped_task_claims_and_retains_only_its_partitions(store: af.Store) -> None:
    store.register_task("rollout", partitions=["prompts"])
    store.register_task("train", partitions=["step-"])
    store.put({"x": [1]}, partition="prompts")
    sample = store.put({"x": [2]}, partition="step-0")
    with store.claim("rollout", "x", 2, timeout=0, allow_partial=True) as batch:
        assert len(batch) == 1
    assert store.stats()["live_rows"] == 1, "prompt rows need only the rollout's ack"
    assert list(store.claim("train", "x", 2, timeout=0, allow_partial=True).indexes) == list(sample)
    with pytest.raises(af.BadRequestError):
        store.register_task("train")


def test_zero_dimensional_arrays_are_scalar_cells(store: af.Store) -> None:
    idx = store.put({"t": [np.asarray(5, np.int64), np.asarray(6, np.int64)]})
    assert store.schema("t") == ("i64", None)
    assert [v.shape for v in store.read(idx, "t")["t"]] == [(), ()]


def test_rows_of_one_array_cost_their_bytes_on_every_store(store: af.Store) -> None:
    """A daemon kept each row of a put on a 64-byte boundary: a scalar cost 16 times its bytes
    against the same memory limit that an embedded store counts bytes for."""
    before = store.stats()["memory_used"]
    store.put({"reward": np.zeros(1000, np.float32), "ids": np.zeros((1000, 16), np.int32)})
    data = 1000 * 4 + 1000 * 16 * 4
    # At most a boundary's padding before each column.
    assert data <= store.stats()["memory_used"] - before <= data + 2 * 64
