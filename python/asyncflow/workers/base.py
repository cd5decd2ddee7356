"""What every worker shares: the run context, the claim loop with stall detection, and the run's
shared progress counters.

Workers never call each other. They communicate only through the store: a worker claims rows
whose input fields are ready, computes, writes its output fields to the same rows, and acks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from asyncflow.agents.tools import prompt_tools
from asyncflow.batch import Batch
from asyncflow.config import Config
from asyncflow.errors import StoreError, StoreTimeoutError
from asyncflow.models.tokenizer import Tokenizer
from asyncflow.store import Store
from asyncflow.tasks.prompts import PromptEncoder
from asyncflow.telemetry.trace import Tracer
from asyncflow.weight_sync.source import ReceivedWeights, WeightSource
from asyncflow.weights import Watcher
from asyncflow.workers.colocation import EngineSleep

if TYPE_CHECKING:
    from asyncflow.weight_sync.broadcast import BroadcastReceiver

#: Partition of prompts waiting for rollout; samples of training step s go to ``step-<s>``.
PROMPTS = "prompts"
SAMPLES = "step-"

#: Seconds (at least) an idle worker waits at once for work, or for room or new weights, all of
#: which wake it as soon as they come: the timeout only bounds how late it sees the run stop.
#: Each wake-up to find nothing changed costs a store request, this process and the GIL.
IDLE_WAIT = 1.0


def step_partition(step: int) -> str:
    return f"{SAMPLES}{step}"


class StallError(RuntimeError):
    """A worker waited longer than ``run.stall_timeout`` for its input."""


@dataclass
class RunState:
    """Counters the workers share; guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Optimiser steps completed (= the newest policy version).
    trained_steps: int = 0
    generated_tokens: int = 0
    generated_samples: int = 0
    #: Responses cut at ``rollout.max_tokens`` before they ended.
    truncated_responses: int = 0
    dropped_samples: int = 0
    #: Rows no reward source could score (their groups are left out), and groups left out by
    #: ``algorithm.filter_groups`` for rewards all equal.
    reward_failures: int = 0
    filtered_groups: int = 0
    #: Prompt groups asked for each step in place of groups left out (``filter_groups``).
    extra_groups: Counter[int] = field(default_factory=Counter)
    #: Prompt groups taken off a rollout engine that fell silent, to be generated elsewhere.
    rerouted_groups: int = 0
    #: Prompt groups the feeder has put (its cursor), read by checkpoints under the lock below.
    issued_groups: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    #: Samples by version span (newest token's policy version less the oldest's; above 0 only
    #: when weights change during generation), and weight versions that failed to load.
    version_spans: Counter[int] = field(default_factory=Counter)
    weight_failures: list[str] = field(default_factory=list)
    #: Held while prompt rows are added (feeder) or turned into samples (rollout), and while a
    #: checkpoint snapshots the store: the snapshot then sees each prompt group exactly once.
    snapshot_lock: threading.Lock = field(default_factory=threading.Lock)
    #: Notified, under ``lock``, when ``trained_steps`` or ``extra_groups`` grow: what the
    #: feeder waits for.
    progressed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.progressed = threading.Condition(self.lock)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for key, value in deltas.items():
                setattr(self, key, getattr(self, key) + value)

    def note_version_spans(self, spans: Sequence[int]) -> None:
        with self.lock:
            self.version_spans.update(spans)

    def note_weight_failure(self, why: str) -> None:
        logging.getLogger("asyncflow.rollout").warning("%s", why)
        with self.lock:
            self.weight_failures.append(why)

    #: The counts a checkpoint keeps, so that a resumed run's summary counts the whole run.
    COUNTS = (
        "generated_tokens",
        "generated_samples",
        "truncated_responses",
        "dropped_samples",
        "reward_failures",
        "filtered_groups",
        "rerouted_groups",
    )

    def counts(self) -> dict[str, Any]:
        """The whole run's counts so far, as JSON holds them (see :meth:`add_counts`)."""
        with self.lock:
            return {
                **{name: getattr(self, name) for name in self.COUNTS},
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "version_spans": {str(k): v for k, v in self.version_spans.items()},
                "weight_failures": list(self.weight_failures),
            }

    def add_counts(self, saved: Mapping[str, Any]) -> None:
        """Adds the counts a checkpoint kept (:meth:`counts`) to this run's."""
        with self.lock:
            for name in self.COUNTS:
                setattr(self, name, getattr(self, name) + int(saved.get(name, 0)))
            self.staleness.update({int(k): v for k, v in saved.get("staleness", {}).items()})
            spans = saved.get("version_spans", {})
            self.version_spans.update({int(k): v for k, v in spans.items()})
            self.weight_failures[:0] = saved.get("weight_failures", [])

    def version_span_histogram(self) -> dict[str, int]:
        """Generated samples by version span, keyed by the span as a string (JSON's keys)."""
        with self.lock:
            return {str(k): v for k, v in sorted(self.version_spans.items())}

    def multi_version_share(self) -> float:
        """The share of generated samples whose tokens come from more than one policy version."""
        with self.lock:
            total = sum(self.version_spans.values())
            spanning = total - self.version_spans.get(0, 0)
        return spanning / total if total else 0.0


