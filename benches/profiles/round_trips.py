"""Microseconds per call of the smallest request (``register_task`` of a task that exists: no
work in the daemon but the round trip) and of a claim of 1 and of 64 rows followed by its
release, from Python, on an embedded store and over each data path to one daemon::

    .venv/bin/python benches/profiles/round_trips.py [CALLS]

Each path runs in a process of its own, one after another, against one daemon (``--shards 8``)
holding 64 K one-float rows. ``shm`` carries requests and replies in shared-memory rings,
``shm-socket`` on the Unix socket; over shared memory a claim also brings its rows' cells, over
TCP it does not (they cross the socket on a read).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import asyncflow as af
from asyncflow.daemon import DaemonProcess

PATHS = ("inproc", "shm", "shm-socket", "tcp")


def one_path(url: str, path: str, calls: int) -> None:
    store = af.Store(shards=8) if path == "inproc" else af.connect(url, transport=path)
    store.register_task("bench")
    store.put({"x": np.zeros(1 << 16, dtype=np.float32)}, partition="p")

    def per_call(fn: Callable[[], object]) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6

    small = per_call(lambda: store.register_task("bench"))
    one = per_call(lambda: store.release(store.claim("bench", "x", 1, timeout=1)))
    many = per_call(lambda: store.release(store.claim("bench", "x", 64, timeout=1)))
    print(f"| {path} | {small:.1f} | {one:.1f} | {many:.1f} |", flush=True)


def main(calls: int) -> None:
    print("| path | register_task (µs) | claim 1 + release (µs) | claim 64 + release (µs) |")
    print("|---|---:|---:|---:|", flush=True)
    with DaemonProcess("--shards", "8") as daemon:
        for path in PATHS:
            subprocess.run(
                [sys.executable, __file__, "--one", daemon.url, path, str(calls)], check=True
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one_path(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000)
