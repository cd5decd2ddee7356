"""``tcp/*`` and ``shm/*``: the store suite's workload against a daemon in another process.

- ``throughput``: over TCP against ``native-echo``, a pipelined native loopback echo moving the
  same bytes to another process and back (see ``echo.py``) — the store sends each byte to the
  daemon and reads it back, so both sides cross the socket twice; over shared memory against
  ``memcpy`` of the same bytes (a put copies once into shared memory, a read views it in place).
- ``claim_p50`` / ``claim_p99`` (µs): one claim of up to 64 rows of that size, against the same
  claim on an embedded store (``inproc``): the price of the round trip.
- ``shm/1M-resident``: claim p50 and p99 of 64 rows with 1 M rows resident, requests and replies
  in shared-memory rings (``shm``), against the same claims with them on the Unix socket
  (``shm-socket``, the path before rings) on the same daemon.

``shm`` is the shared-memory path as clients get it (requests and replies in rings);
``shm-socket`` the same with requests and replies on the Unix socket, measured beside it as the
baseline. A fresh daemon serves each size, so no size inherits another's rows.
"""

from __future__ import annotations

from functools import partial

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
    resident_claim_latencies,
    store_seconds,
)
from asyncflow.daemon import DaemonProcess


def one_size(report: Report, label: str, size: int, quick: bool, echo: EchoPeer) -> None:
    times = repeats(quick)
    work = Rounds.of(size, quick)
    with DaemonProcess("--shards", "8") as daemon:
        tcp = af.connect(daemon.url, transport="tcp")
        shm = af.connect(daemon.url, transport="shm")
        shm_socket = af.connect(daemon.url, transport="shm-socket")
        report.progress(f"tcp/{label}: put+claim+read+ack vs a native pipelined echo")
        native = best_of(times, lambda: echo.round_trips(work.block, work.rounds))
        ours = best_of(times, lambda: store_seconds(tcp, work))
        report.add(
            f"tcp/{label}", "throughput", work.moved / ours / 1e9, "GB/s",
            "native-echo", work.moved / native / 1e9,
        )  # fmt: skip
        report.progress(f"shm/{label}: put+claim+read+ack vs memcpy")
        memcpy = best_of(times, lambda: memcpy_seconds(work))
        for transport, store in (("shm", shm), ("shm-socket", shm_socket)):
            ours = best_of(times, partial(store_seconds, store, work))
            report.add(
                f"{transport}/{label}", "throughput", work.moved / ours / 1e9, "GB/s",
                "memcpy", work.moved / memcpy / 1e9,
            )  # fmt: skip
        report.progress(f"{label}: claim latency, daemon vs embedded")
        samples = latency_samples(quick)
        base50, base99 = claim_latencies(af.Store(shards=8), size, samples)
        for transport, store in (("tcp", tcp), ("shm", shm), ("shm-socket", shm_socket)):
            p50, p99 = claim_latencies(store, size, samples)
            report.add(f"{transport}/{label}", "claim_p50", p50, "us", "inproc", base50)
            report.add(f"{transport}/{label}", "claim_p99", p99, "us", "inproc", base99)


def resident_claims(report: Report, quick: bool) -> None:
    """Claims with 1 M rows resident, over the rings and over the socket, on one daemon."""
    samples = latency_samples(quick)
    with DaemonProcess("--shards", "8") as daemon:
        report.progress("shm/1M-resident: claim latency, rings vs socket")
        on = {t: af.connect(daemon.url, transport=t) for t in ("shm-socket", "shm")}
        socket = resident_claim_latencies(1_000_000, samples, on["shm-socket"])
        rings = resident_claim_latencies(1_000_000, samples, on["shm"])
    report.add("shm/1M-resident", "claim_p50", rings[0], "us", "shm-socket", socket[0])
    report.add("shm/1M-resident", "claim_p99", rings[1], "us", "shm-socket", socket[1])


def run(report: Report, sizes: dict[str, int], quick: bool) -> None:
    with EchoPeer() as echo:
        for label, size in sizes.items():
            one_size(report, label, size, quick, echo)
    resident_claims(report, quick)
