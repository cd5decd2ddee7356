"""The store daemon's own CPU for the two requests the pipeline workers make most, measured
against a daemon in a child process with a memory limit (as the ``pipeline`` suite runs it)::

    .venv/bin/python benches/profiles/daemon_costs.py claims 8 0.01   # 8 clients, 10 ms claims
    .venv/bin/python benches/profiles/daemon_costs.py puts            # 16-row puts over shm
    .venv/bin/python benches/profiles/daemon_costs.py wakes 64        # puts, 64 claims waiting

``claims N T``: N clients, each on its own connection, claim for T seconds a field nobody
writes (allowing a partial batch, so each claim ends empty at its timeout) for 10 seconds;
prints the daemon's CPU per claim. ``puts``: one client puts 3,000 rows of 16 x 256 float32
(clearing them every 500); prints the daemon's and the client's CPU and the wall clock per put.
``wakes N``: the same puts while N other clients each wait in a claim for a field nobody
writes; prints the daemon's CPU and the wall clock per put (what each waiting claim adds to a
put that cannot concern it).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

import asyncflow as af
from asyncflow.bench.pipeline_suite import _proc_cpu_seconds
from asyncflow.daemon import DaemonProcess


def claims(clients: int, timeout: float) -> None:
    with DaemonProcess("--memory-limit", "8GiB", "--lease-timeout", "3600") as daemon:
        af.connect(daemon.url).register_task("t")
        stop = time.monotonic() + 10
        done: list[int] = []

        def client() -> None:
            store = af.connect(daemon.url)
            while time.monotonic() < stop:
                store.claim("t", ["never"], 256, timeout=timeout, allow_partial=True)
                done.append(1)

        threads = [threading.Thread(target=client) for _ in range(clients)]
        before = _proc_cpu_seconds(daemon.proc.pid)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = _proc_cpu_seconds(daemon.proc.pid) - before
        print(
            f"{clients} clients, {timeout} s claims: {len(done)} claims, "
            f"daemon CPU {cpu / len(done) * 1e6:.0f} us per claim"
        )


def puts(n: int = 3000, waiting: int = 0) -> None:
    with DaemonProcess("--memory-limit", "8GiB", "--lease-timeout", "3600") as daemon:
        store = af.connect(daemon.url)
        store.register_task("t")
        stop = threading.Event()

        def waiter(client: af.Store) -> None:
            while not stop.is_set():
                client.claim("t", ["never"], 1, timeout=2.0, allow_partial=True)

        # Connected one after another: a burst of new connections is the daemon's to refuse.
        waiters = [
            threading.Thread(target=waiter, args=(af.connect(daemon.url),)) for _ in range(waiting)
        ]
        for t in waiters:
            t.start()
        rows = {"x": np.zeros((16, 256), np.float32)}
        for _ in range(200):  # warm-up: segments and the spare region in place
            store.put(rows, partition="p")
        store.clear("p")
        before, client, wall = (
            _proc_cpu_seconds(daemon.proc.pid),
            time.process_time(),
            time.monotonic(),
        )
        for i in range(n):
            store.put(rows, partition="p")
            if i % 500 == 499:
                store.clear("p")
        cpu = _proc_cpu_seconds(daemon.proc.pid) - before
        client, wall = time.process_time() - client, time.monotonic() - wall
        stop.set()
        for t in waiters:
            t.join()
        print(
            f"per put, {waiting} claims waiting: daemon CPU {cpu / n * 1e6:.0f} us, "
            f"client CPU {client / n * 1e6:.0f} us, wall clock {wall / n * 1e6:.0f} us "
            f"({os.cpu_count()} CPUs)"
        )


if __name__ == "__main__":
    if sys.argv[1] == "claims":
        claims(int(sys.argv[2]), float(sys.argv[3]))
    elif sys.argv[1] == "wakes":
        puts(waiting=int(sys.argv[2]))
    else:
        puts()
