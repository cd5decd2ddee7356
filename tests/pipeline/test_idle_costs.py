"""What idle workers ask of the store: new weights fetched once per engine, a publication's
readiness asked for once, waits that end when the run stops, claims that take a full batch
without waiting, and the workers of one engine claiming prompts one at a time."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.errors import UnknownTaskError
from asyncflow.launch.local import run_threads
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.tasks.arithmetic import ArithmeticTask
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks
from asyncflow.workers.base import IDLE_WAIT, PROMPTS, Context, RunState, Worker
from asyncflow.workers.feeder import Feeder
from asyncflow.workers.rollout import Rollout


class Counting(af.Store):
    """An embedded store that counts the calls of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.claim_timeouts: list[float | None] = []
        self.partial_after: list[float | None] = []

    def put(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["put"] += 1
        return super().put(*args, **kwargs)

    def rows(self, *args: Any, **kwargs: Any) -> af.Rows:
        self.calls["rows"] += 1
        self.calls[f"rows of {kwargs.get('partition')}"] += 1
        return super().rows(*args, **kwargs)

    def ready_fields(self, indexes: Any) -> list[list[str]]:
        self.calls["ready_fields"] += 1
        return super().ready_fields(indexes)

    def read(self, indexes: Any, fields: Any) -> dict[str, list[Any]]:
        self.calls["read"] += 1
        return super().read(indexes, fields)

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["claim"] += 1
        self.claim_timeouts.append(kwargs.get("timeout"))
        self.partial_after.append(kwargs.get("partial_after"))
        return super().claim(*args, **kwargs)


def context(store: af.Store, *overrides: str, **fields: Any) -> Context:
    config = cfg.load(None, ["rollout.n=2", "trainer.groups_per_step=2", *overrides])
    register_tasks(store, reference=False)
    return Context(store, config, chatml_tokenizer(), Tracer(), RunState(), **fields)


class Shared(RolloutEngine):
    """An engine several workers share; counts its weight loads."""

    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        return [[Completion([5], [0.0], "", "stop")] * sampling.n for _ in prompts]

    def load_weights(self, version: int, tensors: Any) -> None:
        self.loads += 1
        self.version = version


def test_workers_sharing_an_engine_fetch_each_version_once() -> None:
    store = Counting()
    ctx = context(store)
    engine = Shared()
    workers = [Rollout(ctx, engine, f"rollout-{k}") for k in range(4)]
    weights.publish(store, 1, [("w", torch.ones(2))])
    reads = store.calls["read"]
    assert [w.sync_weights() for w in workers].count(True) == 1
    assert engine.version == 1 and engine.loads == 1
    # The manifest and the tensors of version 1, read once for the four workers.
    assert store.calls["read"] - reads == 2
    weights.publish(store, 2, [("w", torch.ones(2))])
    ctx.weights = weights.Watcher(store, 0.0)  # every call reads the store
    threads = [threading.Thread(target=w.sync_weights) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.version == 2 and engine.loads == 2


def test_a_publication_s_readiness_is_asked_for_once() -> None:
    store = Counting()
    watcher = weights.Watcher(store, interval=0.0)
    weights.publish(store, 1, [("w", torch.ones(2))])
    assert watcher.latest() == 1
    asked = store.calls["ready_fields"]
    for _ in range(5):
        assert watcher.latest() == 1
    assert store.calls["ready_fields"] == asked
    # A row listed before its manifest is in is asked about again until it is.
    store.put({"weights/w": np.zeros((1, 2), np.float32)}, partition=weights.PARTITION, version=2)
    assert watcher.latest() == 1
    assert watcher.latest() == 1
    assert store.calls["ready_fields"] == asked + 2
    weights.publish(store, 3, [("w", torch.ones(2))])
    assert watcher.latest() == 3
    assert watcher.latest() == weights.latest_version(store) == 3


def test_a_wait_for_weights_waits_in_the_store_not_listing_it_again_and_again() -> None:
    store = Counting()
    watcher = weights.Watcher(store, interval=0.001, wake_wait=5)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(watcher.wait_for(1, timeout=60)))
    waiter.start()
    time.sleep(0.2)  # a poller listing the partition every interval would list ~200 times here
    weights.publish(store, 1, [("w", torch.ones(2))])
    waiter.join()
    assert got == [True]
    # The poller's listing before it waited, the one after the publication woke it, and the
    # publisher's own (another only if this machine stalled for longer than ``wake_wait``).
    assert store.calls["rows"] <= 4, store.calls


def test_while_the_poller_watches_the_newest_version_is_known_without_a_store_read() -> None:
    store = Counting()
    watcher = weights.Watcher(store, interval=0.0, wake_wait=5)  # latest() alone: every call
    weights.publish(store, 1, [("w", torch.ones(2))])
    assert watcher.wait_for(1, timeout=60)  # starts the poller, which goes on watching
    listed = store.calls["rows"]
    assert [watcher.latest() for _ in range(20)] == [1] * 20
    assert store.calls["rows"] == listed
    weights.publish(store, 2, [("w", torch.ones(2))])  # one listing of its own
    assert watcher.wait_for(2, timeout=60)  # the poller woke, read once
    assert watcher.latest() == 2
    assert store.calls["rows"] <= listed + 2 + 1, store.calls  # (+1: a stall over wake_wait)


def test_a_watcher_registers_its_task_again_with_a_store_that_forgot_it() -> None:
    class Forgetful(Counting):
        """Forgets the watcher's task once, as a daemon restarted without a journal does."""

        forget = 1

        def register_task(self, name: str, partitions: Any = None) -> None:
            self.calls["register_task"] += 1
            super().register_task(name, partitions)

        def claim(self, task: str, *args: Any, **kwargs: Any) -> Any:
            if task.startswith(weights.PARTITION) and self.forget:
                self.forget -= 1
                raise UnknownTaskError(f"unknown task {task!r}")
            return super().claim(task, *args, **kwargs)

    store = Forgetful()
    watcher = weights.Watcher(store, interval=0.001, wake_wait=5)
    assert not watcher.wait_for(1, timeout=0.2)
    deadline = time.monotonic() + 60
    while store.forget:  # until the watcher's claim has failed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    weights.publish(store, 1, [("w", torch.ones(2))])
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(watcher.wait_for(2, timeout=60)))
    waiter.start()
    assert watcher.wait_for(1, timeout=60)
    weights.publish(store, 2, [("w", torch.ones(2))])
    waiter.join()
    assert got == [True] and store.calls["register_task"] == 2


