"""Many threads at once, GIL release, and Ctrl-C during a blocking call."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest

import asyncflow as af

PRODUCERS = 8
CONSUMERS = 8
ROWS_PER_PRODUCER = 400


def test_eight_producers_and_eight_consumers_lose_and_duplicate_nothing(store: af.Store) -> None:
    store.register_task("t")
    delivered: Counter[int] = Counter()
    payload_ok: list[bool] = []
    lock = threading.Lock()
    done_producing = threading.Event()

    def produce(p: int) -> None:
        for k in range(0, ROWS_PER_PRODUCER, 8):
            ids = [p * 10_000 + k + j for j in range(8)]
            store.put({"id": np.array(ids, np.int64), "blob": [np.full(i % 7, i) for i in ids]})

    def consume() -> None:
        while True:
            batch = store.claim("t", ["id", "blob"], 16, timeout=0.2, allow_partial=True)
            if len(batch) == 0:
                if done_producing.is_set():
                    return
                continue
            data = batch.read()
            ok = all(
                len(b) == int(i) % 7 and (b == int(i)).all()
                for i, b in zip(data["id"], data["blob"], strict=True)
            )
            with lock:
                delivered.update(int(i) for i in data["id"])
                payload_ok.append(ok)
            batch.ack()

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(PRODUCERS)]
    consumers = [threading.Thread(target=consume) for _ in range(CONSUMERS)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join()
    done_producing.set()
    for t in consumers:
        t.join(timeout=60)
        assert not t.is_alive()

    expected = {p * 10_000 + k for p in range(PRODUCERS) for k in range(ROWS_PER_PRODUCER)}
    assert set(delivered) == expected, "no row lost"
    assert max(delivered.values()) == 1, "no row delivered twice"
    assert all(payload_ok)
    stats = store.stats()
    assert stats["live_rows"] == 0 and stats["memory_used"] == 0


def test_a_blocked_claim_releases_the_gil(store: af.Store) -> None:
    store.register_task("t")
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        with pytest.raises(af.TimeoutError):
            store.claim("t", "x", 1, timeout=0.3)
    finally:
        stop.set()
        spinner.join()
    assert ticks > 1000, "the other thread ran while the claim waited"


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_ctrl_c_interrupts_a_blocked_claim(store: af.Store) -> None:
    store.register_task("t")
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        store.claim("t", "x", 1, timeout=30)
    assert time.monotonic() - started < 5


def test_a_waiting_put_proceeds_when_another_thread_frees_memory(
    make_store: af.Store,
) -> None:
    store = make_store(memory_limit=8192)  # type: ignore[operator]
    store.register_task("t")
    store.put({"x": [np.zeros(6000, np.uint8)]})
    result: list[np.ndarray] = []
    waiter = threading.Thread(
        target=lambda: result.append(store.put({"x": [np.ones(6000, np.uint8)]}, timeout=10))
    )
    waiter.start()
    time.sleep(0.1)
    assert not result, "the put is still waiting for room"
    store.claim("t", "x", 1, timeout=1).ack()
    waiter.join(timeout=10)
    assert len(result) == 1
