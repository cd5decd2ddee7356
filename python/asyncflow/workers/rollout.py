"""Rollout: prompt groups -> n responses each, with per-token behaviour log-probs and the policy
version used. New weights are loaded between generation batches (deferred update), never mid-batch.

With several engines, a dispatcher routes prompt groups to them (see
:mod:`asyncflow.workers.routing`) and each engine's worker takes its groups from its inbox instead
of claiming them from the store.

Staleness: the samples of training step ``S`` must come from policy version ``>= S - k``. Under
``wait`` the worker waits for such weights before generating; under ``drop`` it generates with
what it has and the trainer discards samples that turn out too stale.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from asyncflow import errors
from asyncflow.batch import Batch
from asyncflow.columns import Ragged
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.engines.errors import WeightLoadError
from asyncflow.errors import StoreError
from asyncflow.weight_sync.source import WeightsNotHereError, WeightSource
from asyncflow.workers.base import Context, Worker, step_partition
from asyncflow.workers.routing import Assignment, Dispatcher, Inbox

FIELDS = ["prompt_ids", "answer", "target_step"]

#: The claim lock of each engine, shared by the workers that drive it (``Rollout._claim_in_turn``).
_CLAIM_LOCKS: weakref.WeakKeyDictionary[RolloutEngine, threading.Lock] = weakref.WeakKeyDictionary()
_CLAIM_LOCKS_LOCK = threading.Lock()


@dataclass
class PromptGroups:
    """Prompt groups taken for one generation call, all for one target step; from a claim of
    this worker's own, or from the dispatcher (then ``batch`` is None)."""

    prompts: list[np.ndarray]
    answers: list[bytes]
    groups: np.ndarray
    target: int
    batch: Batch | None = None
    assignments: list[Assignment] | None = None

    def leases(self) -> list[Batch]:
        """The claims whose leases hold these prompts, each once."""
        held = [self.batch] if self.assignments is None else [a.batch for a in self.assignments]
        return list({b.lease: b for b in held if b is not None}.values())