@dataclass
class Context:
    store: Store
    config: Config
    tokenizer: Tokenizer
    tracer: Tracer
    state: RunState
    stop: threading.Event = field(default_factory=threading.Event)
    #: Prompts -> token ids (chat template, system prompt, length limit); by default from
    #: ``config.data`` with no limit but ``data.max_prompt_length``.
    prompt_encoder: InitVar[PromptEncoder | None] = None
    #: ``rollout.sleep_while_training``: the rollout engines sleep through each training step.
    engine_sleep: EngineSleep | None = None
    #: This process's end of the weight-sync group (``weights.transport: broadcast``); None: the
    #: store carries the weights.
    weight_receiver: InitVar[BroadcastReceiver | None] = None
    prompts: PromptEncoder = field(init=False)
    #: The policy versions this process can load, shared by its workers.
    weights: WeightSource = field(init=False)

    def __post_init__(
        self, prompt_encoder: PromptEncoder | None, weight_receiver: BroadcastReceiver | None
    ) -> None:
        data = self.config.data
        self.prompts = prompt_encoder or PromptEncoder.for_data(
            self.tokenizer, data, data.max_prompt_length, prompt_tools(self.config)
        )
        # A tenth of the claim wait: new weights are seen promptly, for one store read. A wait
        # for weights waits in the store, as long as an idle worker's claim: a publication ends
        # it at once, and the run's stop wakes the waiters (``run_threads``, a Ray actor's
        # ``stop``), so a shorter one would only wake the poller to find nothing new.
        poll = self.config.run.poll_interval
        interval = poll / 10
        self.weights = (
            Watcher(self.store, interval, self.stop, wake_wait=max(poll, IDLE_WAIT))
            if weight_receiver is None
            else ReceivedWeights(weight_receiver, interval, self.stop)
        )


#: Seconds between a lease keeper's looks while no work is under way.
KEEPER_IDLE = 5.0


