"""Pipeline workers (rollout, reward, reference, advantage) as restartable Ray actors, and the
supervisor that runs them from the job's process.

An actor builds its own context connected to the store daemon, its worker and its engine, and
loops the worker in :meth:`WorkerActor.run` until :meth:`WorkerActor.stop` (a threaded actor, so
stop arrives while run executes). When one dies, Ray restarts it (``ray.max_restarts``) and the
supervisor calls ``run`` again; the rows it held come back when their leases expire, and since a
row is committed only by its ack, none is lost or processed twice.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray._private import state as ray_state
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from asyncflow.agents.rollout import AgentRollout
from asyncflow.config import Config, resolve_engine_name
from asyncflow.daemon import connect
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.engines.errors import EngineError
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.engines.registry import create_rollout_engine
from asyncflow.launch.local import WorkerError
from asyncflow.launch.ray_wait import Say, wait
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.quiet import quiet_libraries
from asyncflow.telemetry.trace import Span, Tracer
from asyncflow.workers.advantage import AdvantageWorker
from asyncflow.workers.base import Context, RunState, Worker
from asyncflow.workers.partial import rollout_worker
from asyncflow.workers.reference import ReferenceWorker
from asyncflow.workers.reward import RewardWorker, resolve_reward

#: Seconds an evaluation waits for a rollout actor's worker to stop before it uses the engine.
FREE_ENGINE_WAIT = 30.0


@dataclass
class Report:
    """What a worker actor has done since it (last) started."""

    #: Which life of the actor this is (a restart begins a new one).
    life: str
    generated_tokens: int
    generated_samples: int
    truncated_responses: int
    spans: list[Span]
    wall_origin: float
    #: Generated samples by version span (see :class:`RunState`), and weight loads that failed.
    version_spans: dict[int, int] = field(default_factory=dict)
    weight_failures: list[str] = field(default_factory=list)
    #: An agent rollout worker's counters (turns, tool calls, failures by kind).
    agent_counts: dict[str, int] = field(default_factory=dict)


class WorkerActor:
    """One pipeline worker in its own process (wrapped by ``ray.remote`` in :func:`start`)."""

    def __init__(
        self, config: Config, role: str, label: str, url: str, token: str, model_dir: Path
    ) -> None:
        quiet_libraries()
        store = connect(url, token=token)
        self.ctx = Context(store, config, load_tokenizer(model_dir), Tracer(), RunState())
        self.engine: RolloutEngine | None = None
        self.worker = self._worker(role, label, model_dir)
        self.life = uuid.uuid4().hex
        #: Set while no :meth:`run` executes: only then does an evaluation use the engine.
        self.idle = threading.Event()
        self.idle.set()

    def _worker(self, role: str, label: str, model_dir: Path) -> Worker:
        c, ctx = self.ctx.config, self.ctx
        if role == "rollout":
            self.engine = create_rollout_engine(
                resolve_engine_name("rollout", c.rollout.engine), model_dir, c
            )
            self.engine.label = label
            if c.agent.enabled:
                return AgentRollout(ctx, self.engine, label)
            return rollout_worker(ctx, self.engine, label)
        if role == "reward":
            return RewardWorker(ctx, resolve_reward(c.reward.fn, bool(c.data.extra_keys)))
        if role == "reference":
            return ReferenceWorker(ctx, HFTrainEngine(model_dir, c))
        if role == "advantage":
            return AdvantageWorker(ctx)
        raise ValueError(f"no worker has the role {role!r}")

    def ready(self) -> bool:
        return True

    def run(self) -> Report:
        """Runs the worker until :meth:`stop`; raises what the worker raises."""
        self.idle.clear()
        try:
            self.worker.run()
        finally:
            self.idle.set()
        return self.report()

    def stop(self) -> None:
        self.ctx.stop.set()
        self.ctx.weights.wake()

    def report(self) -> Report:
        s, tracer = self.ctx.state, self.ctx.tracer
        with s.lock:
            tokens, samples, cut = s.generated_tokens, s.generated_samples, s.truncated_responses
            spans, failures = dict(s.version_spans), list(s.weight_failures)
        agent = dict(getattr(self.worker, "agent_counts", {}))
        return Report(
            self.life,
            tokens,
            samples,
            cut,
            tracer.spans(),
            tracer.wall_origin,
            spans,
            failures,
            agent,
        )

    # -- evaluation through a rollout actor's engine (before the run starts, after it ends) ---

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        return self._free_engine("generate").generate(prompts, sampling)

    def load_weights(self, version: int) -> None:
        engine = self._free_engine("load weights")
        self.ctx.weights.load(engine, version)

    def _free_engine(self, doing: str) -> RolloutEngine:
        """The engine, once the worker that uses it has stopped (:data:`FREE_ENGINE_WAIT`): one
        that outlived the supervisor's stop would still be decoding with it."""
        assert self.engine is not None, f"only rollout actors {doing}"
        if not self.idle.wait(FREE_ENGINE_WAIT):
            raise EngineError(
                f"{self.engine.label}: its rollout worker still runs {FREE_ENGINE_WAIT:.0f}s "
                f"after it was told to stop; its engine cannot {doing} for an evaluation"
            )
        return self.engine


