"""Partial rollout: the rollout worker drives its engine request by request, one decode step at a
time, keeping up to ``rollout.max_num_seqs`` sequences in flight and admitting prompt groups as
others finish; newer weights are loaded between two decode steps, while sequences are in flight.

``rollout.partial``: ``continue`` loads them in place and goes on with every in-flight sequence
(the KV cache its earlier tokens left, computed by the old weights, is kept); ``abort`` cuts the
in-flight sequences, loads them, and admits the sequences again with their generated prefix,
which the engine prefills under the new weights. Every token keeps the version that sampled it
and the log-prob it was sampled with (``token_versions`` beside ``behaviour_logprobs``); a
sample's version, by which staleness is judged, is that of its oldest token.

A group's samples go into the store together once all of its sequences have finished, and only
then are its prompt rows acked: a worker that dies loses only its in-flight sequences, whose
prompts return to the store (released here, or when their lease expires). A group may stay in
flight longer than ``store.lease_timeout`` (queued behind others, or long), so the process's lease
keeper renews the leases of the groups it holds every third of that timeout, whatever the worker
is doing meanwhile (a long decode step, a weight load).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from asyncflow.batch import Batch
from asyncflow.engines.base import Completion, Request, RolloutEngine
from asyncflow.errors import StoreError
from asyncflow.workers.base import Context
from asyncflow.workers.rollout import PromptGroups, Rollout
from asyncflow.workers.routing import Dispatcher


@dataclass
class _Group:
    """One prompt group in flight: its work item, its finished samples so far, and the keeping of
    its prompt's lease."""

    work: PromptGroups
    done: dict[int, Completion] = field(default_factory=dict)
    kept: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)