class LeaseKeeper:
    """Renews the leases of claimed rows while work on them is under way (see :meth:`kept`),
    from one thread of the process's own: a block of work costs a registration, not a thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: Each block under way: when its leases are next due, how often, and its claims.
        self._blocks: dict[int, tuple[float, float, list[Batch]]] = {}
        self._keys = itertools.count()
        #: When the thread looks next; a block due sooner wakes it.
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        """Blocks of work under way."""
        with self._cond:
            return len(self._blocks)

    @contextlib.contextmanager
    def kept(self, batches: list[Batch], lease_timeout: float) -> Iterator[None]:
        """Renews the leases of ``batches`` every third of ``lease_timeout`` while the block
        runs: work that outlasts a lease would otherwise have its rows handed out again and its
        ack refused. A renewal the store refuses (the lease ended already) is left to that ack."""
        period = lease_timeout / 3
        due = time.monotonic() + period
        with self._cond:
            key = next(self._keys)
            self._blocks[key] = (due, period, batches)
            if self._thread is None or not self._thread.is_alive():  # (also after a fork)
                self._thread = threading.Thread(target=self._run, name="leases", daemon=True)
                self._thread.start()
            elif due < self._wake_at:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                del self._blocks[key]

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [k for k, (at, _, _) in self._blocks.items() if at <= now]
                if not due:
                    # With no block under way, a look every KEEPER_IDLE seconds: a block then
                    # registered (due a lease's third later) need not wake the thread.
                    idle = now + KEEPER_IDLE
                    self._wake_at = min((at for at, _, _ in self._blocks.values()), default=idle)
                    self._cond.wait(self._wake_at - now)
                    continue
                renewing = []
                for k in due:
                    _, period, batches = self._blocks[k]
                    self._blocks[k] = (now + period, period, batches)
                    renewing += batches
            for batch in renewing:
                with contextlib.suppress(StoreError):
                    batch.renew()


#: The process's lease keeper.
LEASES = LeaseKeeper()


class Worker(ABC):
    """A loop of :meth:`step` until the run stops or the worker is done."""

    role: str = "worker"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        self._idle_since: float | None = None
        self._idle_wait = max(self.config.run.poll_interval, IDLE_WAIT)
        #: The tasks whose last claim by this worker came back with part of a batch or none.
        self._short: set[str] = set()

    def run(self) -> None:
        while not self.ctx.stop.is_set():
            if not self.step():
                return

    @abstractmethod
    def step(self) -> bool:
        """Does one unit of work; returns False once the worker has nothing left to do."""

    def busy(self, name: str) -> Any:
        return self.ctx.tracer.span(self.role, "busy", name)

    def waiting(self, name: str) -> Any:
        return self.ctx.tracer.span(self.role, "wait", name)

    def holding(self, *batches: Batch) -> contextlib.AbstractContextManager[None]:
        """Keeps the leases of ``batches`` while the block runs (see :class:`LeaseKeeper`): for
        work on claimed rows that may take longer than ``store.lease_timeout``."""
        return LEASES.kept(list(batches), self.config.store.lease_timeout)

    def claim(
        self,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float | None = None,
        **options: Any,
    ) -> Batch:
        """Claims up to ``batch_size`` ready rows, waiting at most ``timeout`` (default
        ``run.claim_wait``) for a full batch and then taking what is ready; with nothing
        ready it waits on, in the same request, until the first rows come or the idle wait
        (:data:`IDLE_WAIT`, at least the poll interval) has passed. Raises
        :class:`StallError` when nothing has come for ``run.stall_timeout`` seconds.

        After a claim of ``task`` that came back full, it first asks for a full batch that is
        ready now (:meth:`_full_batch_now`); after one that came back short, rows come slower
        than this worker takes them, and that question would almost always be answered no: it
        goes straight to the waiting claim, whose first look finds a full batch all the same."""
        names = list(fields)
        partial_after = self.config.run.claim_wait if timeout is None else timeout
        with self.waiting(f"claim {'+'.join(fields)}"):
            batch = None
            if task not in self._short:
                batch = self._full_batch_now(task, names, batch_size, options)
            if batch is None:
                batch = self.store.claim(
                    task,
                    names,
                    batch_size,
                    timeout=max(partial_after, min(self._idle_wait, self.stall_left())),
                    allow_partial=True,
                    partial_after=partial_after,
                    **options,
                )
        if len(batch) < batch_size:
            self._short.add(task)
        else:
            self._short.discard(task)
        self.note_progress(len(batch) > 0, f"rows with {list(fields)} for task {task!r}")
        return batch

    def _full_batch_now(
        self, task: str, fields: list[str], batch_size: int, options: dict[str, Any]
    ) -> Batch | None:
        """The claim's full batch if it is ready now, else None (nothing claimed). The same
        claim as the waiting one that follows, whose first look would return this batch too;
        but a claim that may wait (or settle for part of a batch) is served by one of the
        daemon's waiting threads, and one that may not is answered at once, for a small
        fraction of the daemon's and this process's CPU."""
        try:
            return self.store.claim(
                task, fields, batch_size, timeout=0.0, allow_partial=False, **options
            )
        except StoreTimeoutError:
            return None

    def stall_left(self) -> float:
        """Seconds of waiting left before :meth:`note_progress` calls this worker stalled."""
        if self._idle_since is None:
            return self.config.run.stall_timeout
        return self.config.run.stall_timeout - (time.monotonic() - self._idle_since)

    def note_progress(self, progressed: bool, waiting_for: str) -> None:
        if progressed:
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since > self.config.run.stall_timeout:
            raise StallError(
                f"{self.role} has waited {now - self._idle_since:.0f}s for {waiting_for}; "
                "is an upstream worker stuck or dead?"
            )
