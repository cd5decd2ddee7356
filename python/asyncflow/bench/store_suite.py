"""The ``store`` suite: data movement and index speed of the store.

- ``throughput`` (GB/s): put + claim + read + ack of rows of each size, against ``memcpy`` of the
  same bytes into a warm buffer (NumPy ``copyto``) in the same run.
- ``claim_p50`` / ``claim_p99`` (µs): one claim of 64 rows, from Python, with 1 M rows resident,
  against the same claim with 1 K rows resident (how latency scales with the table). Each claimed
  batch is released, so the resident count stays fixed.
- ``ready_updates`` (per s): field-ready updates from batched fills of existing rows, against a
  pure-Python set-based readiness index doing the same bookkeeping.
- ``put_throughput_fsync_*`` (GB/s): puts to a daemon with ``--data-dir`` under each fsync
  policy, against the same puts without one (see ``persist_cases.py``).
- ``scale/*``: a daemon's metadata bytes per resident row, and claim latency and put rate with
  10 M rows resident and 64 concurrent claimers (see ``scale_cases.py``).
"""

from __future__ import annotations

import time

import numpy as np

import asyncflow as af
from asyncflow.bench import daemon_cases, peer_cases, persist_cases, scale_cases
from asyncflow.bench.records import Report
from asyncflow.bench.workload import (
    Rounds,
    best_of,
    memcpy_seconds,
    repeats,
    resident_claim_latencies,
    store_seconds,
)

SIZES = {"1KiB": 1 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}


def throughput(report: Report, label: str, size: int, quick: bool) -> None:
    work = Rounds.of(size, quick)
    times = repeats(quick)
    base = work.moved / best_of(times, lambda: memcpy_seconds(work)) / 1e9
    store = af.Store(shards=8)
    value = work.moved / best_of(times, lambda: store_seconds(store, work)) / 1e9
    report.add(f"inproc/{label}", "throughput", value, "GB/s", "memcpy", base)


def ready_updates(quick: bool) -> tuple[float, float]:
    """Field-ready updates per second: ours, and a pure-Python set index."""
    rows = 1 << 16
    rounds = 4 if quick else 16
    store = af.Store(shards=8)
    idx = store.put({"x": np.zeros(rows, dtype=np.float32)})
    values = np.ones(rows, dtype=np.float32)

    def ours() -> float:
        t0 = time.perf_counter()
        for k in range(rounds):
            store.put({f"f{k}": values}, indexes=idx)
        return time.perf_counter() - t0

    ready: dict[str, set[int]] = {}
    py_idx = [int(i) for i in idx]

    def python_sets() -> float:
        ready.clear()
        t0 = time.perf_counter()
        for k in range(rounds):
            bucket = ready.setdefault(f"f{k}", set())
            for i in py_idx:
                bucket.add(i)
        return time.perf_counter() - t0

    n = rows * rounds
    return n / best_of(2, ours), n / best_of(2, python_sets)


def run(report: Report, quick: bool = False) -> None:
    for label, size in SIZES.items():
        report.progress(f"inproc/{label}: put+claim+read+ack vs memcpy")
        throughput(report, label, size, quick)

    samples = 500 if quick else 5000
    report.progress("claim latency with 1K resident rows (baseline)")
    base50, base99 = resident_claim_latencies(1 << 10, samples)
    report.progress("claim latency with 1M resident rows")
    p50, p99 = resident_claim_latencies(1_000_000, samples)
    report.add("inproc/1KiB", "claim_p50", p50, "us", "1K-resident", base50)
    report.add("inproc/1KiB", "claim_p99", p99, "us", "1K-resident", base99)

    report.progress("field-ready updates from batched fills")
    ours, baseline = ready_updates(quick)
    report.add("inproc/1KiB", "ready_updates", ours, "1/s", "python-set-index", baseline)

    daemon_cases.run(report, SIZES, quick)
    persist_cases.run(report, SIZES, quick)
    peer_cases.run(report, SIZES, quick)
    scale_cases.run(report, quick)
