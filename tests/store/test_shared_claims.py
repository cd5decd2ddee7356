"""Shared claims from Python: data-parallel ranks and replica peers as threads on one store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import asyncflow as af

DP = 4
PEERS = 2


def put_sequences(store: af.Store, lengths: list[int]) -> np.ndarray:
    return store.put({"ids": [np.ones(n, np.int64) for n in lengths], "adv": [0.5] * len(lengths)})


def run_threads(target: Callable[..., Any], args: list[tuple[Any, ...]]) -> None:
    threads = [threading.Thread(target=target, args=a) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()


def test_ranks_in_threads_get_disjoint_token_balanced_parts_of_one_batch(store: af.Store) -> None:
    store.register_task("train")
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.clip(rng.lognormal(6, 1, 64), 1, 8000)]
    idx = put_sequences(store, lengths)
    parts: dict[int, af.Batch] = {}

    def rank(r: int) -> None:
        parts[r] = store.claim(
            "train", ["ids", "adv"], 64, timeout=10, step=0, dp_rank=r, dp_size=DP
        )

    run_threads(rank, [(r,) for r in range(DP)])
    claimed = np.concatenate([parts[r].indexes for r in range(DP)])
    assert sorted(claimed) == sorted(idx), "the ranks' parts are the step's batch, once each"
    # Rank r gets exactly part r of what the partitioner makes of the batch's lengths.
    expected = af.scheduler.partition(lengths, DP)
    for r in range(DP):
        assert list(parts[r].indexes) == [idx[i] for i in expected[r]]
    tokens = [int(parts[r].lengths("ids").sum()) for r in range(DP)]
    assert max(tokens) <= max(sum(lengths) / DP * 1.02, *lengths), tokens
    for r in range(DP):
        parts[r].ack()
    assert store.stats()["live_rows"] == 0


def test_replica_peers_in_threads_see_identical_rows_committed_after_all_ack(
    store: af.Store,
) -> None:
    store.register_task("train")
    idx = put_sequences(store, [3, 1, 4, 1, 5, 9, 2, 6])
    got: dict[tuple[int, int], af.Batch] = {}

    def peer(r: int, p: int) -> None:
        got[r, p] = store.claim(
            "train",
            "ids",
            8,
            timeout=10,
            step=3,
            dp_rank=r,
            dp_size=2,
            replica_rank=p,
            replica_size=PEERS,
        )

    run_threads(peer, [(r, p) for r in range(2) for p in range(PEERS)])
    for r in range(2):
        assert list(got[r, 0].indexes) == list(got[r, 1].indexes)
    for r in range(2):
        got[r, 0].ack()
    assert store.stats()["live_rows"] == len(idx), "one peer's ack commits nothing"
    for r in range(2):
        got[r, 1].ack()
    assert store.stats()["live_rows"] == 0


def test_a_peer_acking_twice_raises_lease_error(store: af.Store) -> None:
    store.register_task("train")
    put_sequences(store, [1, 2])
    batch = store.claim("train", "ids", 2, timeout=1, step=0, replica_rank=0, replica_size=2)
    batch.ack()
    with pytest.raises(af.LeaseError):
        store.ack(batch.lease)  # type: ignore[arg-type]


def test_the_context_manager_acks_a_shared_part(store: af.Store) -> None:
    store.register_task("train")
    put_sequences(store, [1, 2, 3, 4])
    for r in range(2):
        with store.claim("train", "ids", 4, timeout=1, step=0, dp_rank=r, dp_size=2) as batch:
            assert len(batch) == 2
    assert store.stats()["live_rows"] == 0


def test_a_release_by_one_peer_hands_the_part_back_for_all(store: af.Store) -> None:
    store.register_task("train")
    idx = put_sequences(store, [1, 2])
    first = store.claim("train", "ids", 2, timeout=1, step=0, replica_rank=0, replica_size=2)
    second = store.claim("train", "ids", 2, timeout=1, step=0, replica_rank=1, replica_size=2)
    first.release()
    with pytest.raises(af.LeaseError):
        second.ack()
    assert sorted(store.claim("train", "ids", 2, timeout=1).indexes) == sorted(idx)


def test_an_expired_part_is_delivered_again_and_its_late_rank_is_refused(
    make_store: Callable[..., af.Store],
) -> None:
    store = make_store(lease_timeout=3.0)
    store.register_task("train")
    put_sequences(store, [5, 5, 5, 5])
    early = store.claim("train", "ids", 4, timeout=1, step=0, dp_rank=0, dp_size=2)
    early.ack()
    # Waits (up to 30 s) until rank 1's part, never claimed, expires and is delivered again.
    again = store.claim("train", "ids", 2, timeout=30)
    assert not set(again.indexes) & set(early.indexes), "the committed part stays committed"
    with pytest.raises(af.LeaseError, match="expired"):
        store.claim("train", "ids", 4, timeout=1, step=0, dp_rank=1, dp_size=2)


def test_an_ended_step_is_never_claimed_afresh(store: af.Store) -> None:
    store.register_task("train")
    put_sequences(store, [1, 1, 1, 1])
    store.claim("train", "ids", 2, timeout=1, step=7).ack()
    with pytest.raises(af.LeaseError):
        store.claim("train", "ids", 2, timeout=1, step=7)
    assert len(store.claim("train", "ids", 2, timeout=1, step=8)) == 2


def test_callers_of_one_step_must_agree_on_its_options(store: af.Store) -> None:
    store.register_task("train")
    put_sequences(store, [1, 1, 1, 1])
    store.claim("train", "ids", 4, timeout=1, step=0, dp_rank=0, dp_size=2)
    with pytest.raises(af.BadRequestError):
        store.claim("train", "ids", 4, timeout=1, step=0, dp_rank=1, dp_size=4)


def test_sharing_options_without_a_step_are_a_bad_request(store: af.Store) -> None:
    store.register_task("train")
    with pytest.raises(af.BadRequestError):
        store.claim("train", "ids", 4, timeout=0, dp_rank=1, dp_size=2)


def test_whole_groups_keep_each_grpo_group_on_one_rank(store: af.Store) -> None:
    store.register_task("train")
    lengths = [900, 10, 20, 30, 800, 40, 50, 60]
    store.put({"ids": [np.ones(n, np.int64) for n in lengths]}, groups=[0, 0, 1, 1, 2, 2, 3, 3])
    parts = [
        store.claim("train", "ids", 8, timeout=1, step=0, dp_rank=r, dp_size=2, whole_groups=True)
        for r in range(2)
    ]
    assert not set(parts[0].groups) & set(parts[1].groups)
    assert sum(len(p) for p in parts) == 8
