"""Client processes for fault and soak trials, started with ``python -m
asyncflow.reliability.clients ROLE ...``. They report in JSON lines on stdout, so the harness
exchanges no pickled objects with them (``multiprocessing`` would)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict

import asyncflow as af
from asyncflow.reliability.faults import PRODUCER_BATCH, WAIT, Transport, record_put, rows_of
from asyncflow.reliability.soak import ClientResult, run_client


def say(**message: object) -> None:
    print(json.dumps(message), flush=True)


def consumer(url: str) -> None:
    """Acks one batch, claims another, says so, and waits to be killed holding it."""
    store = af.connect(url)
    first = store.claim("t", ["id", "payload"], 16, timeout=WAIT)
    acked = [int(i) for i in first.read()["id"]]
    first.ack()
    held = store.claim("t", ["id", "payload"], 16, timeout=WAIT)
    say(acked=acked, holding=[int(i) for i in held.indexes])
    time.sleep(3600)


def producer(url: str, transport: Transport, record: str) -> None:
    """Puts 64-row batches until killed, appending each put that returned to the file
    ``record`` (synced before the next put), so the harness knows what it was told was put."""
    store = af.connect(url, transport=transport)
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    i = 0
    while True:
        store.put(rows_of(range(i, i + PRODUCER_BATCH)), partition="p")
        record_put(fd, i, PRODUCER_BATCH)
        i += PRODUCER_BATCH
        if i == PRODUCER_BATCH:
            say(started=True)


def soak(url: str, first: int, threads: int, until_wall: float) -> None:
    """``threads`` soak clients numbered from ``first``, until the wall clock reads
    ``until_wall``; prints each one's result."""
    until = time.monotonic() + max(0.0, until_wall - time.time())
    results: list[ClientResult] = [ClientResult() for _ in range(threads)]

    def run(k: int) -> None:
        results[k] = run_client(url, first + k, until)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for r in results:
        say(**asdict(r))


def main(argv: list[str]) -> int:
    role, url, *rest = argv
    if role == "consumer":
        consumer(url)
    elif role == "producer" and rest[0] in ("auto", "tcp", "shm"):
        producer(url, rest[0], rest[1])  # type: ignore[arg-type]
    elif role == "soak":
        soak(url, int(rest[0]), int(rest[1]), float(rest[2]))
    else:
        print(f"unknown client role {role!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
