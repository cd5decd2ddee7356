"""``launcher: local``: the store, the engines and the workers in this process.

The store is embedded (or the configured daemon), with a daemon of the run's own when trainer ranks
in other processes need one; the engines are made here, the data-parallel trainer ranks as processes
of this machine (with ``weights.transport: broadcast`` or ``ipc``, this process joins their rank 0's
weight-sync group as the one receiver, for all of its rollout engines). Workers run as threads (they
share the embedded store, and torch releases the GIL in its kernels). The run ends when the trainer
finishes, when any worker fails (the error names it), or on Ctrl-C; every other worker then stops at
its next poll."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncflow import weights
from asyncflow.agents.rollout import AgentRollout
from asyncflow.config import Config, resolve_engine_name, trainer_in_job_process
from asyncflow.daemon import DaemonProcess, connect, new_token
from asyncflow.engines.base import RolloutEngine, TrainEngine
from asyncflow.engines.critic import HFCriticEngine
from asyncflow.engines.hf import HFRolloutEngine, HFTrainEngine
from asyncflow.engines.registry import (
    create_rollout_engine,
    create_train_engine,
)
from asyncflow.errors import StoreError
from asyncflow.launch.base import Resources, rollout_labels
from asyncflow.launch.ranks import RankGroup
from asyncflow.store import Store
from asyncflow.units import parse_size
from asyncflow.weight_sync import broadcast
from asyncflow.weight_sync.broadcast import BroadcastReceiver
from asyncflow.workers.advantage import AdvantageWorker
from asyncflow.workers.base import PROMPTS, SAMPLES, Context, Worker
from asyncflow.workers.critic import CriticWorker
from asyncflow.workers.partial import rollout_worker as partial_rollout_worker
from asyncflow.workers.reference import ReferenceWorker
from asyncflow.workers.reward import (
    RewardModelWorker,
    RewardWorker,
    resolve_reward,
    separate_reward_model,
)
from asyncflow.workers.routing import Dispatcher, Inbox

log = logging.getLogger(__name__)


def open_store(config: Config, daemon: DaemonProcess | None) -> Store:
    s = config.store
    if daemon is not None:
        return daemon.connect()
    if s.address == "embedded":
        return Store(shards=s.shards, memory_limit=s.memory_limit, lease_timeout=s.lease_timeout)
    return connect(s.address, token=s.token)


#: The partitions of a run's weight versions, or of their layouts.
WEIGHT_PARTITIONS = (weights.PARTITION, broadcast.PARTITION)
#: The partitions a run keeps rows in: its prompts, its weights, and the samples of each step
#: (by prefix).
RUN_PARTITIONS = (PROMPTS, *WEIGHT_PARTITIONS)


def free_earlier_run(store: Store) -> dict[str, int]:
    """Clears the partitions of the job that hold rows on a daemon this run did not start
    (``store.address``), and returns their rows by partition. A run killed on such a daemon
    leaves its prompts (leased to its dead workers, then handed to the next run's under group
    ids of its own), the samples of its unfinished steps and its last weight versions (taken by
    the next run's receivers as announced). One run at a time uses a daemon."""
    live: dict[str, int] = store.stats()["partitions"]
    left = {p: n for p, n in live.items() if p in RUN_PARTITIONS or p.startswith(SAMPLES)}
    for partition in left:
        store.clear(partition)
    return left


def free_weights(store: Store) -> None:
    """Frees the run's weight versions and layouts at its end: a daemon that outlives the run
    would keep them pinned (the trainer's final weights are in the run's directory)."""
    with contextlib.suppress(StoreError):  # the store gone with the run
        for partition in WEIGHT_PARTITIONS:
            store.clear(partition)


def start_daemon(config: Config) -> DaemonProcess | None:
    """A store daemon for this run, when trainer ranks in other processes need one and none is
    configured. It demands a token made for the run (``daemon.token``, handed to the ranks): on
    loopback without one, any local user could connect, read every row and clear partitions."""
    s = config.store
    if trainer_in_job_process(config) or s.address != "embedded":
        return None
    limit = parse_size(s.memory_limit)
    return DaemonProcess(
        "--shards",
        str(s.shards),
        "--lease-timeout",
        str(s.lease_timeout),
        *(["--memory-limit", str(limit)] if limit is not None else []),
        token=new_token(),
        exit_with_parent=True,  # killed with the job, not left behind
    )


def start(
    config: Config,
    model_dir: Path,
    run_dir: Path,
    cleanup: contextlib.ExitStack,
    say: Callable[[str], None],
) -> Resources:
    """The store, then the trainer (its process group must exist before vLLM would make its
    own), then the rollout engines; ``cleanup`` closes them in reverse."""
    c = config
    daemon = start_daemon(c)
    if daemon is not None:
        cleanup.enter_context(daemon)
        say(f"store daemon for the trainer ranks at {daemon.url}")
    store = open_store(c, daemon)
    if daemon is None and c.store.address != "embedded":
        left = free_earlier_run(store)
        if left:
            log.warning(
                "freed %d rows an earlier run left in the store at %s (%s)",
                sum(left.values()),
                c.store.address,
                ", ".join(sorted(left)),
            )
        cleanup.callback(free_weights, store)
    rollout_name = resolve_engine_name("rollout", c.rollout.engine)
    train_name = resolve_engine_name("train", c.trainer.engine)
    say(
        f"starting engines: rollout={rollout_name} x{c.rollout.engines}, "
        f"trainer={train_name} x{c.trainer.dp_size}"
    )
    if trainer_in_job_process(c):
        trainer: TrainEngine = create_train_engine(train_name, model_dir, c)
    else:
        address = daemon.url if daemon is not None else c.store.address
        token = daemon.token if daemon is not None else c.store.token
        trainer = RankGroup(model_dir, c, store, address, run_dir / "logs", token)
    cleanup.callback(trainer.close)
    rollouts: list[RolloutEngine] = []
    receiver: Callable[[], BroadcastReceiver | None] = (
        trainer.weight_receiver if isinstance(trainer, RankGroup) else lambda: None
    )

    def close_rollouts() -> None:
        for engine in rollouts:
            engine.close()

    # Last in, first out: the rollout engines close before the trainer (vLLM's shutdown tears
    # down the process group, which an in-process trainer has stopped using).
    cleanup.callback(close_rollouts)
    for label in rollout_labels(c):
        rollouts.append(create_rollout_engine(rollout_name, model_dir, c))
        rollouts[-1].label = label
    return Resources(
        store=store,
        trainer=trainer,
        scorer=rollouts[0],
        evaluator=HFRolloutEngine(model_dir, c),
        rollout_name=rollout_name,
        train_name=train_name,
        middle=lambda ctx: workers(ctx, rollouts, model_dir),
        rollouts=rollouts,
        weight_receiver=receiver,
    )


def workers(ctx: Context, rollouts: Sequence[RolloutEngine], model_dir: Path) -> list[Worker]:
    """The workers between the feeder and the trainer, as threads of this process."""
    config = ctx.config
    found: list[Worker] = []
    rollout_worker = AgentRollout if config.agent.enabled else partial_rollout_worker
    if len(rollouts) == 1:
        found.append(rollout_worker(ctx, rollouts[0], rollouts[0].label))
    else:
        dispatcher = Dispatcher(ctx, {engine.label: Inbox() for engine in rollouts})
        found.append(dispatcher)
        found += [rollout_worker(ctx, engine, engine.label, dispatcher) for engine in rollouts]
    separate = separate_reward_model(config)
    if separate:
        found.append(RewardModelWorker(ctx))
    reward_fn = resolve_reward(config.reward.fn, bool(config.data.extra_keys))
    found.append(RewardWorker(ctx, reward_fn, model_worker=separate))
    if config.algorithm.reference:
        found.append(ReferenceWorker(ctx, HFTrainEngine(model_dir, config)))
    if config.algorithm.advantage == "gae":
        found.append(CriticWorker(ctx, HFCriticEngine(model_dir, config)))
    found.append(AdvantageWorker(ctx))
    return found


class WorkerError(RuntimeError):
    """A worker raised; the message names it."""


#: Seconds between two calls of :func:`run_threads`'s ``tick``.
TICK = 0.2


def run_threads(
    workers: Sequence[Worker],
    stop: threading.Event,
    finisher: Worker,
    tick: Callable[[], None] | None = None,
    join_timeout: float = 120.0,
) -> None:
    """Runs every worker in its own thread until ``finisher`` returns, calling ``tick`` (if any)
    every ``TICK`` seconds meanwhile and once at the end. Without one, this thread sleeps until
    the stop: a wake-up every ``TICK`` costs a process of idle workers CPU for nothing."""
    errors: list[tuple[str, BaseException]] = []

    def body(worker: Worker) -> None:
        try:
            worker.run()
        except BaseException as e:
            errors.append((worker.role, e))
        finally:
            if worker is finisher or errors:
                stop.set()

    threads = [threading.Thread(target=body, args=(w,), name=w.role, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        if tick is None:
            stop.wait()  # Ctrl-C still interrupts it
        else:
            while not stop.wait(TICK):
                tick()
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        stop.set()
        for w in workers:  # waiters for a version see the stop now, not after their poller's wait
            w.ctx.weights.wake()
        for t in threads:
            t.join(timeout=join_timeout)
        if tick is not None:
            tick()
    stuck = [t.name for t in threads if t.is_alive()]
    if errors:
        role, error = errors[0]
        raise WorkerError(f"the {role} worker failed: {type(error).__name__}: {error}") from error
    if stuck:
        raise WorkerError(f"workers did not stop within {join_timeout:.0f}s: {', '.join(stuck)}")
