"""What every launcher gives the job: :class:`Resources`, started by the launcher's
``start(config, model_dir, run_dir, cleanup, say)``. The job wires them into the pipeline and
never decides where anything runs; the launcher never decides what the pipeline is."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncflow.config import Config
from asyncflow.engines.base import RolloutEngine, TrainEngine
from asyncflow.store import Store
from asyncflow.workers.base import Context, Worker

if TYPE_CHECKING:
    from asyncflow.weight_sync.broadcast import BroadcastReceiver

#: Where each launcher's ``start`` lives (imported when the run names it: Ray's is optional).
LAUNCHERS = {"local": "asyncflow.launch.local", "ray": "asyncflow.launch.ray_cluster"}


def rollout_labels(config: Config) -> list[str]:
    """The rollout engines' names in traces, routing and errors."""
    n = config.rollout.engines
    return ["rollout"] if n == 1 else [f"rollout-{i}" for i in range(n)]


@dataclass
class Resources:
    """What a launcher started for one run."""

    store: Store
    trainer: TrainEngine
    #: The rollout engine the job itself generates with for held-out accuracy before and after
    #: training (an engine of this process, or a handle on a remote one).
    scorer: RolloutEngine
    #: An engine of this process that loads each evaluated version (``run.eval_every``).
    evaluator: RolloutEngine
    rollout_name: str
    train_name: str
    #: The workers between the feeder and the trainer, given the run's context: threads of this
    #: process over local engines, or a supervisor of remote actors.
    middle: Callable[[Context], list[Worker]]
    #: Where the run's parts ran, for the summary (the Ray launcher's nodes, daemons, restarts).
    placement: dict[str, Any] = field(default_factory=dict)
    #: The rollout engines of this process (``rollout.sleep_while_training`` puts them to sleep
    #: for each training step); none where they run elsewhere.
    rollouts: Sequence[RolloutEngine] = ()
    #: Waits until this process has joined the weight-sync group and returns its receiver
    #: (``weights.transport: broadcast`` or ``ipc``), or None where the store carries them.
    weight_receiver: Callable[[], BroadcastReceiver | None] = lambda: None


class Start(Protocol):
    def __call__(
        self,
        config: Config,
        model_dir: Path,
        run_dir: Path,
        cleanup: contextlib.ExitStack,
        say: Callable[[str], None],
    ) -> Resources: ...


def launcher(name: str) -> Start:
    """The ``start`` of the launcher ``name`` (``launcher`` in the config)."""
    start: Start = importlib.import_module(LAUNCHERS[name]).start
    return start
