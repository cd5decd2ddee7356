"""``launcher: ray``: the run's place on a Ray cluster, from joining it to tearing it down.

Start-up order: join the cluster (``ray.address``, else ``$RAY_ADDRESS``, else a Ray instance
started on this machine, on loopback); reserve a placement group per role (trainer ranks packed
together, rollout engines spread over the nodes, the small workers packed); place the store (a
storage daemon per node, the controller here) with a token made for the run; then, when asked,
the trainer ranks and the worker actors. Leaving the context stops them all in reverse order
(also on Ctrl-C or an error) and leaves the cluster. The feeder and the trainer's bookkeeping stay
in the job's process.
"""

from __future__ import annotations

import copy
import os
import secrets
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncflow.config import Config, resolve_engine_name
from asyncflow.daemon import connect
from asyncflow.engines.hf import HFRolloutEngine
from asyncflow.launch import ray_workers
from asyncflow.launch.base import Resources, rollout_labels
from asyncflow.launch.ray_join import join
from asyncflow.launch.ray_ranks import RayRanks
from asyncflow.launch.ray_store import place_store
from asyncflow.launch.ray_wait import (
    Bundle,
    Say,
    check_fits,
    cpus_to_start,
    node_resources,
    total,
    wait,
)
from asyncflow.store import Store
from asyncflow.workers.base import Context, Worker

#: Environment of every actor: one compute thread each (see ``asyncflow.cli``), no downloads.
ACTOR_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    # Ray refuses empty bundles; a worker asking for nothing still gets a sliver of a CPU.
    return {"CPU": cpus or 0.01, **({"GPU": gpus} if gpus else {})}


