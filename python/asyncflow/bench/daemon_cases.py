"""``tcp/*`` and ``shm/*``: the store suite's workload against a daemon in another process.

- ``throughput``: over TCP against ``native-echo``, a pipelined native loopback echo moving the
  same bytes to another process and back (see ``echo.py``) — the store sends each byte to the
  daemon and reads it back, so both sides cross the socket twice; over shared memory against
  ``memcpy`` of the same bytes (a put copies once into shared memory, a read views it in place).
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
    latency_samples,
    memcpy_seconds,
    repeats,
    store_seconds,
)
from asyncflow.daemon import DaemonProcess


def one_size(report: Report, label: str, size: int, quick: bool, echo: EchoPeer) -> None:
    times = repeats(quick)
    work = Rounds.of(size, quick)
    with DaemonProcess("--shards", "8") as daemon:
        tcp = af.connect(daemon.url, transport="tcp")
        shm = af.connect(daemon.url, transport="shm")
        report.progress(f"tcp/{label}: put+claim+read+ack vs a native pipelined echo")
        native = best_of(times, lambda: echo.round_trips(work.block, work.rounds))
        ours = best_of(times, lambda: store_seconds(tcp, work))
        report.add(
            f"tcp/{label}", "throughput", work.moved / ours / 1e9, "GB/s",
            "native-echo", work.moved / native / 1e9,
        )  # fmt: skip
        report.progress(f"shm/{label}: put+claim+read+ack vs memcpy")
        memcpy = best_of(times, lambda: memcpy_seconds(work))
        ours = best_of(times, lambda: store_seconds(shm, work))
        report.add(
            f"shm/{label}", "throughput", work.moved / ours / 1e9, "GB/s",
            "memcpy", work.moved / memcpy / 1e9,
        )  # fmt: skip
        report.progress(f"{label}: claim latency, daemon vs embedded")
        samples = latency_samples(quick)
        base50, base99 = claim_latencies(af.Store(shards=8), size, samples)
        for transport, store in (("tcp", tcp), ("shm", shm)):
            p50, p99 = claim_latencies(store, size, samples)
            report.add(f"{transport}/{label}", "claim_p50", p50, "us", "inproc", base50)
            report.add(f"{transport}/{label}", "claim_p99", p99, "us", "inproc", base99)


def run(report: Report, sizes: dict[str, int], quick: bool) -> None:
    with EchoPeer() as echo:
        for label, size in sizes.items():
            one_size(report, label, size, quick, echo)
