"""What an idle worker's claim and a small put cost the calling thread, against one daemon::

    .venv/bin/python benches/profiles/small_calls.py [ROUNDS]

- An idle claim: a claim with a 1 s timeout on a task with no rows, in a thread other than the
  main one (as every worker's), until it times out. Thread CPU (``time.thread_time``) and
  voluntary context switches (``/proc``) per claim, means over ROUNDS // 100 claims (at least 3).
- A small put: a put of one row of 16 float32 (64 B) or of 1,024 (4 KiB), ROUNDS times, back to
  back or 2 ms apart (the daemon's connection thread has gone to sleep by then, as between a
  worker's calls). Microseconds of wall-clock time and of thread CPU per put, means.
- A claim that sleeps: a claim (and ack) of one row that another connection of this process
  puts 3 ms after the claim is sent, ROUNDS // 4 times (at least 3), so that the claiming
  thread goes to sleep and the link's watcher thread reads the reply for it. The whole
  process's CPU per claim (both threads and both links' watchers, the put included) and the
  voluntary context switches per claim of the claiming link's watcher thread.

Each runs over shared memory (``shm``) and over TCP, in this process, against a daemon of its
own started here. ROUNDS defaults to 1000.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Literal

import numpy as np

import asyncflow as af
from asyncflow.daemon import DaemonProcess
from asyncflow.telemetry.threads import (
    WATCHER,
    new_thread,
    switches_by_thread,
    switches_in_a_thread,
)


def idle_claims(store: af.Store, claims: int) -> tuple[float, float]:
    store.register_task("idle")

    def body() -> float:
        cpu = time.thread_time()
        for _ in range(claims):
            with contextlib.suppress(af.StoreTimeoutError):
                store.claim("idle", "never", 1, timeout=1.0)
        return (time.thread_time() - cpu) / claims

    spent, switches = switches_in_a_thread(body, timeout=claims * 60.0)
    return spent, switches / claims


def puts(store: af.Store, floats: int, gap: float, rounds: int) -> tuple[float, float]:
    row = np.zeros(floats, np.float32)

    def body() -> tuple[float, float]:
        wall, cpu = 0.0, time.thread_time()
        for _ in range(rounds):
            start = time.perf_counter()
            store.put({f"x{floats}": [row]}, partition="small")
            wall += time.perf_counter() - start
            if gap:
                time.sleep(gap)  # its own system call counts in the thread CPU: a few µs
        return wall / rounds, (time.thread_time() - cpu) / rounds

    spent, _ = switches_in_a_thread(body, timeout=rounds * 60.0)
    store.clear("small")
    return spent


PATHS: tuple[Literal["shm", "tcp"], ...] = ("shm", "tcp")


def sleeping_claims(url: str, path: Literal["shm", "tcp"], claims: int) -> tuple[float, float]:
    before = set(switches_by_thread(WATCHER))
    claimer = af.connect(url, transport=path)
    claimer.register_task("sleepy")
    mine = new_thread(WATCHER, before)  # the claiming link's watcher
    putter = af.connect(url, transport=path)
    row = np.zeros(4, np.float32)
    sent = threading.Event()

    def put_each() -> None:
        for _ in range(claims):
            sent.wait()
            sent.clear()
            time.sleep(0.003)
            putter.put({"s": [row]}, partition="sleepy")

    producer = threading.Thread(target=put_each)
    producer.start()

    def body() -> tuple[float, float]:
        switches, cpu = switches_by_thread(WATCHER)[mine], time.process_time()
        for _ in range(claims):
            sent.set()
            claimer.claim("sleepy", "s", 1, timeout=30).ack()
        spent = (time.process_time() - cpu) / claims
        return spent, (switches_by_thread(WATCHER)[mine] - switches) / claims

    spent, _ = switches_in_a_thread(body, timeout=claims * 60.0)
    producer.join()
    return spent


def main(rounds: int) -> None:
    print("| path | idle 1 s claim: thread CPU (µs) | context switches |")
    print("|---|---:|---:|")
    results = []
    with DaemonProcess() as daemon:
        for path in PATHS:
            store = af.connect(daemon.url, transport=path)
            cpu, switches = idle_claims(store, max(3, rounds // 100))
            print(f"| {path} | {1e6 * cpu:.0f} | {switches:.1f} |")
            for floats in (16, 1024):
                for gap in (0.0, 0.002):
                    wall, put_cpu = puts(store, floats, gap, rounds)
                    results.append((path, 4 * floats, gap, wall, put_cpu))
    print("\n| path | claim that sleeps: process CPU (µs) | watcher's context switches |")
    print("|---|---:|---:|")
    with DaemonProcess() as daemon:
        for path in PATHS:
            cpu, switches = sleeping_claims(daemon.url, path, max(3, rounds // 4))
            print(f"| {path} | {1e6 * cpu:.0f} | {switches:.2f} |")
    print("\n| path | put of | calls | wall (µs) | thread CPU (µs) |")
    print("|---|---:|---|---:|---:|")
    for path, size, gap, wall, cpu in results:
        calls = "back to back" if gap == 0 else f"{1e3 * gap:.0f} ms apart"
        print(f"| {path} | {size} B | {calls} | {1e6 * wall:.0f} | {1e6 * cpu:.0f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
