"""Where a round of the store suite's 1 MiB shared-memory throughput case goes, and what a
request costs after its client has been busy a while, against one daemon::

    .venv/bin/python benches/profiles/idle_wakeups.py [ROUNDS]

First the suite's round (put 4 rows of 1 MiB, claim them, read, ack; ``store_seconds``), timed
call by call, beside the suite's memcpy baseline (``memcpy_seconds``: the same 4 MiB copied
into a warm buffer, per round).
Then the smallest request (``register_task`` of a task that exists) twice in a row, after the
client has spun for 0 or 330 µs (about one 4 MiB copy) since its last request, and after a put
of 4 MiB: the first request after a busy spell finds the daemon's connection thread asleep, and
pays for waking it. Microseconds per call, means over ROUNDS rounds (default 300).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import asyncflow as af
from asyncflow.bench.workload import Rounds, memcpy_seconds
from asyncflow.daemon import DaemonProcess

clock = time.perf_counter


def spin(seconds: float) -> None:
    start = clock()
    while clock() - start < seconds:
        pass


def throughput_round(store: af.Store, rounds: int) -> None:
    work = Rounds.of(1 << 20, quick=False)
    store.register_task("bench")
    spent = np.zeros(4)
    for _ in range(rounds):
        t0 = clock()
        store.put({"payload": work.block}, partition="bench")
        t1 = clock()
        batch = store.claim("bench", "payload", work.rows, timeout=30)
        t2 = clock()
        batch.read()
        t3 = clock()
        batch.ack()
        spent += [t1 - t0, t2 - t1, t3 - t2, clock() - t3]
    copy = memcpy_seconds(work) / work.rounds * 1e6
    put, claim, read, ack = spent / rounds * 1e6
    print("| put | claim | read | ack | round | memcpy of the same 4 MiB | memcpy / round |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    total = put + claim + read + ack
    print(f"| {put:.0f} | {claim:.1f} | {read:.1f} | {ack:.1f} | {total:.0f} | {copy:.0f} "
          f"| {copy / total:.2f} |")  # fmt: skip


def after_idle(store: af.Store, rounds: int) -> None:
    block = np.zeros((4, 1 << 20), dtype=np.uint8)
    print("\n| before the requests | first request | second request |")
    print("|---|---:|---:|")
    for label, busy, put in (
        ("the last request's reply, at once", 0.0, False),
        ("330 µs of spinning in the client", 330e-6, False),
        ("a put of 4 MiB", 0.0, True),
    ):
        spent = np.zeros(2)
        for _ in range(rounds):
            spin(busy)
            if put:
                store.put({"payload": block}, partition="idle")
            t0 = clock()
            store.register_task("bench")
            t1 = clock()
            store.register_task("bench")
            spent += [t1 - t0, clock() - t1]
            if put:
                store.clear("idle")
        first, second = spent / rounds * 1e6
        print(f"| {label} | {first:.1f} | {second:.1f} |")


def main(rounds: int) -> None:
    with DaemonProcess("--shards", "8") as daemon:
        store = af.connect(daemon.url, transport="shm")
        throughput_round(store, rounds)
        after_idle(store, rounds)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
