"""``scale/*``: one daemon holding many rows while many clients claim from it at once.

- ``metadata_per_row`` (B): how much the daemon's resident memory grew holding ``ROWS`` rows of
  one 4-byte field, less those 4 bytes, per row; beside the payload's bytes per row.
- ``claim_p50`` / ``claim_p99`` (µs): 64-row claims, each batch released so the resident count
  stays fixed, by ``CLAIMERS`` concurrent claimers (processes of threads, each thread with a
  connection of its own, over shared memory) with ``ROWS`` rows resident; against the same
  claimers with 8 K rows resident (room for every claimer's batch at once, twice over).
- ``put_rows`` (M rows/s): puts of 64 K one-field rows into the daemon holding ``ROWS`` rows,
  against the same puts into a daemon holding 8 K.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import numpy as np

import asyncflow as af
from asyncflow.bench.records import Report
from asyncflow.bench.workload import CLAIM_BATCH
from asyncflow.daemon import DaemonProcess

ROWS = 10_000_000
QUICK_ROWS = 100_000
BASELINE_ROWS = 8_192
PROCESSES = 8
THREADS = 8
CLAIMERS = PROCESSES * THREADS
PUT_CHUNK = 1 << 16
TASK = "scale"


def _rss(pid: int) -> int:
    with Path(f"/proc/{pid}/status").open() as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fill(store: af.Store, rows: int, partition: str = "p") -> float:
    """Puts ``rows`` one-field rows in chunks; returns the seconds it took."""
    t0 = time.perf_counter()
    for start in range(0, rows, PUT_CHUNK):
        n = min(PUT_CHUNK, rows - start)
        store.put({"x": np.zeros(n, dtype=np.float32)}, partition=partition)
    return time.perf_counter() - t0


def _claimer_process(url: str, claims: int, threads: int) -> list[float]:
    """One process's threads claiming and releasing; their latencies in seconds. A claim that
    comes back short fails the run."""
    stores = [af.connect(url, transport="shm") for _ in range(threads)]
    latencies: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads)

    def run(k: int) -> None:
        start.wait()
        for _ in range(claims):
            t0 = time.perf_counter()
            batch = stores[k].claim(TASK, "x", CLAIM_BATCH, timeout=10)
            latencies[k].append(time.perf_counter() - t0)
            if len(batch) != CLAIM_BATCH:
                raise RuntimeError(f"a claim of {CLAIM_BATCH} rows got {len(batch)}")
            batch.release()

    running = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join()
    got = [x for per_thread in latencies for x in per_thread]
    if len(got) != claims * threads:
        raise RuntimeError(f"{claims * threads - len(got)} claims did not finish")
    return got


def _concurrent_claims(
    url: str, claims: int, processes: int = PROCESSES, threads: int = THREADS
) -> tuple[float, float]:
    """p50 and p99 (µs) over every claim of ``processes`` times ``threads`` claimers at once."""
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_claimer_process, [(url, claims, threads)] * processes)
    lat = np.concatenate([np.asarray(p) for p in parts])
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def measure(
    rows: int, claims: int, puts: int, processes: int = PROCESSES, threads: int = THREADS
) -> dict[str, float]:
    """Fills a fresh daemon with ``rows`` rows and measures it; see the module documentation."""
    with DaemonProcess("--shards", "8") as daemon:
        store = af.connect(daemon.url, transport="shm")
        store.register_task(TASK)
        before = _rss(daemon.proc.pid)
        _fill(store, rows)
        grown = _rss(daemon.proc.pid) - before
        p50, p99 = _concurrent_claims(daemon.url, claims, processes, threads)
        seconds = _fill(store, puts * PUT_CHUNK, partition="more")
        return {
            "metadata_per_row": grown / rows - 4,
            "claim_p50": p50,
            "claim_p99": p99,
            "put_rows": puts * PUT_CHUNK / seconds / 1e6,
        }


def run(report: Report, quick: bool) -> None:
    rows = QUICK_ROWS if quick else ROWS
    claims = 50 if quick else 500
    puts = 4 if quick else 16
    label = f"scale/{rows // 1000}K" if rows < 1_000_000 else f"scale/{rows // 1_000_000}M"
    report.progress(f"{label}: {CLAIMERS} claimers and 64K-row puts with 8K resident rows")
    base = measure(BASELINE_ROWS, claims, puts)
    report.progress(f"{label}: the same with {rows} resident rows")
    big = measure(rows, claims, puts)
    report.add(label, "metadata_per_row", big["metadata_per_row"], "B", "payload", 4.0)
    for metric, unit in (("claim_p50", "us"), ("claim_p99", "us"), ("put_rows", "M rows/s")):
        report.add(label, metric, big[metric], unit, "8K-resident", base[metric])
