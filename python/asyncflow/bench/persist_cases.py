"""What ``--data-dir`` costs a put: ``shm/<size>`` ``put_throughput`` (GB/s of puts alone, each
round's partition cleared outside the timing) against a daemon with a data directory under each
``--fsync`` policy, with the same daemon and workload without one as the baseline
(``no-data-dir``), measured in the same run."""

from __future__ import annotations

import tempfile
import time

import asyncflow as af
from asyncflow.bench.records import Report
from asyncflow.bench.workload import Rounds, best_of
from asyncflow.daemon import DaemonProcess

POLICIES = ("always", "20ms", "never")
#: The log is never replaced by a snapshot while measuring.
NO_SNAPSHOT = ("--compact-after", "64GiB")


def put_seconds(store: af.Store, work: Rounds) -> float:
    """Seconds spent in puts of ``work``; each round is cleared afterwards, untimed."""
    spent = 0.0
    for _ in range(work.rounds):
        t0 = time.perf_counter()
        store.put({"payload": work.block}, partition="bench")
        spent += time.perf_counter() - t0
        store.clear("bench")
    return spent


def throughput(flags: tuple[str, ...], work: Rounds, repeats: int) -> float:
    with DaemonProcess("--shards", "8", *flags) as daemon:
        store = af.connect(daemon.url, transport="shm")
        return work.moved / best_of(repeats, lambda: put_seconds(store, work)) / 1e9


def run(report: Report, sizes: dict[str, int], quick: bool) -> None:
    repeats = 2 if quick else 3
    for label in ("64KiB", "1MiB", "16MiB"):
        work = Rounds.of(sizes[label], quick)
        report.progress(f"shm/{label}: puts without a data directory (baseline)")
        base = throughput((), work, repeats)
        for policy in POLICIES:
            report.progress(f"shm/{label}: puts with --data-dir, --fsync {policy}")
            with tempfile.TemporaryDirectory(prefix="af-bench-wal-") as root:
                flags = ("--data-dir", root, "--fsync", policy, *NO_SNAPSHOT)
                value = throughput(flags, work, repeats)
            report.add(
                f"shm/{label}", f"put_throughput_fsync_{policy}", value, "GB/s",
                "no-data-dir", base,
            )  # fmt: skip
