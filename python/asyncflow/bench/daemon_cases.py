"""``tcp/*`` and ``shm/*``: the store suite's workload against a daemon in another process.

- ``throughput``: over TCP against a raw loopback socket moving the same bytes to another
  process and back (``socket``, see ``echo.py``) — the store sends each byte to the daemon and
  reads it back, so both sides cross the socket twice; over shared memory against ``memcpy`` of
  the same bytes (a put copies once into shared memory, a read views it in place).
- ``claim_p50`` / ``claim_p99`` (µs): one claim of up to 64 rows of that size, against the same
  claim on an embedded store (``inproc``): the price of the round trip.

A fresh daemon serves each size, so no size inherits another's rows.
"""

from __future__ import annotations

import asyncflow as af
from asyncflow.bench.echo import EchoPeer
from asyncflow.bench.records import Report
from asyncflow.bench.workload import (
    Rounds,
    best_of,
    claim_latencies,
    memcpy_seconds,
    store_seconds,
)
from asyncflow.daemon import DaemonProcess


def one_size(report: Report, label: str, size: int, quick: bool, echo: EchoPeer) -> None:
    repeats = 2 if quick else 3
    work = Rounds.of(size, quick)
    with DaemonProcess("--shards", "8") as daemon:
        tcp = af.connect(daemon.url, transport="tcp")
        shm = af.connect(daemon.url, transport="shm")
        report.progress(f"tcp/{label}: put+claim+read+ack vs a raw socket round trip")
        socket = best_of(repeats, lambda: echo.round_trips(work.block, work.rounds))
        ours = best_of(repeats, lambda: store_seconds(tcp, work))
        report.add(
            f"tcp/{label}", "throughput", work.moved / ours / 1e9, "GB/s",
            "socket", work.moved / socket / 1e9,
        )  # fmt: skip
        report.progress(f"shm/{label}: put+claim+read+ack vs memcpy")
        memcpy = best_of(repeats, lambda: memcpy_seconds(work))
        ours = best_of(repeats, lambda: store_seconds(shm, work))
        report.add(
            f"shm/{label}", "throughput", work.moved / ours / 1e9, "GB/s",
            "memcpy", work.moved / memcpy / 1e9,
        )  # fmt: skip
        report.progress(f"{label}: claim latency, daemon vs embedded")
        samples = 200 if quick else 2000
        base50, base99 = claim_latencies(af.Store(shards=8), size, samples)
        for transport, store in (("tcp", tcp), ("shm", shm)):
            p50, p99 = claim_latencies(store, size, samples)
            report.add(f"{transport}/{label}", "claim_p50", p50, "us", "inproc", base50)
            report.add(f"{transport}/{label}", "claim_p99", p99, "us", "inproc", base99)


def run(report: Report, sizes: dict[str, int], quick: bool) -> None:
    echo = EchoPeer()
    try:
        for label, size in sizes.items():
            one_size(report, label, size, quick, echo)
    finally:
        echo.close()
