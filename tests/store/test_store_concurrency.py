"""Many threads at once, GIL release, and Ctrl-C during a blocking call."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import asyncflow as af
from asyncflow.telemetry.threads import settled, switches_of

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


def inside(thread: int, method: str) -> bool:
    """Whether ``thread`` is running the store's ``method`` (in its Python wrapper or in the
    native call the wrapper makes)."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        code = frame.f_code
        if code.co_name == method and code.co_filename.endswith(f"asyncflow{os.sep}store.py"):
            return True
        frame = frame.f_back
    return False


def test_a_blocked_claim_releases_the_gil(store: af.Store) -> None:
    store.register_task("t")
    main = threading.get_ident()

    def spin_then_put() -> None:
        # Python work needs the GIL: it gets done while the claim waits only if the claim lets
        # go of it. Only then does the row the claim waits for arrive.
        while not inside(main, "claim"):
            time.sleep(0.001)
        ticks = 0
        while ticks < 100_000:
            ticks += 1
        store.put({"x": [ticks]})

    worker = threading.Thread(target=spin_then_put)
    worker.start()
    try:
        batch = store.claim("t", "x", 1, timeout=60)
    finally:
        worker.join()
    assert [int(v) for v in batch.read()["x"]] == [100_000]


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_ctrl_c_interrupts_a_blocked_claim(store: af.Store) -> None:
    store.register_task("t")
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main

    def interrupt_the_claim() -> None:
        while not inside(main, "claim"):
            time.sleep(0.001)
        # The claim is to be found waiting, past its start: entering the call is not enough to
        # say so, and a claim that has not started yet would raise KeyboardInterrupt as well.
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    # A process started in the background by a non-interactive shell (as CI may start the
    # suite) inherits SIGINT ignored, and Python then leaves it ignored; a user's Ctrl-C
    # reaches a foreground process through Python's handler, so the test puts that in place.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=interrupt_the_claim)
    try:
        interrupter.start()  # it waits until the claim below is under way
        with pytest.raises(KeyboardInterrupt):
            store.claim("t", "x", 1, timeout=60)
        interrupter.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    # A claim deaf to Ctrl-C would wait out its 60 s and end in TimeoutError instead.


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_a_claim_waiting_outside_the_main_thread_sleeps_until_rows_come(store: af.Store) -> None:
    # Only Python's main thread runs signal handlers, so a claim waiting in a worker's thread
    # has no Ctrl-C to look for. It used to wake every 50 ms to look anyway: 20 wake-ups in a
    # second, each costing an idle worker CPU. The thread's switches are counted only while it
    # waits inside the native call, which holds no GIL: waits for the GIL, which other threads
    # of the test process cause as they please, fall outside the count.
    store.register_task("t")
    claimed: list[int] = []
    claimer = threading.Thread(
        target=lambda: claimed.append(len(store.claim("t", "x", 1, timeout=120)))
    )
    claimer.start()
    tid = str(claimer.native_id)
    deadline = time.monotonic() + 60

    # Inside the claim and settled: past any wait for the GIL, so waiting in the native call.
    while not (inside(claimer.ident or 0, "claim") and settled(tid)):
        assert time.monotonic() < deadline, "the claim never settled into its wait"
        time.sleep(0.01)
    before = switches_of(tid)
    time.sleep(1.0)  # a look every 50 ms would wake it about 20 times meanwhile
    during = switches_of(tid) - before
    waited_throughout = not claimed
    store.put({"x": [1.0]})
    claimer.join(timeout=60)
    assert claimed == [1], "the put ended the claim"
    assert waited_throughout, "the claim ended before the row came"
    assert during < 5, f"the waiting claim woke its thread {during} times in a second"


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
    while not inside(waiter.ident or 0, "put"):
        time.sleep(0.001)
    assert not result, "the put is waiting for room"
    store.claim("t", "x", 1, timeout=1).ack()
    waiter.join(timeout=10)
    assert len(result) == 1


def test_an_ack_that_leaves_a_group_claimable_wakes_a_waiting_whole_groups_claim(
    store: af.Store,
) -> None:
    # A whole-groups claim skips the members its task acked: the ack of the member another
    # claim of the task holds is what makes the rest of the group claimable, and nothing else
    # changes until that lease would run out (30 s), long after the ack.
    store.register_task("adv")
    rows = list(store.put({"x": [1, 2]}, groups=[7, 7], group_size=2))
    one = store.claim("adv", "x", 1, timeout=1)
    got: list[af.Batch] = []
    waiter = threading.Thread(
        target=lambda: got.append(store.claim("adv", "x", 1, whole_groups=True, timeout=60))
    )
    waiter.start()
    while not inside(waiter.ident or 0, "claim"):
        time.sleep(0.001)
    # Gives the claim time to find nothing and wait; were it slower, it would find the rest of
    # the group at its first look, and the test would pass without showing the wake-up.
    time.sleep(0.3)
    one.ack()
    acked = time.monotonic()
    waiter.join(timeout=120)
    assert len(got) == 1
    assert list(got[0].indexes) == [r for r in rows if r not in list(one.indexes)]
    # Unwoken, it would find the group only once the acked lease's deadline passed, at 30 s.
    assert time.monotonic() - acked < 20, "the ack did not wake the claim"