class RayCluster:
    """The run's actors on a Ray cluster (a context manager)."""

    def __init__(self, config: Config, say: Say | None = None) -> None:
        self.config = config
        #: Where long waits say what they wait for (the job's progress lines).
        self.say = say
        #: Every store daemon demands it; actors get it as an argument.
        self.token = secrets.token_hex(16)
        self._cleanup = ExitStack()
        self.groups: dict[str, PlacementGroup] = {}
        self.url = ""
        self.nodes = 0

    def __enter__(self) -> RayCluster:
        with ExitStack() as undo:
            undo.push(self)  # a failed start stops what it started
            self._join()
            self._reserve()
            store = place_store(self.config, self.token, self.say)
            self._cleanup.callback(store.stop)
            self.url = store.url
            self.nodes = store.nodes
            undo.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._cleanup.close()

    def _join(self) -> None:
        if ray.is_initialized():
            return  # the caller's own connection: it stays theirs
        address = self.config.ray.address or os.environ.get("RAY_ADDRESS") or None
        # A Ray instance of the run's own gets the logical CPUs its placement reserves.
        sized = {} if address else {"num_cpus": cpus_to_start(total(self._demand()))}
        join(
            address,
            **sized,
            runtime_env={"env_vars": ACTOR_ENV},
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        self._cleanup.callback(ray.shutdown)

    def _groups(self) -> dict[str, tuple[list[Bundle], str]]:
        """The bundles and strategy of each role's placement group."""
        c, r = self.config, self.config.ray
        return {
            "trainer": ([_bundle(r.trainer_cpus, r.trainer_gpus)] * c.trainer.dp_size, "PACK"),
            "rollout": ([_bundle(r.rollout_cpus, r.rollout_gpus)] * c.rollout.engines, "SPREAD"),
            "workers": (
                [_bundle(r.worker_cpus, 0)] * 2
                + ([_bundle(r.trainer_cpus, r.trainer_gpus)] if c.algorithm.reference else []),
                "PACK",
            ),
        }

    def _demand(self) -> list[Bundle]:
        return [b for bundles, _ in self._groups().values() for b in bundles]

    def _reserve(self) -> None:
        wanted = self._groups()
        # Never fits: an error now, naming demand and capacity, rather than a wait until timeout
        # (unless the cluster grows on demand: the nodes alive now are not all it will have).
        if not self.config.ray.autoscaling:
            check_fits({role: bundles for role, (bundles, _) in wanted.items()}, node_resources())
        for role, (bundles, strategy) in wanted.items():
            self.groups[role] = placement_group(bundles, strategy=strategy)
            self._cleanup.callback(remove_placement_group, self.groups[role])
        for role, group in self.groups.items():
            bundles = wanted[role][0]
            try:
                wait(
                    [group.ready()],
                    f"room for the {role} placement group {bundles}",
                    self.config.ray.start_timeout,
                    self.say,
                    lambda: f"free now: {ray.available_resources()}",
                )
            except TimeoutError as e:
                raise TimeoutError(f"the cluster found no room: {e}") from None

    def ranks(self, model_dir: Path, store: Store) -> RayRanks:
        """The trainer's ranks, one actor per bundle of the trainer's placement group."""
        ranks = RayRanks(
            model_dir, self.config, store, self.url, self.token, self.groups["trainer"], self.say
        )
        self._cleanup.callback(ranks.close)
        return ranks

    def workers(self, model_dir: Path) -> dict[str, Any]:
        """The rollout, reward, [reference] and advantage actors, by label, started."""
        c, r = self.config, self.config.ray
        roles = [("rollout", label) for label in rollout_labels(c)]
        roles += [("reward", "reward"), ("advantage", "advantage")]
        if c.algorithm.reference:
            roles.append(("reference", "reference"))

        def bundle(group: str, index: int, cpus: float, gpus: float) -> dict[str, Any]:
            strategy = PlacementGroupSchedulingStrategy(self.groups[group], index)
            return {"num_cpus": cpus, "num_gpus": gpus, "scheduling_strategy": strategy}

        placement = {
            label: bundle("rollout", i, r.rollout_cpus, r.rollout_gpus)
            for i, label in enumerate(rollout_labels(c))
        }
        placement["reward"] = bundle("workers", 0, r.worker_cpus, 0)
        placement["advantage"] = bundle("workers", 1, r.worker_cpus, 0)
        placement["reference"] = bundle("workers", 2, r.trainer_cpus, r.trainer_gpus)
        actors: dict[str, Any] = {}
        self._cleanup.callback(lambda: [ray.kill(a) for a in actors.values()])
        actors |= ray_workers.start(c, roles, self.url, self.token, model_dir, placement, self.say)
        return actors


def absolute_paths(config: Config) -> Config:
    """A copy of ``config`` whose model directories, relative to this process's working
    directory, are absolute."""
    config = copy.deepcopy(config)
    for section in (config.model, config.critic, config.reward.model):
        if section.path is not None:
            section.path = str(Path(section.path).absolute())
    return config


def start(
    config: Config,
    model_dir: Path,
    run_dir: Path,
    cleanup: ExitStack,
    say: Callable[[str], None],
) -> Resources:
    """The cluster joined and reserved, the store placed, the trainer ranks and the worker actors
    started; the job generates for evaluation through the first rollout actor. ``cleanup``
    stops them all and leaves the cluster. Actors run in the cluster's working directory, not
    the job's: every path they are given is made absolute here."""
    config, model_dir = absolute_paths(config), model_dir.absolute()
    rollout_name = resolve_engine_name("rollout", config.rollout.engine)  # unknown: refused now
    train_name = resolve_engine_name("train", config.trainer.engine)
    cluster = cleanup.enter_context(RayCluster(config, say))
    say(f"on Ray: store controller at {cluster.url}")
    store = connect(cluster.url, token=cluster.token)
    trainer = cluster.ranks(model_dir, store)
    actors = cluster.workers(model_dir)
    first = rollout_labels(config)[0]
    scorer = ray_workers.RemoteRollout(actors[first], rollout_name, config.ray.start_timeout)
    scorer.label = first
    placement: dict[str, Any] = {
        "nodes": cluster.nodes,
        "storage_daemons": store.stats()["storage_daemons"],
    }

    def supervise(ctx: Context) -> list[Worker]:
        supervisor = ray_workers.Supervisor(ctx, actors)
        placement["actor_restarts"] = supervisor.restarts  # counted as the run goes
        return [supervisor]

    return Resources(
        store=store,
        trainer=trainer,
        scorer=scorer,
        evaluator=HFRolloutEngine(model_dir, config),
        rollout_name=rollout_name,
        train_name=train_name,
        middle=supervise,
        placement=placement,
    )