def test_a_wait_for_weights_ends_when_the_run_stops() -> None:
    store = af.Store()
    stop = threading.Event()
    watcher = weights.Watcher(store, interval=0.01, stop=stop)
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert not watcher.wait_for(1, timeout=60)
    assert time.monotonic() - started < 30
    started = time.monotonic()
    assert not watcher.wait_for(1, timeout=60)  # stopped already: at once
    assert time.monotonic() - started < 30


def test_a_wait_for_weights_ends_at_once_when_woken_after_the_run_stopped() -> None:
    stop = threading.Event()
    watcher = weights.Watcher(af.Store(), interval=0.01, stop=stop, wake_wait=600)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(watcher.wait_for(1, timeout=600)))
    waiter.start()
    deadline = time.monotonic() + 60
    while watcher._poller is None or not watcher._watching:  # the poller waits in the store
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stop.set()
    watcher.wake()
    waiter.join(timeout=60)  # the poller's own wait and the waiter's timeout are 600 s
    assert got == [False]


def test_a_workers_weights_poller_waits_in_the_store_as_long_as_an_idle_claim() -> None:
    store = Counting()
    ctx = context(store, "run.poll_interval=0.01")
    threading.Thread(target=ctx.weights.wait_for, args=(1, 60), daemon=True).start()
    deadline = time.monotonic() + 60
    while not store.calls["claim"]:  # the poller's first wait in the store
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # with a wait of the poll interval it would claim about 30 times more here
    assert store.claim_timeouts[0] == IDLE_WAIT, store.claim_timeouts
    assert store.calls["claim"] <= 2, store.calls


def test_run_threads_wakes_workers_waiting_for_weights_when_the_run_stops() -> None:
    store = af.Store()
    ctx = context(store, "run.poll_interval=600")  # the poller and the waiter wait 600 s

    class Waiting(Worker):
        role = "waiting"

        def step(self) -> bool:
            self.ctx.weights.wait_for(1, timeout=600)
            return True

    class Finisher(Worker):
        role = "finisher"

        def step(self) -> bool:
            time.sleep(0.01)
            return not self.ctx.weights._watching  # done once the other waits in the store

    finisher = Finisher(ctx)
    started = time.monotonic()
    run_threads([Waiting(ctx), finisher], ctx.stop, finisher, join_timeout=60)
    assert time.monotonic() - started < 60


