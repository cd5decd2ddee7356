"""What a large copy costs the store calls that follow it, with no daemon in the way: an
embedded store's put of 4 rows of 1 KiB, then a claim of them, a claim that finds none and an
ack, timed each, in rounds with and without a 4 MiB ``numpy.copyto`` (as large as one round of
the ``store`` suite's 1 MiB case copies) between the put and the claims::

    .venv/bin/python benches/profiles/after_copy.py [ROUNDS]

A copy that size passes through this core's caches and leaves the calls after it to find their
code and data in memory again; on the shared-memory path that cost comes on top of the copy into
shared memory and the round trips.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import asyncflow as af

ROWS = 4


def rounds(store: af.Store, n: int, copy: bool) -> np.ndarray:
    """Mean microseconds of put, claim, empty claim and ack over ``n`` rounds."""
    block = np.ones((ROWS, 1024), dtype=np.uint8)
    src = np.ones(4 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    took = np.zeros(4)
    for _ in range(n):
        t0 = time.perf_counter()
        store.put({"x": block}, partition="p")
        t1 = time.perf_counter()
        if copy:
            np.copyto(dst, src)
        t2 = time.perf_counter()
        batch = store.claim("bench", "x", ROWS, timeout=30)
        t3 = time.perf_counter()
        store.claim("bench", "x", ROWS, timeout=0, allow_partial=True)
        t4 = time.perf_counter()
        batch.ack()
        t5 = time.perf_counter()
        took += (t1 - t0, t3 - t2, t4 - t3, t5 - t4)
    return took / n * 1e6


def main(n: int) -> None:
    store = af.Store(shards=8)
    store.register_task("bench")
    rounds(store, 100, True)
    print("µs per call, mean of 3 sets of", n, "rounds: put, claim, empty claim, ack")
    for copy in (False, True, False, True):
        sets = np.array([rounds(store, n, copy) for _ in range(3)]).mean(axis=0)
        label = "after a 4 MiB copy" if copy else "no copy between"
        print(f"{label:>20}: " + "  ".join(f"{v:6.1f}" for v in sets))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
