"""Soak: many clients at once — threads of this process and threads of child processes, each
with its own connection — putting, claiming and acking against one daemon or a controller with
three storage daemons, for a bounded time. Every row carries its proof (see ``faults.py``);
afterwards every row put must have been acked exactly once, no call may have failed, and each
daemon's resident memory must have stayed under its ``--memory-limit``."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import asyncflow as af
from asyncflow.reliability.deployment import Deployment, Kind
from asyncflow.reliability.faults import Outcome, drain, rows_of, spawn, whole

OPS = ("put", "claim", "ack")
BATCH = 8
#: The daemons' lease timeout in the soak (seconds).
LEASE_TIMEOUT = 30


@dataclass
class ClientResult:
    put: list[int] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    errors: list[str] = field(default_factory=list)
    partial: int = 0


def run_client(url: str, client: int, until: float) -> ClientResult:
    """One client: put a batch, claim one, check it, ack it; until the clock says stop."""
    out = ClientResult()
    store = af.connect(url)
    serial = 0
    while time.monotonic() < until:
        ids = [(client << 32) | (serial + k) for k in range(BATCH)]
        serial += BATCH
        try:
            t0 = time.perf_counter()
            store.put(rows_of(ids), partition="soak")
            t1 = time.perf_counter()
            out.put.extend(ids)
            batch = store.claim("t", ["id", "payload"], BATCH, timeout=5.0, allow_partial=True)
            t2 = time.perf_counter()
            if len(batch):
                data = batch.read()
                out.partial += sum(not ok for ok in whole(data["id"], data["payload"]))
                got = [int(i) for i in data["id"]]
                batch.ack()
                out.acked.extend(got)
            t3 = time.perf_counter()
        except af.StoreError as e:
            out.errors.append(f"{type(e).__name__}: {e}")
            continue
        out.latencies["put"].append(t1 - t0)
        out.latencies["claim"].append(t2 - t1)
        if len(batch):
            out.latencies["ack"].append(t3 - t2)
    return out


def _rss_bytes(pid: int) -> int:
    try:
        with Path(f"/proc/{pid}/status").open() as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class SoakResult:
    kind: str
    clients: int
    seconds: float
    rows: int = 0
    lost: int = 0
    duplicated: int = 0
    partial: int = 0
    errors: list[str] = field(default_factory=list)
    ops_per_s: float = 0.0
    p50_ms: dict[str, float] = field(default_factory=dict)
    p99_ms: dict[str, float] = field(default_factory=dict)
    #: Peak resident memory of each daemon, and the limit each ran under.
    peak_rss: dict[str, int] = field(default_factory=dict)
    memory_limit: int = 0

    @property
    def clean(self) -> bool:
        under = all(rss < self.memory_limit for rss in self.peak_rss.values())
        return not (self.lost or self.duplicated or self.partial or self.errors) and under


def soak(
    kind: Kind = "standalone",
    seconds: float = 30.0,
    threads: int = 32,
    processes: int = 8,
    threads_per_process: int = 4,
    memory_limit: str = "512MiB",
) -> SoakResult:
    """``threads`` clients here and ``processes`` times ``threads_per_process`` in children."""
    clients = threads + processes * threads_per_process
    result = SoakResult(kind, clients, seconds, memory_limit=af.parse_size(memory_limit) or 0)
    with Deployment(
        kind, None, "--memory-limit", memory_limit, "--lease-timeout", str(LEASE_TIMEOUT)
    ) as d:
        af.connect(d.url).register_task("t")
        pids = d.pids()
        peaks: Counter[str] = Counter()
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(0.2):
                for name, pid in pids.items():
                    peaks[name] = max(peaks[name], _rss_bytes(pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        until = started + seconds
        until_wall = time.time() + seconds
        children = [
            spawn("soak", d.url, str(threads + k * threads_per_process),
                  str(threads_per_process), str(until_wall))
            for k in range(processes)
        ]  # fmt: skip
        mine: list[ClientResult] = [ClientResult() for _ in range(threads)]

        def run(k: int) -> None:
            mine[k] = run_client(d.url, k, until)

        local = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        for t in local:
            t.start()
        gathered: list[ClientResult] = []
        for c in children:
            out, _ = c.communicate(timeout=seconds + 120)
            gathered.extend(ClientResult(**json.loads(line)) for line in out.splitlines())
        for t in local:
            t.join()
        gathered.extend(mine)
        elapsed = time.monotonic() - started
        sampling.set()
        sampler.join()
        _tally(result, gathered, elapsed, d.url)
        result.peak_rss = dict(peaks)
    return result


def _tally(result: SoakResult, clients: list[ClientResult], elapsed: float, url: str) -> None:
    put: Counter[int] = Counter()
    acked: Counter[int] = Counter()
    latencies: dict[str, list[float]] = {op: [] for op in OPS}
    for c in clients:
        put.update(c.put)
        acked.update(c.acked)
        result.errors.extend(c.errors)
        result.partial += c.partial
        for op in OPS:
            latencies[op].extend(c.latencies[op])
    # Rows put in the last round may still wait, and rows a failed claim leased come again
    # once the lease expires; one more consumer takes them, waiting out the lease timeout.
    outcome = Outcome()
    store = af.connect(url)
    missing = len(set(put) - set(acked))
    leftovers = drain(store, "t", outcome)
    deadline = time.monotonic() + LEASE_TIMEOUT + 5
    while len(set(leftovers)) < missing and time.monotonic() < deadline:
        time.sleep(0.5)
        leftovers.update(drain(store, "t", outcome))
    result.partial += outcome.partial
    acked.update(leftovers)
    result.rows = len(put)
    result.lost = len(set(put) - set(acked))
    result.duplicated = sum(n - 1 for n in acked.values()) + sum(n - 1 for n in put.values())
    calls = sum(len(v) for v in latencies.values())
    result.ops_per_s = calls / elapsed
    for op, values in latencies.items():
        if values:
            result.p50_ms[op] = float(np.percentile(values, 50) * 1e3)
            result.p99_ms[op] = float(np.percentile(values, 99) * 1e3)
