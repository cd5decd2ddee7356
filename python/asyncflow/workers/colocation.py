"""Colocated mode (``rollout.sleep_while_training``): the rollout engines and the trainer take
turns on one GPU. Once a step's samples are all in, the trainer puts every engine to sleep, steps,
publishes the new version and wakes them; rollout workers pass a gate before each engine call
(loading weights, generating), shut while the engines sleep, so a version published during the
step is loaded only into an awake engine, before the next generation.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from asyncflow.engines.base import RolloutEngine

#: A trace span by name (a worker's ``busy``).
Span = Callable[[str], AbstractContextManager[Any]]


def release_cached_gpu_memory() -> None:
    """Hands the memory torch's allocator keeps cached (a training step's activations and
    gradients) back to the driver, so that sleeping engines can take it back on waking."""
    import torch  # noqa: PLC0415 - only colocated runs get here

    if torch.cuda.is_initialized():  # else this process never used the GPU: nothing cached
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _each(calls: Iterator[Callable[[], None]]) -> None:
    """Makes every call, even after one raises; then raises the first error."""
    first: BaseException | None = None
    for call in calls:
        try:
            call()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


class EngineSleep:
    """Puts ``engines`` to sleep for training steps, and keeps their workers off them meanwhile."""

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        # Workers may share an engine: each sleeps and wakes once.
        self.engines = list({id(e): e for e in engines}.values())
        self._changed = threading.Condition()
        self._asleep = False
        #: Engine calls under way (:meth:`awake` blocks), which a step waits for.
        self._in_use = 0
        #: Steps the engines slept through, and the seconds putting them to sleep and waking
        #: them took (the price of sharing the GPU), for the run's summary.
        self.steps = 0
        self.sleep_seconds = 0.0
        self.wake_seconds = 0.0

    @contextlib.contextmanager
    def awake(self, stop: threading.Event, poll: float) -> Iterator[bool]:
        """Holds the engines awake for one call; waits while they sleep. Yields False (and
        holds nothing) if ``stop`` is set first: the run is ending."""
        with self._changed:
            while self._asleep and not stop.is_set():
                self._changed.wait(poll)
            entered = not self._asleep
            self._in_use += entered
        if not entered:
            yield False
            return
        try:
            yield True
        finally:
            with self._changed:
                self._in_use -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def training(self, span: Span = lambda name: contextlib.nullcontext()) -> Iterator[None]:
        """The engines asleep for one training step (once the calls under way have ended), then
        awake again, also when the step fails. ``span`` names each phase for the trace."""
        with self._changed:
            self._asleep = True  # no new call starts
            while self._in_use:
                self._changed.wait()
        slept: list[RolloutEngine] = []
        try:
            since = time.monotonic()
            with span("engines to sleep"):
                for engine in self.engines:
                    engine.sleep()
                    slept.append(engine)
            self.sleep_seconds += time.monotonic() - since
            self.steps += 1
            yield
        finally:
            try:
                release_cached_gpu_memory()  # what the step used, for the engines to take back
                since = time.monotonic()
                with span("engines wake up"):
                    _each(engine.wake_up for engine in slept)
                self.wake_seconds += time.monotonic() - since
            finally:
                with self._changed:
                    self._asleep = False
                    self._changed.notify_all()

    def summary(self) -> dict[str, Any]:
        """What sharing the GPU cost: steps slept through, seconds spent going to sleep and
        waking (vLLM moves the weights to host memory and back)."""
        return {
            "steps": self.steps,
            "sleep_seconds": round(self.sleep_seconds, 3),
            "wake_seconds": round(self.wake_seconds, 3),
        }