class PartialRollout(Rollout):
    """The rollout worker of ``rollout.partial: continue | abort``."""

    def __init__(
        self,
        ctx: Context,
        engine: RolloutEngine,
        name: str = "rollout",
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__(ctx, engine, name, dispatcher)
        if not engine.supports_requests:
            raise ValueError(
                f"rollout.partial={self.config.rollout.partial} needs a rollout engine with a "
                f"request-level loop; {engine.name!r} has none (use rollout.engine=hf)"
            )
        self.mode = self.config.rollout.partial
        self.groups: dict[int, _Group] = {}
        #: Admission waits for this version under the ``wait`` staleness policy.
        self._needs_version = 0
        #: The dispatcher's count of rerouted groups when this worker last looked for its own.
        self._reroutes_seen = 0

    def run(self) -> None:
        try:
            super().run()
        finally:
            # Stopped or failed, the worker hands its unfinished groups back: their leases were
            # otherwise renewed for as long as the process lived, its engine decoding on.
            self.release_in_flight()

    def step(self) -> bool:
        self._cut_rerouted()
        self._update_weights()
        self._admit()
        if self.engine.in_flight():
            with self.busy(f"decode v{self.engine.version}"):
                finished = self.engine.step()
            for request in finished:
                self._finish(request)
        return True

    def note_progress(self, progressed: bool, waiting_for: str) -> None:
        # Sequences in flight are progress: a long generation is no stall for want of prompts.
        super().note_progress(progressed or self.engine.in_flight() > 0, waiting_for)

    def claim(
        self,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float | None = None,
        **options: Any,
    ) -> Batch:
        """As :meth:`Worker.claim`, but with sequences in flight it does not wait for rows:
        decoding goes on meanwhile."""
        if not self.engine.in_flight():
            return super().claim(task, fields, batch_size, timeout, **options)
        batch = self.store.claim(
            task, list(fields), batch_size, timeout=0.0, allow_partial=True, **options
        )
        self.note_progress(True, "")
        return batch

    def _update_weights(self) -> None:
        # Under abort, the sequences in flight are cut only once the new weights are in: a
        # version that fails to load, or that the store is slow to deliver, cuts nothing (every
        # decode step would otherwise prefill them all again while it is retried).
        if self.sync_weights_in_flight() and self.mode == "abort":
            for request in self.engine.abort_requests():
                self.engine.add_request(request)  # its prefix prefilled again under them

    def _cut_rerouted(self) -> None:
        """Cuts the sequences of the groups handed to another engine while this one was silent
        (a decode step or a weight load that outlasted ``rollout.heartbeat_timeout``): the other
        engine generates them now, and what this one finished of them would be discarded."""
        if self.dispatcher is None or self.dispatcher.reroutes == self._reroutes_seen:
            return
        self._reroutes_seen = self.dispatcher.reroutes  # read first: a later reroute counts again
        gone = [g for g in self.groups if not self.dispatcher.still_assigned(self.role, g)]
        if not gone:
            return
        self.engine.abort_requests({(g, i) for g in gone for i in range(self.sampling.n)})
        for g in gone:
            self.groups.pop(g).kept.close()  # its prompt's lease is the dispatcher's to keep

    def _room(self) -> int:
        return self.config.rollout.max_num_seqs - self.engine.in_flight()

    def _admit(self) -> None:
        """Claims prompt groups while their sequences fit (a group at a time at least, when the
        engine is idle)."""
        n = self.sampling.n
        idle = self.engine.in_flight() == 0
        if self.engine.version < self._needs_version or (self._room() < n and not idle):
            if idle and self.engine.version < self._needs_version:
                self._wait_for_weights(self._needs_version)
            elif self.dispatcher is not None:
                self.dispatcher.report(self.role)
            return
        groups = max(1, min(self.config.rollout.groups_per_call, self._room() // n))
        if self.inbox is None:
            work = self._claim(groups)
        else:  # with sequences in flight, decoding goes on rather than waiting for groups
            work = self._take(0.0 if self.engine.in_flight() else None, groups)
        if work is None:
            return
        if self.config.trainer.staleness_policy == "wait":
            oldest_allowed = work.target - self.config.trainer.max_staleness
            if self.engine.version < oldest_allowed:
                self._settle(work, done=False)
                self._needs_version = oldest_allowed
                return
        for one in split(work):
            group = int(one.groups[0])
            if group in self.groups:
                # Its lease ran out while it was generating and it came back to us: the new
                # lease is the one to keep and ack with; its sequences are already in flight.
                entry = self.groups[group]
                entry.kept.close()
                entry.work = one
                entry.kept.enter_context(self.holding(*one.leases()))
                continue
            self.groups[group] = entry = _Group(one)
            entry.kept.enter_context(self.holding(*one.leases()))
            for i in range(n):
                sampling = replace(self.sampling, n=1)
                self.engine.add_request(Request((group, i), one.prompts[0].tolist(), sampling))

    def _finish(self, request: Request) -> None:
        group, i = request.key
        entry = self.groups.get(group)
        if entry is None:  # its group was handed back meanwhile
            return
        entry.done[i] = self.engine.finish_text(request)
        if len(entry.done) < self.sampling.n:
            return
        del self.groups[group]
        entry.kept.close()
        outputs = [[entry.done[k] for k in range(self.sampling.n)]]
        self._deliver(entry.work, self.engine.version, outputs)

    def release_in_flight(self) -> None:
        """Hands the prompts of every unfinished group back (none of their tokens is kept), and
        stops their sequences."""
        groups, self.groups = self.groups, {}
        if groups:
            with contextlib.suppress(Exception):  # an engine that failed may fail again
                self.engine.abort_requests({(g, i) for g in groups for i in range(self.sampling.n)})
        for entry in groups.values():
            entry.kept.close()
            # Should the store refuse, the prompts' leases expire and return them anyway.
            with contextlib.suppress(StoreError):
                self._settle(entry.work, done=False)


def split(work: PromptGroups) -> list[PromptGroups]:
    """One work item per prompt group, each settled on its own."""
    return [
        PromptGroups(
            [work.prompts[k]],
            [work.answers[k]],
            np.array([work.groups[k]]),
            work.target,
            batch=work.batch,
            assignments=None if work.assignments is None else [work.assignments[k]],
        )
        for k in range(len(work.prompts))
    ]


def rollout_worker(
    ctx: Context, engine: RolloutEngine, name: str, dispatcher: Dispatcher | None = None
) -> Rollout:
    """The rollout worker ``rollout.partial`` asks for."""
    if ctx.config.rollout.partial == "off":
        return Rollout(ctx, engine, name, dispatcher)
    return PartialRollout(ctx, engine, name, dispatcher)