def test_run_threads_without_a_tick_sleeps_until_the_run_stops() -> None:
    # It used to wake every 0.2 s to call a tick that does nothing: five wake-ups a second of
    # every worker process's main thread, for the whole run. The waits of the calling thread are
    # counted on the stop itself: its context switches would also count each wait for the GIL,
    # which other threads of the process (pytest-xdist's among them) make at any time.
    class CountedStop(threading.Event):
        def __init__(self, caller: int) -> None:
            super().__init__()
            self.caller = caller
            self.waits = 0

        def wait(self, timeout: float | None = None) -> bool:
            if threading.get_ident() == self.caller:
                self.waits += 1
            return super().wait(timeout)

    stop = CountedStop(threading.get_ident())
    ctx = context(af.Store(), stop=stop)

    class Finisher(Worker):
        role = "finisher"

        def step(self) -> bool:
            time.sleep(2.0)
            return False

    finisher = Finisher(ctx)
    run_threads([finisher], stop, finisher, join_timeout=60)
    assert stop.is_set()
    # One wait for the whole run; a tick every 0.2 s would have waited 10 times.
    assert stop.waits == 1, f"run_threads woke its thread {stop.waits} times"


def test_a_full_batch_is_claimed_without_waiting_a_partial_one_after_the_claim_wait() -> None:
    store = Counting()
    ctx = context(store, "run.claim_wait=0.2", "run.stall_timeout=300")

    class Claimer(Worker):
        def step(self) -> bool:
            return False

    worker = Claimer(ctx)
    store.put(
        {"prompt_ids": [np.array([3], np.int64)] * 3, "answer": [b"0"] * 3},
        partition=PROMPTS,
        groups=np.arange(3),
        group_size=1,
    )
    full = worker.claim("rollout", ["prompt_ids"], 2)
    assert len(full) == 2 and store.claim_timeouts == [0.0]
    partial = worker.claim("rollout", ["prompt_ids"], 2)
    assert len(partial) == 1
    # Full now? No: then one request that settles for part of the batch after the claim wait,
    # and with nothing there would wait on for the first rows.
    assert store.claim_timeouts == [0.0, 0.0, IDLE_WAIT]
    assert store.partial_after == [None, None, 0.2]
    # An idle worker: one request, until rows come or the idle wait has passed. After a short
    # batch it does not ask for a full one first.
    started = time.monotonic()
    assert len(worker.claim("rollout", ["prompt_ids"], 2, timeout=0.05)) == 0
    assert time.monotonic() - started >= IDLE_WAIT
    assert store.claim_timeouts[-1] == IDLE_WAIT and store.partial_after[-1] == 0.05
    assert store.calls["claim"] == 4
    # Rows again: the waiting claim's first look takes the full batch; the claim after it asks
    # for a full batch at once first, as the first one did.
    store.put(
        {"prompt_ids": [np.array([3], np.int64)] * 4, "answer": [b"0"] * 4},
        partition=PROMPTS,
        groups=np.arange(3, 7),
        group_size=1,
    )
    assert len(worker.claim("rollout", ["prompt_ids"], 2)) == 2
    assert store.claim_timeouts[4:] == [IDLE_WAIT]
    assert len(worker.claim("rollout", ["prompt_ids"], 2)) == 2
    assert store.claim_timeouts[4:] == [IDLE_WAIT, 0.0]


def test_a_single_group_claim_waits_longer_than_the_claim_wait_for_its_group() -> None:
    store = Counting()
    ctx = context(store, "run.claim_wait=0.05", "rollout.groups_per_call=1")
    worker = Rollout(ctx, Shared())
    assert worker._claim() is None
    # It asked for a full batch at once, then waited: one group is a full batch as soon as
    # there is one, so only an idle worker's wait is longer.
    assert store.claim_timeouts[0] == 0.0
    assert store.claim_timeouts[1] is not None and store.claim_timeouts[1] > 0.05


