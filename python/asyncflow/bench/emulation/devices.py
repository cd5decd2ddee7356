"""Emulated accelerators: they spend modelled time (sleeping) instead of computing, so one small
machine can stand in for a cluster while the real workers, store and scheduler drive them.

- :class:`DecodeDevice` serves generation with continuous batching: up to ``max_batch``
  sequences decode together, a decode step costs ``decode_step(batch)``, and a finished sequence's
  slot goes to the next queued one at once. Calls from several workers share the batch.
- :class:`DevicePool` is a set of devices that roles time-share: generation holds it shared (each
  device serves its own batch); reference and training hold all of it. Moving it between the
  two sides costs the configured switch time.
- :class:`BusyMeter` records which role kept how many devices busy when.

Modelled seconds become real ones divided by ``compression``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from asyncflow.bench.costs import Rollout

#: Busy spans closer than this (real seconds) are merged into one.
_MERGE_GAP = 1e-4
#: Seconds between a waiting caller's checks that the serving thread is still alive.
_CALLER_CHECK = 10.0


class BusyMeter:
    """Spans of ``(role, start, end, devices)`` on the monotonic clock, which every process on
    the machine shares."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], list[float]] = {}
        self.spans: list[tuple[str, float, float, int]] = []

    def add(self, role: str, key: str, start: float, end: float, devices: int = 1) -> None:
        """Records ``devices`` devices busy for ``role`` in ``[start, end]``; ``key`` names the
        device (spans of one key that touch are merged)."""
        with self._lock:
            last = self._open.get((role, key))
            if last is not None and start - last[1] <= _MERGE_GAP and last[2] == devices:
                last[1] = end
                return
            if last is not None:
                self.spans.append((role, last[0], last[1], int(last[2])))
            self._open[(role, key)] = [start, end, devices]

    def all_spans(self) -> list[tuple[str, float, float, int]]:
        with self._lock:
            opened = [(r, s, e, int(d)) for (r, _), (s, e, d) in self._open.items()]
            return self.spans + opened


