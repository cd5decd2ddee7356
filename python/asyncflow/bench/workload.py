"""The store suite's one workload, run the same way on every store: rows of one size are put,
claimed, read and acked in rounds, and the payload bytes moved per second are reported."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import asyncflow as af

CLAIM_BATCH = 64


def repeats(quick: bool) -> int:
    """Timings of each throughput case, ours and every baseline's alike."""
    return 2 if quick else 3


def latency_samples(quick: bool) -> int:
    """Claims (or a peer's hand-offs) timed for each latency percentile, ours and peers' alike."""
    return 200 if quick else 2000


def best_of(repeats: int, fn: Callable[[], float]) -> float:
    """The fastest of ``repeats`` timings (seconds): the least disturbed by a noisy machine."""
    return min(fn() for _ in range(repeats))


@dataclass(frozen=True)
class Rounds:
    """``rounds`` puts of ``block`` (``rows`` rows of ``size`` bytes each)."""

    block: np.ndarray
    rounds: int

    @classmethod
    def of(cls, size: int, quick: bool) -> Rounds:
        rows = max(1, min(256, (4 << 20) // size))
        volume = (64 << 20) if quick else (512 << 20)
        rounds = max(4, volume // (rows * size))
        block = np.random.default_rng(0).integers(0, 255, (rows, size), dtype=np.uint8)
        return cls(block, rounds)

    @property
    def rows(self) -> int:
        return int(self.block.shape[0])

    @property
    def moved(self) -> int:
        return self.rounds * self.block.nbytes


def store_seconds(store: af.Store, work: Rounds) -> float:
    """Seconds for the rounds of put + claim + read + ack on ``store`` (task ``bench``)."""
    store.register_task("bench")
    t0 = time.perf_counter()
    for _ in range(work.rounds):
        store.put({"payload": work.block}, partition="bench")
        batch = store.claim("bench", "payload", work.rows, timeout=30)
        batch.read()
        batch.ack()
    return time.perf_counter() - t0


def memcpy_seconds(work: Rounds) -> float:
    """Seconds to copy the same bytes into a warm buffer, once per round."""
    dst = np.empty_like(work.block)
    t0 = time.perf_counter()
    for _ in range(work.rounds):
        np.copyto(dst, work.block)
    return time.perf_counter() - t0


def claim_latencies(store: af.Store, size: int, samples: int) -> tuple[float, float]:
    """p50 and p99 (µs) of one claim of up to 64 rows of ``size`` bytes, each batch released so
    the same rows stay resident."""
    rows = max(1, min(256, (256 << 20) // size))
    store.register_task("latency")
    store.put({"lat": np.zeros((rows, size), dtype=np.uint8)}, partition="latency")
    p50_p99 = _claim_percentiles(store, "latency", "lat", min(CLAIM_BATCH, rows), samples, 10)
    store.clear("latency")
    return p50_p99


def resident_claim_latencies(
    resident: int, samples: int, store: af.Store | None = None
) -> tuple[float, float]:
    """p50 and p99 (µs) of a 64-row claim with ``resident`` rows in ``store`` (a new embedded
    one by default), which it clears after."""
    store = store if store is not None else af.Store(shards=8)
    store.register_task("bench")
    chunk = 1 << 16
    for start in range(0, resident, chunk):
        n = min(chunk, resident - start)
        store.put({"x": np.zeros(n, dtype=np.float32)}, partition="p")
    p50_p99 = _claim_percentiles(store, "bench", "x", CLAIM_BATCH, samples, 1)
    store.clear("p")
    return p50_p99


def _claim_percentiles(
    store: af.Store, task: str, field: str, batch_size: int, samples: int, timeout: float
) -> tuple[float, float]:
    """p50 and p99 (µs) of ``samples`` claims of ``batch_size`` rows, each released at once."""
    lat = np.empty(samples)
    for i in range(samples):
        t0 = time.perf_counter()
        batch = store.claim(task, field, batch_size, timeout=timeout)
        lat[i] = time.perf_counter() - t0
        batch.release()
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)
