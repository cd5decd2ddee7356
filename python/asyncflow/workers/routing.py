"""Several rollout engines behind the scheduler's :class:`~asyncflow.scheduler.Router`.

A dispatcher claims prompt groups from the store and routes each to the live engine with the least
outstanding tokens; each engine's worker takes what it was given from its inbox. Engines report
their load after every generation call and while idle, so one that has not finished a call for
``rollout.heartbeat_timeout`` seconds is taken out of rotation and its unfinished groups go to
another; if none is left, the run fails with an error naming the silent engines. The dispatcher
keeps a claim's lease from its claim until its last group completes: a group may wait in an
inbox behind a full engine for longer than ``store.lease_timeout``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from asyncflow.batch import Batch
from asyncflow.engines.errors import EngineTimeoutError
from asyncflow.scheduler import Router
from asyncflow.workers.base import Context, Worker

#: Generation calls' worth of prompt groups an engine may have waiting in its inbox.
DEPTH = 2


@dataclass
class Assignment:
    """One prompt group (one prompt row) routed to an engine."""

    batch: Batch
    index: int
    group: int
    prompt: np.ndarray
    answer: bytes
    target: int
    tokens: int


class Inbox:
    """The prompt groups routed to one engine and not yet taken."""

    def __init__(self) -> None:
        self._items: list[Assignment] = []
        self._ready = threading.Condition()

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)

    def tokens(self) -> int:
        with self._ready:
            return sum(a.tokens for a in self._items)

    def put(self, items: Sequence[Assignment]) -> None:
        with self._ready:
            self._items.extend(items)
            self._ready.notify_all()

    def take(self, most: int, timeout: float) -> list[Assignment]:
        """Up to ``most`` groups of the oldest target step, waiting up to ``timeout`` for any."""
        with self._ready:
            if not self._items:
                self._ready.wait(timeout)
            if not self._items:
                return []
            target = min(a.target for a in self._items)
            taken = [a for a in self._items if a.target == target][:most]
            self._items = [a for a in self._items if all(a is not t for t in taken)]
            return taken

    def remove(self, group: int) -> Assignment | None:
        with self._ready:
            for i, a in enumerate(self._items):
                if a.group == group:
                    return self._items.pop(i)
        return None


class Dispatcher(Worker):
    """Claims prompt groups and routes them to the engines' inboxes."""

    role = "router"

    def __init__(self, ctx: Context, inboxes: dict[str, Inbox]) -> None:
        super().__init__(ctx)
        self.inboxes = inboxes
        self.router = Router(list(inboxes), heartbeat_timeout=self.config.rollout.heartbeat_timeout)
        #: Routed and not completed, by group: what to hand over if its engine falls silent.
        self.routed: dict[int, Assignment] = {}
        #: Re-entrant: an engine's worker holds it across its checks and its put.
        self.lock = threading.RLock()
        self._unroutable: list[Assignment] = []
        #: The hold on each claim's lease while any of its groups is routed or waits for an
        #: engine.
        self._held: dict[int | None, contextlib.ExitStack] = {}
        #: Groups handed from a silent engine to another so far: an engine's worker that sees
        #: it change looks for groups of its own that went (see ``PartialRollout``).
        self.reroutes = 0
        #: The router's clock (a test's may jump).
        self.clock: Callable[[], float] = time.monotonic

    # -- called by the engines' workers -------------------------------------------------------

    def report(self, engine: str) -> None:
        inbox = self.inboxes[engine]
        with self.lock:
            self.router.report(engine, inbox.tokens(), len(inbox), now=self.clock())

    def still_assigned(self, engine: str, group: int) -> bool:
        with self.lock:
            return self.router.assigned_to(group) == engine

    def complete(self, groups: Sequence[int]) -> None:
        with self.lock:
            for g in groups:
                item = self.routed.pop(g, None)
                if item is None:
                    continue
                self.router.complete(g)
                waiting = [*self.routed.values(), *self._unroutable]
                if all(a.batch is not item.batch for a in waiting):
                    self._held.pop(item.batch.lease).close()  # its last group

    def run(self) -> None:
        try:
            super().run()
        finally:
            with self.lock:  # the run is over: the holds end with it
                for stack in self._held.values():
                    stack.close()
                self._held.clear()

    # -- the dispatcher's own loop ------------------------------------------------------------

    def _route(self, items: Sequence[Assignment]) -> None:
        for item in items:
            engine = self.router.route(item.group, item.tokens, now=self.clock())
            if engine is None:
                self._unroutable.append(item)
                continue
            self.routed[item.group] = item
            self.inboxes[engine].put([item])

    def _expire(self) -> None:
        with self.lock:
            moved = self.router.expire(now=self.clock())
            for m in moved:
                item = self.routed.pop(m.work, None)
                if item is None:
                    continue
                self.ctx.state.add(rerouted_groups=1)
                self.reroutes += 1
                self.inboxes[m.source].remove(m.work)
                if m.to is None:
                    self._unroutable.append(item)
                else:
                    self.routed[m.work] = item
                    self.inboxes[m.to].put([item])
            waiting, self._unroutable = self._unroutable, []
            self._route(waiting)
        if self._unroutable:
            silent = [e.name for e in self.router.engines() if not e.in_rotation]
            raise EngineTimeoutError(
                f"no rollout engine is live: {', '.join(silent)} did not finish a generation "
                f"call within {self.config.rollout.heartbeat_timeout:.0f}s "
                "(rollout.heartbeat_timeout)"
            )

    def step(self) -> bool:
        self._expire()
        per_call = self.config.rollout.groups_per_call
        if sum(len(i) for i in self.inboxes.values()) >= DEPTH * per_call * len(self.inboxes):
            with self.waiting("engines"):
                self.ctx.stop.wait(0.02)
            return True
        batch = self.claim("rollout", ["prompt_ids", "answer", "target_step"], per_call)
        if len(batch) == 0:
            return True
        data = batch.read()
        expected = self.config.rollout.n * self.config.rollout.max_tokens
        items = [
            Assignment(
                batch,
                int(batch.indexes[i]),
                int(batch.groups[i]),
                data["prompt_ids"][i],
                data["answer"][i],
                int(data["target_step"][i]),
                expected + self.config.rollout.n * len(data["prompt_ids"][i]),
            )
            for i in range(len(batch))
        ]
        with self.lock:
            self._held[batch.lease] = contextlib.ExitStack()
            self._held[batch.lease].enter_context(self.holding(batch))
            self._route(items)
        return True