class DevicePool:
    """Devices time-shared by generation and the training side (reference and training).

    Generation holds the pool shared; the training side holds it exclusively, and only once no
    device has generation work left: in a colocated synchronous step the batch drains before the
    reference and training passes start. The first holder after a move pays the move (offload,
    onload, resharding), which the meter records as role ``switch``.
    """

    def __init__(
        self,
        name: str,
        devices: int,
        meter: BusyMeter,
        compression: float,
        to_train_s: float = 0.0,
        to_generate_s: float = 0.0,
    ) -> None:
        self.name = name
        self.devices = devices
        self._meter = meter
        self._compression = compression
        self._move_s = {"train": to_train_s, "generate": to_generate_s}
        self._cond = threading.Condition()
        self._side = "generate"
        self._sharers = 0
        #: Devices with generation queued or in flight.
        self._generating_devices = 0
        self._exclusive = False
        self._moving = False

    def generation_work(self, started: bool) -> None:
        """A device reports that it has (or no longer has) generation work."""
        with self._cond:
            self._generating_devices += 1 if started else -1
            self._cond.notify_all()

    def _move(self, side: str) -> None:
        """Moves the pool to ``side``; called with the condition held, returns with it held."""
        seconds = self._move_s[side]
        self._moving = True
        self._cond.release()
        try:
            if seconds > 0:
                start = time.monotonic()
                time.sleep(seconds / self._compression)
                self._meter.add("switch", self.name, start, time.monotonic(), self.devices)
        finally:
            self._cond.acquire()
            self._side = side
            self._moving = False
            self._cond.notify_all()

    @contextmanager
    def generating(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._moving:
                self._cond.wait()
            if self._side != "generate":
                self._move("generate")
            self._sharers += 1
        try:
            yield
        finally:
            with self._cond:
                self._sharers -= 1
                self._cond.notify_all()

    @contextmanager
    def training(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._moving or self._sharers or self._generating_devices:
                self._cond.wait()
            self._exclusive = True
            if self._side != "train":
                self._move("train")
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def run(self, role: str, seconds: float) -> None:
        """Holds every device of the pool for ``seconds`` of modelled time of ``role``."""
        with self.training():
            start = time.monotonic()
            time.sleep(seconds / self._compression)
            self._meter.add(role, self.name, start, time.monotonic(), self.devices)


@dataclass
class _Call:
    left: int
    done: threading.Event = field(default_factory=threading.Event)
    #: Called (by the serving thread) once the call's last sequence is done.
    on_done: Callable[[], None] | None = None


@dataclass
class _Sequence:
    #: Decode steps (response tokens) still to go.
    remaining: int
    prompt_tokens: int
    call: _Call


@dataclass
class _Pause:
    seconds: float
    done: threading.Event = field(default_factory=threading.Event)


class DecodeDevice:
    """One accelerator generating with continuous batching, in modelled time.

    A background thread advances the batch: it sleeps until the next sequence finishes (or new
    work arrives while slots are free), then credits the decode steps the elapsed time paid for.
    Prefill of admitted prompts and pauses (weight loads) are paid before decoding goes on.
    """

    def __init__(
        self, name: str, cost: Rollout, pool: DevicePool, meter: BusyMeter, compression: float
    ) -> None:
        self.name = name
        self._cost = cost
        self._pool = pool
        self._meter = meter
        self._compression = compression
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        #: Signalled (one waiter at a time) when the last queued sequence gets a slot.
        self._room = threading.Condition(lock)
        self._queue: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._pauses: deque[_Pause] = deque()
        #: Modelled seconds owed before decoding goes on (prefill).
        self._debt = 0.0
        #: Modelled seconds already spent on the decode step in progress.
        self._carry = 0.0
        self._closed = False
        #: Whether the pool has been told this device has work.
        self._reported = False
        #: CPU seconds the serving thread spent, once it has ended: the emulator's own work, not
        #: the framework's.
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def generate(self, lengths: list[int], prompt_tokens: int) -> bool:
        """Decodes responses of the given lengths (tokens); returns once all are done, or False
        if the device was closed first."""
        if not lengths:
            return True
        call = _Call(len(lengths))
        with self._cond:
            self._queue.extend(_Sequence(n, prompt_tokens, call) for n in lengths)
            self._report_work()
            if len(self._active) < self._cost.max_batch:
                self._cond.notify_all()
        self._wait(call.done)
        return not self._closed

    def start(self, length: int, prompt_tokens: int, on_done: Callable[[], None]) -> _Sequence:
        """Queues one sequence of ``length`` decode steps (after a prefill of ``prompt_tokens``)
        without waiting for it; ``on_done`` is called once it is done. Its ``remaining`` steps
        are current after any :meth:`pause` has returned."""
        seq = _Sequence(length, prompt_tokens, _Call(1, on_done=on_done))
        with self._cond:
            self._queue.append(seq)
            self._report_work()
            self._cond.notify_all()
        return seq

    def cut(self, sequences: list[_Sequence]) -> list[_Sequence]:
        """Takes these sequences out of the batch and the queue (their ``remaining`` steps stay
        as they are) and returns those it found there: not those that ended meanwhile. The
        decode steps since the last wake-up of the serving thread are not credited to them, so
        a :meth:`pause` first makes the cut exact."""
        with self._cond:
            gone = {id(s) for s in sequences}
            found = [s for s in [*self._active, *self._queue] if id(s) in gone]
            self._active = [s for s in self._active if id(s) not in gone]
            self._queue = deque(s for s in self._queue if id(s) not in gone)
            self._report_work()
            self._cond.notify_all()
        return found

    def wait_for_room(self, timeout: float) -> bool:
        """Waits until no sequence is waiting for a slot. One waiter is woken each time the
        queue empties: it will queue its own call, so the next waits for that one to start."""
        with self._cond:
            return self._room.wait_for(lambda: not self._queue or self._closed, timeout)

    def pause(self, seconds: float) -> None:
        """Stops decoding for ``seconds`` of modelled time (e.g. to load weights); returns when
        the pause is over. Sequences in flight resume afterwards."""
        pause = _Pause(seconds)
        with self._cond:
            self._pauses.append(pause)
            self._report_work()
            self._cond.notify_all()
        self._wait(pause.done)

    def _wait(self, done: threading.Event) -> None:
        """Waits for ``done``, which the serving thread sets, also for everything left when the
        device closes. Each of the many callers' wake-ups costs the GIL: they wake early only if
        that thread has died."""
        while not done.wait(_CALLER_CHECK) and self._thread.is_alive():
            pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._room.notify_all()
        self._thread.join(timeout=5)

    # -- the serving thread -----------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._serve_until_closed()
        finally:
            self.cpu_s = time.thread_time()

    def _serve_until_closed(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._pauses or self._queue or self._active):
                    self._cond.wait()
                if self._closed:
                    self._release_all()
                    return
                pause = self._pauses.popleft() if self._pauses else None
                planned = 0.0 if pause else self._plan()
            with self._pool.generating():
                start = time.monotonic()
                if pause is not None:
                    time.sleep(pause.seconds / self._compression)
                else:
                    with self._cond:
                        if not self._interrupting():
                            self._cond.wait(planned / self._compression)
                end = time.monotonic()
            if pause is not None:
                self._meter.add("weight_load", self.name, start, end)
            else:
                self._meter.add("rollout", self.name, start, end)
                # Sequence-seconds in flight: their ratio to max_batch is the batch's fill.
                self._meter.add("decode_slots", self.name, start, end, len(self._active))
            with self._cond:
                if pause is not None:
                    pause.done.set()
                else:
                    self._advance((end - start) * self._compression)
                self._report_work()

    def _report_work(self) -> None:
        """Tells the pool when this device gains or runs out of work (condition held)."""
        working = bool(self._active or self._queue or self._pauses)
        if working != self._reported:
            self._reported = working
            self._pool.generation_work(working)

    def _interrupting(self) -> bool:
        """Whether something arrived that should end the current wait at once."""
        free = len(self._active) < self._cost.max_batch
        return self._closed or bool(self._pauses) or (free and bool(self._queue))

    def _plan(self) -> float:
        """Admits queued sequences into free slots; returns the modelled seconds until the next
        sequence finishes."""
        admitted = bool(self._queue)
        while self._queue and len(self._active) < self._cost.max_batch:
            seq = self._queue.popleft()
            self._active.append(seq)
            self._debt += seq.prompt_tokens / self._cost.prefill_tokens_per_s
        if admitted and not self._queue:
            self._room.notify()
        if not self._active:  # everything was cut: only prefill debt is left
            return self._debt
        step = self._cost.decode_step(len(self._active))
        soonest = min(s.remaining for s in self._active)
        return max(0.0, self._debt + soonest * step - self._carry)

    def _advance(self, elapsed: float) -> None:
        """Credits ``elapsed`` modelled seconds: prefill debt first, then whole decode steps."""
        paid = min(elapsed, self._debt)
        self._debt -= paid
        budget = elapsed - paid + self._carry
        while self._active:
            step = self._cost.decode_step(len(self._active))
            steps = min(int(budget // step), *(s.remaining for s in self._active))
            if steps == 0:
                break
            budget -= steps * step
            for seq in self._active:
                seq.remaining -= steps
            finished = [s for s in self._active if s.remaining == 0]
            # One pass, not a ``remove`` per finished sequence (each compares the dataclasses
            # before it field by field): this thread's CPU counts as the framework's overhead.
            self._active = [s for s in self._active if s.remaining != 0]
            for seq in finished:
                seq.call.left -= 1
                if seq.call.left == 0:
                    seq.call.done.set()
                    if seq.call.on_done is not None:
                        seq.call.on_done()
        self._carry = budget if self._active else 0.0

    def _release_all(self) -> None:
        for seq in [*self._active, *self._queue]:
            seq.call.done.set()
        for pause in self._pauses:
            pause.done.set()