class RemoteRollout(RolloutEngine):
    """A rollout actor's engine, seen from the job's process (for evaluation)."""

    def __init__(self, actor: Any, name: str, timeout: float) -> None:
        super().__init__()
        self.actor = actor
        self.name = name
        self.timeout = timeout

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        answer: list[list[Completion]] = _call(
            self.actor.generate, (prompts, sampling), f"{self.label} to generate", self.timeout
        )
        return answer

    def load_weights(self, version: int, weights: Iterable[Any] = ()) -> None:
        """Loads ``version``, which the actor reads from the store itself (``weights`` unused)."""
        _call(self.actor.load_weights, (version,), f"{self.label} to load weights", self.timeout)
        self.version = version


def _get(ref: Any, what: str, timeout: float) -> Any:
    try:
        return ray.get(ref, timeout=timeout)
    except GetTimeoutError:
        raise TimeoutError(f"waited {timeout:.0f}s for {what}") from None


def _call(method: Any, args: tuple[Any, ...], what: str, timeout: float) -> Any:
    """Calls an actor's method and waits for the result. A call that finds the actor restarting
    (killed during the run, Ray bringing it back) is made again until ``timeout``: the methods
    called this way may run twice."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _get(method.remote(*args), what, max(0.0, deadline - time.monotonic()))
        except ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"waited {timeout:.0f}s for {what}: its actor is restarting"
                ) from None
            time.sleep(0.5)


def start(
    config: Config,
    roles: list[tuple[str, str]],
    url: str,
    token: str,
    model_dir: Path,
    placement: dict[str, Any],
    say: Say | None = None,
) -> dict[str, Any]:
    """Starts an actor per ``(role, label)`` with ``placement[label]``'s options, and waits until
    every one has built its worker and engine (saying which it still waits for); the actors by
    label."""
    remote = ray.remote(WorkerActor)
    actors = {
        label: remote.options(
            name=label,  # in the job's own namespace
            max_concurrency=2,
            max_restarts=config.ray.max_restarts,
            **placement[label],
        ).remote(config, role, label, url, token, model_dir)
        for role, label in roles
    }
    timeout = config.ray.start_timeout
    for label, actor in actors.items():
        try:
            wait([actor.ready.remote()], f"the {label} actor to start", timeout, say)
        except RayActorError as e:
            raise WorkerError(f"the {label} actor failed to start: {e}") from None
    return actors


def ray_entry(actor: Any) -> dict[str, Any] | None:
    """``actor``'s row of the cluster's actor table (where Ray's own
    ``was_current_actor_reconstructed`` looks): ``NumRestarts`` goes up as a restart begins,
    ``State`` is ``DEAD`` once Ray restarts it no more. None where the table has no row for it."""
    return ray_state.actors(actor_id=actor._actor_id.hex()) or None


def ray_restarts(actor: Any) -> int | None:
    """How many times Ray has restarted ``actor``; None where the table has no row for it."""
    entry = ray_entry(actor)
    return int(entry["NumRestarts"]) if entry else None


class Supervisor(Worker):
    """Runs the worker actors from the job's process: restarts their ``run`` after Ray restarted
    them, fails the run when one raises or has died more than ``ray.max_restarts`` times, adds
    their counters to the run's, and merges their timelines at the end."""

    role = "ray-actors"

    def __init__(self, ctx: Context, actors: dict[str, Any]) -> None:
        super().__init__(ctx)
        self.actors = actors
        self.runs = {label: actor.run.remote() for label, actor in actors.items()}
        self.polls = {label: actor.report.remote() for label, actor in actors.items()}
        #: Each actor's current life, and its counters already added to the run's.
        self.lives: dict[str, str] = {}
        self.counted = dict.fromkeys(actors, (0, 0, 0))
        self.counted_spans: dict[str, Counter[int]] = {label: Counter() for label in actors}
        self.counted_failures = dict.fromkeys(actors, 0)
        self.counted_agent: dict[str, Counter[str]] = {label: Counter() for label in actors}
        #: The agent rollout actors' counters, over their lives (see ``agent_totals``).
        self.agent_counts: Counter[str] = Counter()
        #: Restarts: those seen (a new life reported) during the run, Ray's count at its end;
        #: and deaths seen, counted where Ray's actor table cannot say whether one was the last.
        self.restarts = dict.fromkeys(actors, 0)
        self.deaths = dict.fromkeys(actors, 0)
        #: When each actor being restarted died.
        self.restarting: dict[str, float] = {}

    def step(self) -> bool:
        if not self.runs:  # every worker has returned
            self.ctx.stop.wait(0.5)
            return True
        ready, _ = ray.wait(list(self.runs.values()), num_returns=1, timeout=0.5)
        for label in [k for k, ref in self.runs.items() if ref in ready]:
            self._ended(label, self.runs.pop(label))
        done, _ = ray.wait(list(self.polls.values()), num_returns=len(self.polls), timeout=0)
        for label in [k for k, ref in self.polls.items() if ref in done]:
            with contextlib.suppress(RayActorError, RayTaskError):  # its run reports a death
                self._count(label, ray.get(self.polls[label]), spans=False)
                self.restarting.pop(label, None)  # it answers: it is back
            self.polls[label] = self.actors[label].report.remote()
        return True

    def _ended(self, label: str, ref: Any) -> None:
        try:
            report = ray.get(ref)
        except ActorUnavailableError:  # being restarted
            self._ask_again(label)
            return
        except RayActorError as e:
            # Every call to an actor dead for good fails so: Ray's table says whether this is
            # one more death or the same one again, and how many restarts there were.
            self.deaths[label] += 1
            entry, limit = ray_entry(self.actors[label]), self.config.ray.max_restarts
            # Without Ray's row, counted here: each call made since may have counted again.
            final = entry["State"] == "DEAD" if entry else self.deaths[label] > limit
            if final:
                lives = int(entry["NumRestarts"]) + 1 if entry else self.deaths[label]
                raise WorkerError(
                    f"the {label} actor died {lives} times (ray.max_restarts {limit}), and "
                    f"Ray restarts it no more: {e}"
                ) from None
            self._ask_again(label)
            return
        except RayTaskError as e:
            raise WorkerError(f"the {label} worker failed: {e}") from None
        self._count(label, report, spans=True)

    def _ask_again(self, label: str) -> None:
        """Runs the worker again once Ray has restarted its actor; a call made meanwhile is
        refused (the actor is unavailable), so it is made again shortly, until
        ``ray.start_timeout``."""
        since = self.restarting.setdefault(label, time.monotonic())
        waited = time.monotonic() - since
        if waited > self.config.ray.start_timeout:
            raise WorkerError(
                f"the {label} actor was not back {waited:.0f}s after it died (ray.start_timeout)"
            )
        self.ctx.stop.wait(0.2)
        self.runs[label] = self.actors[label].run.remote()

    def _count(self, label: str, report: Report, spans: bool) -> None:
        if self.lives.setdefault(label, report.life) != report.life:
            self.lives[label] = report.life
            self.restarts[label] += 1
            self.counted[label] = (0, 0, 0)  # a new life counts from zero
            self.counted_spans[label] = Counter()
            self.counted_failures[label] = 0
            self.counted_agent[label] = Counter()
        self._count_versions(label, report)
        tokens, samples, cut = self.counted[label]
        self.ctx.state.add(
            generated_tokens=max(0, report.generated_tokens - tokens),
            generated_samples=max(0, report.generated_samples - samples),
            truncated_responses=max(0, report.truncated_responses - cut),
        )
        self.counted[label] = (
            report.generated_tokens,
            report.generated_samples,
            report.truncated_responses,
        )
        if spans:
            self.ctx.tracer.add(report.spans, report.wall_origin)

    def _count_versions(self, label: str, report: Report) -> None:
        """Adds what the actor's version-span counters, weight failures and agent counters
        gained since its last report (in this life) to the run's."""
        spans = Counter({int(k): v for k, v in report.version_spans.items()})
        gained = spans - self.counted_spans[label]
        failures = report.weight_failures[self.counted_failures[label] :]
        with self.ctx.state.lock:
            self.ctx.state.version_spans.update(gained)
            self.ctx.state.weight_failures.extend(failures)
        self.counted_spans[label] = spans
        self.counted_failures[label] = len(report.weight_failures)
        agent = Counter(report.agent_counts)
        for key, count in agent.items():  # (keys at zero kept, as a local run's summary has)
            self.agent_counts[key] += max(0, count - self.counted_agent[label][key])
        self.counted_agent[label] = agent

    def run(self) -> None:
        try:
            super().run()
        finally:
            self._stop_all()
        self._take_ray_restarts()

    def _take_ray_restarts(self) -> None:
        """Counts every restart Ray began, also one whose new life has not answered by the end:
        the rest of the pipeline may finish the run while an actor is still being restarted, or
        before a call of the supervisor's reaches the new life."""
        for label, actor in self.actors.items():
            counted = ray_restarts(actor)
            if counted is not None:
                self.restarts[label] = max(self.restarts[label], counted)

    def _stop_all(self, timeout: float = 60.0) -> None:
        """Asks every actor to stop and takes in the reports of those that do in time."""
        for actor in self.actors.values():
            actor.stop.remote()
        deadline = time.monotonic() + timeout
        for label, ref in self.runs.items():
            # Stopping anyway: one that does not answer in time only misses from the timeline.
            with contextlib.suppress(GetTimeoutError, RayActorError, RayTaskError):
                left = max(0.1, deadline - time.monotonic())
                self._count(label, ray.get(ref, timeout=left), spans=True)
        self.runs.clear()
