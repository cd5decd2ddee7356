"""Where a round of the ``store`` suite's shared-memory throughput case goes: the same rounds
(``put`` of one block of rows, ``claim`` of them, ``read``, ``ack``; see
``asyncflow.bench.workload``) against a daemon (``--shards 8``) over the rings, each call timed
apart, beside ``numpy.copyto`` of the same block (the case's ``memcpy`` baseline)::

    .venv/bin/python benches/profiles/shm_round.py [ROW_BYTES]

Prints microseconds per round for each call, their sum and the baseline, for three sets of the
case's rounds (512 MiB moved each).
"""

from __future__ import annotations

import sys
import time

import numpy as np

import asyncflow as af
from asyncflow.bench.workload import Rounds, memcpy_seconds
from asyncflow.daemon import DaemonProcess


def main(size: int) -> None:
    work = Rounds.of(size, quick=False)
    print(f"{work.rows} rows of {size} bytes a round, {work.rounds} rounds; µs per round:")
    print("  put  claim   read    ack    sum  memcpy  memcpy/sum")
    with DaemonProcess("--shards", "8") as daemon:
        store = af.connect(daemon.url, transport="shm")
        store.register_task("bench")
        for _ in range(3):
            took = np.zeros(4)
            for _ in range(work.rounds):
                t0 = time.perf_counter()
                store.put({"payload": work.block}, partition="bench")
                t1 = time.perf_counter()
                batch = store.claim("bench", "payload", work.rows, timeout=30)
                t2 = time.perf_counter()
                batch.read()
                t3 = time.perf_counter()
                batch.ack()
                t4 = time.perf_counter()
                took += (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            took = took / work.rounds * 1e6
            copy = memcpy_seconds(work) / work.rounds * 1e6
            calls = "".join(f"{v:6.0f} " for v in took)
            print(f"{calls}{took.sum():6.0f} {copy:7.0f} {copy / took.sum():11.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20)
