"""Data-parallel trainer ranks as Ray actors, one per bundle of a placement group.

Each rank actor starts exactly as a rank process does (``rank_process.start``: process group,
engine, store, :class:`~asyncflow.workers.rank_step.RankStep`), meeting its peers
at rank 0's node address: gloo on CPU, NCCL on GPU. Ranks are not restarted: a collective group
cannot take a new member mid-run, so a rank that dies ends the run with an error naming it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncflow.config import Config
from asyncflow.engines.errors import EngineDiedError, EngineError, EngineTimeoutError
from asyncflow.engines.process_group import listening
from asyncflow.launch.rank_process import RankSpec, describe, start
from asyncflow.launch.ranks import Ranks
from asyncflow.launch.ray_wait import SAY_EVERY, Say
from asyncflow.store import Store


class RankActor:
    """One trainer rank (wrapped by ``ray.remote`` in :class:`RayRanks`)."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.listener: socket.socket | None = None

    def rendezvous_point(self) -> tuple[str, int]:
        """This node's address and a port on it that this actor listens on until its rank joins
        (asked of rank 0)."""
        address = ray.util.get_node_ip_address()
        self.listener, port = listening(address)
        return address, port

    def start(self, spec: RankSpec) -> int:
        self.handlers = start(replace(spec, listener=self.listener))
        return int(self.handlers["version"](None))

    def call(self, command: str, argument: Any) -> Any:
        try:
            return self.handlers[command](argument)
        except Exception as e:
            raise EngineError(describe(e)) from e


class RayRanks(Ranks):
    """``trainer.dp_size`` ranks placed on ``group``'s bundles, behind one train engine."""

    def __init__(
        self,
        model_dir: Path,
        config: Config,
        store: Store,
        store_address: str,
        token: str,
        group: PlacementGroup,
        say: Say | None = None,
    ) -> None:
        super().__init__(store, config)
        r = config.ray
        #: Where long waits say what they wait for (set before the ranks start).
        self.say = say
        world = config.trainer.dp_size
        remote = ray.remote(RankActor)
        self.actors = [
            remote.options(
                num_cpus=r.trainer_cpus,
                num_gpus=r.trainer_gpus,
                name=f"trainer-rank-{rank}",
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank),
            ).remote()
            for rank in range(world)
        ]
        point = self._get([self.actors[0].rendezvous_point.remote()], "starting", r.start_timeout)
        assert point is not None
        address, port = point[0]
        self._starting = [
            actor.start.remote(
                RankSpec(
                    rank, world, port, model_dir, config, store_address, token, Path(), address
                )
            )
            for rank, actor in enumerate(self.actors)
        ]
        self._start_timeout = r.start_timeout

    def _get(
        self,
        refs: list[Any],
        what: str,
        timeout: float,
        stop: threading.Event | None = None,
    ) -> list[Any] | None:
        """Every answer, in rank order; None if ``stop`` is set first. A rank that fails or dies
        is an error naming it at once (its peers may be waiting for it in a collective)."""
        deadline = time.monotonic() + timeout
        last_said = time.monotonic()
        answers: dict[int, Any] = {}
        while len(answers) < len(refs):
            pending = [ref for rank, ref in enumerate(refs) if rank not in answers]
            ready, _ = ray.wait(pending, num_returns=1, timeout=0.5)
            for ref in ready:
                answers[refs.index(ref)] = self._answer(refs.index(ref), ref, what)
            if stop is not None and stop.is_set():
                return None
            late = [rank for rank in range(len(refs)) if rank not in answers]
            due = what == "starting" and time.monotonic() - last_said >= SAY_EVERY
            if late and due and self.say is not None:
                last_said = time.monotonic()
                waited = timeout - (deadline - last_said)
                self.say(f"waiting {waited:.0f}s for trainer rank actor(s) {late} to finish {what}")
            if late and time.monotonic() > deadline:
                raise EngineTimeoutError(
                    f"trainer rank actor(s) {late} did not finish {what} within {timeout:.0f}s"
                )
        return [answers[rank] for rank in range(len(refs))]

    @staticmethod
    def _answer(rank: int, ref: Any, what: str) -> Any:
        try:
            return ray.get(ref)
        except RayActorError as e:
            raise EngineDiedError(
                f"trainer rank actor {rank} died while the job waited for it to finish {what}: {e}"
            ) from None
        except RayTaskError as e:
            raise EngineError(f"trainer rank {rank} failed while {what}: {e}") from None

    def _wait_started(self) -> list[Any] | None:
        return self._get(self._starting, "starting", self._start_timeout)

    def _call(
        self,
        command: str,
        argument: Any,
        what: str,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Any] | None:
        self.wait_started()
        refs = [actor.call.remote(command, argument) for actor in self.actors]
        return self._get(refs, what, timeout or self.timeout, stop)

    def close(self) -> None:
        """Closes the engines (briefly: a rank mid-step cannot answer), then ends the actors."""
        refs = [actor.call.remote("close", None) for actor in self.actors]
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=10.0)
        for actor in self.actors:
            ray.kill(actor)