def test_a_worker_waits_for_weights_in_one_stretch_up_to_its_stall_timeout() -> None:
    """Without a dispatcher to report to, a worker waiting for new weights does not wake every
    second to find nothing changed: the weight source wakes it when the version comes."""
    ctx = context(af.Store(), "run.stall_timeout=300")
    waits: list[float] = []

    class Recording:
        keeps_previous = False

        def latest(self) -> int | None:
            return 0

        def wait_for(self, version: int, timeout: float) -> bool:
            waits.append(timeout)
            return len(waits) == 2  # the first wait ends without the version

    ctx.weights = Recording()  # type: ignore[assignment]
    worker = Rollout(ctx, Shared())
    worker._wait_for_weights(1)
    assert len(waits) == 2
    assert 299 < waits[0] <= 300
    assert waits[1] <= waits[0]  # what is left of the same stall budget


def test_the_workers_of_an_engine_claim_prompts_one_at_a_time() -> None:
    store = Counting()
    ctx = context(
        store, "rollout.groups_per_call=1", "run.stall_timeout=0.2", "run.poll_interval=0.05"
    )
    engine = Shared()
    first, second = Rollout(ctx, engine, "rollout-0.0"), Rollout(ctx, engine, "rollout-0.1")
    other = Rollout(ctx, Shared(), "rollout-1.0")
    for w in (first, second, other):
        w._idle_wait = 0.05  # a claim waits this long for prompts
    assert first._claim_lock is second._claim_lock is not other._claim_lock
    with first._claim_lock:  # as while the first waits in the store for prompts
        assert second.step()  # waited its turn (up to its stall timeout here) and gave up
        assert store.calls["claim"] == 0
        assert other.step()  # another engine's worker claims meanwhile
        assert store.calls["claim"] > 0
    claims = store.calls["claim"]
    second.note_progress(True, "")  # (else its next wait is past its stall timeout)
    assert second.step()  # its turn: it claims
    assert store.calls["claim"] > claims


def put_prompts(store: af.Store, groups: list[int], target: int = 0) -> None:
    store.put(
        {
            "prompt_ids": [np.array([3], np.int64)] * len(groups),
            "answer": [b"0"] * len(groups),
            "target_step": np.full(len(groups), target, np.int64),
        },
        partition=PROMPTS,
        groups=np.array(groups),
        group_size=1,
    )


def test_samples_already_in_are_left_out_the_step_listed_only_after_a_refused_put() -> None:
    """A group whose samples are in (put by a worker that died before acking its prompts) is
    not put again: the store refuses the put that would give it more rows than its size, and
    only then is the step partition listed, and the other groups put."""
    store = Counting()
    ctx = context(store, "rollout.groups_per_call=2")
    worker = Rollout(ctx, Shared(), "rollout-0")
    put_prompts(store, [0, 1, 2])
    # Group 1's samples are in already, from a holder of its prompt that died.
    store.put({"response_ids": [np.array([5], np.int64)] * 2}, partition="step-0", groups=[1, 1])
    first = worker._claim()
    assert first is not None and first.groups.tolist() == [0, 1]
    worker._deliver(first, 0, Shared().generate([[3], [3]], worker.sampling))
    assert store.calls["rows of step-0"] == 1
    assert sorted(store.rows(partition="step-0").groups.tolist()) == [0, 0, 1, 1]
    second = worker._claim()
    assert second is not None and second.groups.tolist() == [2]
    worker._deliver(second, 0, Shared().generate([[3]], worker.sampling))  # nothing in: no listing
    assert store.calls["rows of step-0"] == 2  # (the check above listed once)
    assert sorted(store.rows(partition="step-0").groups.tolist()) == [0, 0, 1, 1, 2, 2]
    # Every prompt was acked, the one whose samples were in included.
    assert len(store.claim("rollout", "prompt_ids", 3, timeout=0, allow_partial=True)) == 0


def test_a_feeder_ahead_of_the_trainer_sleeps_until_a_step_is_trained() -> None:
    """No polling: with an idle wait of an hour, only the trainer's notice can wake it."""
    store = Counting()
    ctx = context(store, "trainer.max_staleness=0", "trainer.max_steps=4", "run.poll_interval=3600")
    feeder = Feeder(ctx, ArithmeticTask())
    assert feeder.step() and feeder.step()  # steps 0 and 1: the trainer may be one behind
    puts = store.calls["put"]
    waiting = threading.Thread(target=feeder.step, daemon=True)
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and store.calls["put"] == puts  # step 2 waits for step 0
    with ctx.state.lock:
        ctx.state.trained_steps = 1
        ctx.state.progressed.notify_all()
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    assert feeder.step() and store.calls["put"] == puts + 1
    assert feeder.next_group == 3 * ctx.config.trainer.groups_per_step
