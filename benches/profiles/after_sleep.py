"""What the same small calls cost right after the calling thread slept, against back to back::

    .venv/bin/python benches/profiles/after_sleep.py [CALLS]

A worker of a streaming pipeline makes each store call after a wait: for an emulated device, a
verifier, rows to claim. This times, in one thread of this process, a computation that asks
nothing of the store (numpy's sum of 100,000 float64), ``register_task`` of a task that exists
(a round trip with no work), and a put of 16 float32 to existing rows, over shared memory to one
daemon: CALLS times back to back (default 2000), then CALLS // 20 times, each after a 50 ms
sleep. Microseconds of thread CPU (``time.thread_time``) and of wall-clock time per call,
means.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

import asyncflow as af
from asyncflow.daemon import DaemonProcess


def per_call(fn: Callable[[], object], gap: float, calls: int) -> tuple[float, float]:
    """Mean thread CPU and wall-clock time of ``fn`` (µs), each call after ``gap`` s asleep."""
    cpu = wall = 0.0
    for _ in range(calls):
        if gap:
            time.sleep(gap)
        c, w = time.thread_time(), time.perf_counter()
        fn()
        wall += time.perf_counter() - w
        cpu += time.thread_time() - c
    return 1e6 * cpu / calls, 1e6 * wall / calls


def main(calls: int) -> None:
    with DaemonProcess("--shards", "8") as daemon:
        store = af.connect(daemon.url, transport="shm")
        store.register_task("t")
        rows = store.put({"x": np.zeros(16, np.float32)}, partition="p")
        reward = np.ones(16, np.float32)
        numbers = np.arange(100_000, dtype=np.float64)
        cases: dict[str, Callable[[], object]] = {
            "numpy sum of 100,000 float64 (no store)": numbers.sum,
            "register_task (round trip, no work)": lambda: store.register_task("t"),
            "put of 16 float32 to existing rows": lambda: store.put(
                {"reward": reward}, indexes=rows
            ),
        }
        print("| call | back to back: CPU / wall (µs) | after 50 ms asleep: CPU / wall (µs) |")
        print("|---|---:|---:|")
        for name, fn in cases.items():
            per_call(fn, 0.0, 10)  # warm up
            warm = per_call(fn, 0.0, calls)
            cold = per_call(fn, 0.05, max(3, calls // 20))
            print(f"| {name} | {warm[0]:.1f} / {warm[1]:.1f} | {cold[0]:.1f} / {cold[1]:.1f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
