"""Colocated mode (``rollout.sleep_while_training``): the rollout engines and the trainer take
turns on one GPU. Once a step's samples are all in, the trainer puts every engine to sleep, steps,
publishes the new version and wakes them; rollout workers pass a gate before each engine call
(loading weights, generating), shut while the engines sleep, so a version published during the
step is loaded only into an awake engine, before the next generation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from asyncflow.engines.base import RolloutEngine


class EngineSleep:
    """Puts ``engines`` to sleep for training steps, and keeps their workers off them meanwhile."""

    def __init__(self, engines: Sequence[RolloutEngine]) -> None:
        # Workers may share an engine: each sleeps and wakes once.
        self.engines = list({id(e): e for e in engines}.values())
        self._changed = threading.Condition()
        self._asleep = False
        #: Engine calls under way (:meth:`awake` blocks), which a step waits for.
        self._in_use = 0

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
    def training(self) -> Iterator[None]:
        """The engines asleep for one training step (once the calls under way have ended), then
        awake again, also when the step fails."""
        with self._changed:
            self._asleep = True  # no new call starts
            while self._in_use:
                self._changed.wait()
        slept: list[RolloutEngine] = []
        try:
            for engine in self.engines:
                engine.sleep()
                slept.append(engine)
            yield
        finally:
            try:
                for engine in slept:
                    engine.wake_up()
            finally:
                with self._changed:
                    self._asleep = False
                    self._changed.notify_all()