class Rollout(Worker):
    role = "rollout"

    def __init__(
        self,
        ctx: Context,
        engine: RolloutEngine,
        name: str = "rollout",
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.role = name
        self.dispatcher = dispatcher
        self.inbox: Inbox | None = dispatcher.inboxes[name] if dispatcher is not None else None
        r = self.config.rollout
        self.sampling = Sampling(n=r.n, temperature=r.temperature, max_tokens=r.max_tokens)
        #: Versions whose weights failed to load; newer ones are still tried.
        self._unloadable: set[int] = set()
        #: Whether the last load failed for the store's trouble, not the version's, and when
        #: a load with work in flight may try again (:meth:`sync_weights_in_flight`).
        self._undelivered = False
        self._retry_at = 0.0
        with _CLAIM_LOCKS_LOCK:
            self._claim_lock = _CLAIM_LOCKS.setdefault(engine, threading.Lock())

    def sync_weights(self, traced: bool = True) -> bool:
        """Loads the newest weights of the run's weight source if they are newer than the
        engine's; returns whether it did. A version that fails to load (see
        :func:`load_version`) is reported and skipped; the engine goes on with the version it
        had. One the store failed to deliver is tried again at the next call (a worker waiting
        for it waits a poll interval first: :meth:`_wait_for_weights`). While the newest version
        is one that failed, the one before it (:meth:`_loadable`) is loaded if it is newer than
        the engine's. The load is a span of its own on the worker's timeline unless
        ``traced`` is false (a caller already inside one)."""
        self._undelivered = False
        version = self._loadable()
        if version is None:
            return False
        with self.engine.load_lock:
            if version <= self.engine.version:
                return False  # another worker sharing the engine loaded it meanwhile
            span = self.busy(f"load weights v{version}") if traced else contextlib.nullcontext()
            with span:
                try:
                    failure = load_version(self.ctx.weights, self.engine, version)
                    delivered = True
                except TRANSIENT:
                    delivered = False  # the store's trouble, not the version's
        self._undelivered = not delivered
        if not delivered:
            return False
        if failure is not None:
            failed, why = failure
            if failed not in self._unloadable:
                self.ctx.state.note_weight_failure(why)
            # ``version`` too: the source went on to ``failed`` because it was gone.
            self._unloadable.update((failed, version))
            return False
        return True

    def sync_weights_in_flight(self, traced: bool = True) -> bool:
        """:meth:`sync_weights` between two decode steps or engine calls of work in flight, but
        not again within a poll interval of a load the store failed to deliver: each try may
        wait out the store's timeout, and the work in flight goes on meanwhile with the weights
        it has."""
        if self._undelivered and time.monotonic() < self._retry_at:
            return False
        loaded = self.sync_weights(traced)
        if self._undelivered:
            self._retry_at = time.monotonic() + self.config.run.poll_interval
        return loaded

    def _loadable(self) -> int | None:
        """The version to load next: the newest if it is newer than the engine's and has not
        failed to load, else the one before it under the same conditions where the weight source
        keeps it (the store does, ``weights.KEEP_VERSIONS``), else None. A prompt that needs no
        newer version than that one is not held up by the newest having failed."""
        newest = self.ctx.weights.latest()
        if newest is None:
            return None
        kept = (newest, newest - 1) if self.ctx.weights.keeps_previous else (newest,)
        for version in kept:
            if version <= self.engine.version:
                return None
            if version not in self._unloadable:
                return version
        return None

    def _claim(self, groups: int | None = None) -> PromptGroups | None:
        groups = groups or self.config.rollout.groups_per_call
        batch = self.claim("rollout", FIELDS, groups)
        if len(batch) == 0:
            return None
        data = batch.read()
        targets = np.array([int(t) for t in data["target_step"]])
        target = int(targets.min())
        later = targets > target
        if later.any():  # one target step per call, oldest first
            batch.release(batch.indexes[later])
        keep = np.flatnonzero(~later)
        return PromptGroups(
            [data["prompt_ids"][i] for i in keep],
            [data["answer"][i] for i in keep],
            batch.groups[keep],
            target,
            batch=batch,
        )

    def _take(self, timeout: float | None = None, groups: int | None = None) -> PromptGroups | None:
        """Up to ``groups`` (default ``rollout.groups_per_call``) of the groups routed to this
        engine, waiting up to ``timeout`` (default: the poll interval)."""
        assert self.inbox is not None and self.dispatcher is not None
        self.dispatcher.report(self.role)  # a heartbeat, also while idle
        wait = self.config.run.poll_interval if timeout is None else timeout
        taken = self.inbox.take(groups or self.config.rollout.groups_per_call, wait)
        self.note_progress(bool(taken), f"prompt groups routed to {self.role}")
        if not taken:
            return None
        return PromptGroups(
            [a.prompt for a in taken],
            [a.answer for a in taken],
            np.array([a.group for a in taken]),
            taken[0].target,
            assignments=taken,
        )

    def _wait_for_weights(self, version: int) -> None:
        """Waits until ``version`` is published or the run stops. Claiming prompts again before
        then would only hand them back: with many workers per engine, that churn costs the store
        and this process more than the generation itself."""
        loadable = self._loadable()
        if loadable is not None and loadable >= version:
            if self._undelivered:
                # The store failed to deliver it: tried again a poll interval from now, not at
                # once, again and again, from a store already in trouble.
                self.ctx.stop.wait(self.config.run.poll_interval)
            return  # loaded at the next weight check
        newest = self.ctx.weights.latest()
        if newest is not None and newest >= version and newest in self._unloadable:
            # Published, but this engine failed to load it: only a newer version can do.
            version = newest + 1
        with self.waiting(f"weights v{version}"):
            while not self.ctx.stop.is_set():
                self.note_progress(False, f"policy weights version {version}")
                if self.dispatcher is not None:
                    self.dispatcher.report(self.role)  # waiting is not falling silent
                    # The dispatcher hears from a waiting worker every poll interval.
                    wait = self.config.run.poll_interval
                else:
                    # Nobody else needs to hear from it: it sleeps until the version comes, the
                    # run stops (the weight source wakes its waiters) or it would be stalled.
                    wait = max(self._idle_wait, self.stall_left())
                if self.ctx.weights.wait_for(version, wait):
                    return

    def _sync_when_awake(self) -> bool:
        """Loads newer weights if any (:meth:`sync_weights`); a version published while the
        engine slept is loaded once it is awake again. False if the run stopped meanwhile."""
        with self._engine_awake() as awake:
            if awake:
                self.sync_weights()
            return awake

    def _needs_newer(self, work: PromptGroups) -> int | None:
        """Under ``staleness_policy: wait``, the oldest policy version that may generate
        ``work`` if the engine's is older; else None."""
        if self.config.trainer.staleness_policy != "wait":
            return None
        oldest_allowed = work.target - self.config.trainer.max_staleness
        return oldest_allowed if self.engine.version < oldest_allowed else None

    def _has_room(self) -> bool:
        """Waits (at most the idle wait) until the engine has room for another call."""
        with self.waiting("engine room"):
            return self.engine.wait_for_room(self._idle_wait)

    def _claim_in_turn(self) -> PromptGroups | None:
        """:meth:`_claim`, with the newest weights loaded and once the engine has room, by one
        worker of the engine at a time: with many workers per engine, each waiting in the store
        for prompts that have not come (and all waking at once when a few do), or each claiming
        a prompt too new for the engine only to hand it back, costs the store and this process
        more than the generation itself. The others wait here in one stretch, without a wake-up
        until the claim before theirs is done; the claims of workers that find prompts follow
        each other at once."""
        with self.waiting("claim turn"):
            self.note_progress(False, "prompt groups (another worker of the engine claims)")
            if not self._claim_lock.acquire(timeout=max(self._idle_wait, self.stall_left())):
                return None
        try:
            if self.ctx.stop.is_set() or not self._sync_when_awake() or not self._has_room():
                return None
            work = self._claim()
            if work is None or (needed := self._needs_newer(work)) is None:
                return work
            # The prompt goes back, and this worker waits for the weights it needs holding the
            # turn: the others would only claim the same prompt to hand it back.
            self._settle(work, done=False)
            self._wait_for_weights(needed)
            return None
        finally:
            self._claim_lock.release()

    @staticmethod
    def _whole_batch(work: PromptGroups) -> Batch | None:
        """The batch ``work`` holds every row of, if it is one claim's (its samples' put can
        then ack it)."""
        batch = work.batch
        if work.assignments is not None or batch is None:
            return None
        return batch if len(work.groups) == len(batch.groups) else None  # (a row per group)

    def _settle(self, work: PromptGroups, done: bool) -> None:
        """Acks the prompt rows (``done``) or hands them back to the store."""
        if work.assignments is None:
            assert work.batch is not None
            batch = work.batch
            if self._whole_batch(work) is not None:
                rows = None  # all of them
            else:
                rows = batch.indexes[np.isin(batch.groups, work.groups)]
            (batch.ack if done else batch.release)(rows)
            return
        assert self.dispatcher is not None
        # The router forgets the groups first: a released row may be claimed and routed again
        # at once.
        self.dispatcher.complete([a.group for a in work.assignments])
        for a in work.assignments:
            (a.batch.ack if done else a.batch.release)([a.index])

    def _engine_awake(self) -> contextlib.AbstractContextManager[bool]:
        """Colocated (``rollout.sleep_while_training``): holds the engine awake for one call,
        waiting while it sleeps through a training step; False if the run stopped meanwhile."""
        if self.ctx.engine_sleep is None:
            return contextlib.nullcontext(True)
        return self.ctx.engine_sleep.awake(self.ctx.stop, self._idle_wait)

    def step(self) -> bool:
        if self.inbox is None:
            work = self._claim_in_turn()
        elif self._sync_when_awake() and self._has_room():
            work = self._take()
        else:
            return True
        if work is None:
            return True
        if (needed := self._needs_newer(work)) is not None:
            self._settle(work, done=False)
            self._wait_for_weights(needed)
            return True
        with self._engine_awake() as awake:
            if not awake:
                self._settle(work, done=False)
                return True
            # Read before generating: an engine shared by several workers may load newer weights
            # while this call is in flight, and a sample is as old as the oldest policy that
            # wrote it.
            version = self.engine.version
            with self.holding(*work.leases()):
                outputs = self._generate(work, version)
        if outputs is None:  # the run stopped during the call: the prompts go back
            self._settle(work, done=False)
            return True
        self._deliver(work, version, outputs)
        return True

    def _generate(self, work: PromptGroups, version: int) -> list[list[Completion]] | None:
        """Each prompt's completions, from ``version`` of the policy (None: the run stopped
        before they were all done)."""
        with self.busy(f"generate v{version}"):
            return self.engine.generate([p.tolist() for p in work.prompts], self.sampling)

    def _deliver(self, work: PromptGroups, version: int, outputs: list[list[Completion]]) -> None:
        """Puts the samples of ``work`` (``version``: that of tokens without their own) and acks
        its prompts."""
        # Holding the router while the samples go in: a group it hands to another engine meanwhile
        # would be generated twice.
        routing = self.dispatcher.lock if self.dispatcher is not None else contextlib.nullcontext()
        with self.ctx.state.snapshot_lock, routing:
            if work.assignments is not None:
                work, outputs = self._drop_rerouted(work, outputs)
                if not work.prompts:
                    return
            newest = self.ctx.weights.latest()
            if newest is not None and newest > work.target:
                # The trainer is past the step (it published the version that follows it) and
                # so had every group it needed: these prompts were delivered already, by a
                # holder that died after putting their samples and before acking them. Their
                # samples again would never be trained.
                self._settle(work, done=True)
                return
            # The prompts of one whole claim are acked by their samples' put.
            ack = self._whole_batch(work)
            try:
                self._put_samples(work, version, outputs, ack)
            except errors.BadRequestError:
                # Refused, as a put that would give a group more rows than its size is: some
                # groups' samples are in already. Put the others (all of them again, if those in
                # were trained and freed meanwhile; a put refused for another reason is refused
                # again, and that error raised).
                fresh, fresh_outputs = self._drop_already_put(work, outputs)
                if fresh.prompts:
                    self._put_samples(fresh, version, fresh_outputs)
                ack = None  # (nothing was acked: the put was refused)
            if ack is None:
                self._settle(work, done=True)

    def _drop_rerouted(
        self, work: PromptGroups, outputs: list[list[Completion]]
    ) -> tuple[PromptGroups, list[list[Completion]]]:
        """Leaves out the groups handed to another engine while this one was too slow."""
        assert work.assignments is not None and self.dispatcher is not None
        mine = [self.dispatcher.still_assigned(self.role, a.group) for a in work.assignments]
        if all(mine):
            return work, outputs
        kept = [a for a, m in zip(work.assignments, mine, strict=True) if m]
        rest = PromptGroups(
            [a.prompt for a in kept],
            [a.answer for a in kept],
            np.array([a.group for a in kept], dtype=np.int64),
            work.target,
            assignments=kept,
        )
        return rest, [o for o, m in zip(outputs, mine, strict=True) if m]

    def _drop_already_put(
        self, work: PromptGroups, outputs: list[list[Completion]]
    ) -> tuple[PromptGroups, list[list[Completion]]]:
        """Leaves out groups whose samples are already in: a worker that died after putting
        them but before acking their prompts had its prompts delivered again, or a holder whose
        lease ended while it still generated put them (its ack then fails)."""
        present = self.store.rows(partition=step_partition(work.target)).groups
        fresh = ~np.isin(work.groups, present)
        if fresh.all():
            return work, outputs
        keep = np.flatnonzero(fresh)
        rest = PromptGroups(
            [work.prompts[i] for i in keep],
            [work.answers[i] for i in keep],
            work.groups[keep],
            work.target,
            work.batch,
            None if work.assignments is None else [work.assignments[i] for i in keep],
        )
        return rest, [outputs[i] for i in keep]

    def _put_samples(
        self,
        work: PromptGroups,
        version: int,
        outputs: list[list[Completion]],
        ack: Batch | None = None,
    ) -> None:
        """Puts each completion as a row, its ragged columns each concatenated once
        (:class:`asyncflow.Ragged`) rather than an array per row; the put acks ``ack``."""
        prompts, answers, groups = work.prompts, work.answers, work.groups
        done = [c for completions in outputs for c in completions]
        per_group = [len(completions) for completions in outputs]
        ids: list[int] = []
        logprobs: list[float] = []
        for c in done:
            ids += c.token_ids
            logprobs += c.logprobs
        lengths = np.array([len(c.token_ids) for c in done], np.int64)
        versions, oldest, spans = token_versions(done, lengths, version)
        prompt_rows = [p for p, k in zip(prompts, per_group, strict=True) for _ in range(k)]
        answer_rows = [a for a, k in zip(answers, per_group, strict=True) for _ in range(k)]
        with self.busy("put samples"):
            self.store.put(
                {
                    "prompt_ids": Ragged(
                        np.concatenate(prompt_rows), [len(p) for p in prompt_rows]
                    ),
                    "response_ids": Ragged(np.array(ids, np.int64), lengths),
                    "behaviour_logprobs": Ragged(np.array(logprobs, np.float32), lengths),
                    "token_versions": Ragged(versions, lengths),
                    "answer": answer_rows,
                },
                partition=step_partition(work.target),
                groups=np.repeat(groups, per_group),
                group_size=self.sampling.n,
                # A sample is as old as its oldest token.
                version=oldest,
                ack=ack,
            )
        self.ctx.state.add(
            generated_tokens=len(ids),
            generated_samples=len(done),
            truncated_responses=sum(c.finish_reason == "length" for c in done),
        )
        self.ctx.state.note_version_spans(spans.tolist())


def token_versions(
    done: list[Completion], lengths: np.ndarray, version: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The completions' tokens' policy versions end to end (``version`` for those of a completion
    that records none), and per completion the version of its oldest token (``version`` for an
    empty one) and the span of its versions."""
    if all(c.token_versions is None for c in done):
        return (
            np.full(int(lengths.sum()), version, np.int64),
            np.full(len(done), version, np.uint64),
            np.zeros(len(done), np.int64),
        )
    flat: list[int] = []
    for c, n in zip(done, lengths.tolist(), strict=True):
        flat += c.token_versions if c.token_versions is not None else [version] * n
    versions = np.array(flat, np.int64)
    starts = np.cumsum(lengths) - lengths
    # reduceat reads one element at an empty row's start: those rows are set apart below.
    some = lengths > 0
    oldest = np.full(len(done), version, np.int64)
    newest = np.full(len(done), version, np.int64)
    if some.any():
        oldest[some] = np.minimum.reduceat(versions, starts[some])
        newest[some] = np.maximum.reduceat(versions, starts[some])
    return versions, oldest.astype(np.uint64), newest - oldest


#: Errors that say nothing against a publication: a version they stop is tried again. The store
#: could not be reached or answered too late, or the version is not (or no longer) there and no
#: newer one is (a resumed run republishes it).
TRANSIENT = (errors.ConnectionError, errors.StoreTimeoutError, WeightsNotHereError)


def load_version(
    source: WeightSource, engine: RolloutEngine, version: int
) -> tuple[int, str] | None:
    """Loads weights ``version`` from ``source`` into ``engine``; returns None, or the version
    that could not be loaded and why, naming it, while the engine kept the version it had (the
    source may have gone on to a newer version than ``version``, and that one failed). A
    publication that cannot be read whole (a missing tensor, a truncated one) never reaches the
    engine. A broken weight-sync group is no such failure: its error propagates and ends the
    run; nor is a store that cannot be reached or answers too late, or a version that is not
    there (:data:`TRANSIENT`, raised)."""
    try:
        source.load(engine, version)
    except TRANSIENT:
        raise  # not the publication's fault: the version may load at the next try
    except (StoreError, LookupError, WeightLoadError) as e:
        failed = e.version if isinstance(e, WeightLoadError) and e.version is not None else version
        return failed, (
            f"{engine.label}: weights v{failed} failed to load ({type(e).__name__}: {e}); "
            f"still generating with v{engine.version}"
        )
    return None
