"""Data-parallel ranks (DeepSpeed or FSDP2; a lone rank, any train engine), each in a process of
its own, driven from the job's process.

The job holds :class:`Ranks` (here a :class:`RankGroup` of processes; under Ray, actors: see
:mod:`asyncflow.launch.ray_ranks`), a train engine whose every call is sent to all ranks (under
ZeRO-3 nearly everything is collective) and answered by them. The ranks reach the samples through
the store daemon, and rank 0 publishes weights through it too, or (``weights.transport: broadcast``
or ``ipc``) over a weight-sync group with the job's process as its one receiver. Every wait has a
deadline and watches the processes: a rank that exits or does not answer in time becomes an error
naming it, what the job was waiting for, and the end of its log.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config, resolve_engine_name
from asyncflow.engines.base import LossFn, StepResult, StepTrainEngine, TrainBatch
from asyncflow.engines.errors import EngineDiedError, EngineError, EngineTimeoutError
from asyncflow.engines.process_group import gpu_count, listening
from asyncflow.errors import ConfigError
from asyncflow.launch.rank_process import RankSpec, main
from asyncflow.store import Store
from asyncflow.weight_sync.broadcast import BroadcastReceiver
from asyncflow.weight_sync.group import Group, GroupSpec
from asyncflow.weight_sync.ipc import IpcReceiver
from asyncflow.weight_sync.source import ReceivedWeights, WeightSource
from asyncflow.weights import Watcher

#: Lines of a rank's log quoted in an error.
LOG_TAIL = 15


def log_tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"


class Ranks(StepTrainEngine):
    """Data-parallel ranks behind one train engine: every call goes to all ranks, which answer
    in rank order. Subclasses say how the ranks are reached (:meth:`_call`) and ended."""

    name = "deepspeed"

    def __init__(self, store: Store, config: Config) -> None:
        super().__init__()
        #: The engine each rank runs (``deepspeed`` or ``fsdp``; any, for a lone rank).
        self.name = resolve_engine_name("train", config.trainer.engine)
        self.store = store
        self.timeout = config.trainer.timeout
        #: A step may first wait for its samples as long as any worker may wait for its input.
        self.step_timeout = config.run.stall_timeout + config.trainer.timeout
        self._started = False
        #: Where rank 0's versions are read back from (the store, unless a subclass says).
        self._store_weights = Watcher(store, 0.0)

    @abstractmethod
    def _call(
        self,
        command: str,
        argument: Any,
        what: str,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Any] | None:
        """Runs ``command`` (a handler of :func:`asyncflow.launch.rank_process.handlers`) on
        every rank; their answers in rank order, or None if ``stop`` is set first."""

    @abstractmethod
    def _wait_started(self) -> list[Any] | None:
        """Waits until every rank has started; their versions, in rank order."""

    def wait_started(self) -> None:
        """Waits (once) until every rank has started, and sets ``version``."""
        if not self._started:
            versions = self._wait_started()
            assert versions is not None
            self.version = int(versions[0])
            self._started = True

    # -- the train engine ---------------------------------------------------------------------

    def train_step(self, step: int, stop: threading.Event) -> StepResult | None:
        parts = self._call("step", step, f"training step {step}", self.step_timeout, stop)
        if parts is None or any(p is None for p in parts):
            return None
        self.version = step + 1
        return StepResult.merge(parts)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        answers = self._call("logprobs", batch, "computing log-probs")
        assert answers is not None
        return answers[0]  # type: ignore[no-any-return]

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        raise NotImplementedError("the ranks train whole steps: use train_step")

    def optimizer_step(self) -> dict[str, float]:
        raise NotImplementedError("the ranks train whole steps: use train_step")

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current version's weights, as rank 0 published them (not to be written to)."""
        self.wait_started()
        return iter(self._weights().fetch(self.version)[1])

    def _weights(self) -> WeightSource:
        """Where the versions rank 0 publishes can be read in this process."""
        return self._store_weights

    def save(self, directory: Path) -> None:
        self._call("save", directory, f"saving a checkpoint to {directory}")

    def load(self, directory: Path) -> None:
        versions = self._call("load", directory, f"loading the checkpoint in {directory}")
        assert versions is not None
        self.version = int(versions[0])

    def save_pretrained(self, directory: Path) -> None:
        self._call("save_pretrained", directory, f"saving the model to {directory}")


class RankGroup(Ranks):
    """``trainer.dp_size`` ranks in their own processes, behind one train engine."""

    def __init__(
        self,
        model_dir: Path,
        config: Config,
        store: Store,
        store_address: str,
        log_dir: Path,
        store_token: str | None = None,
    ) -> None:
        """``store_token``: the token of the daemon at ``store_address`` (default: the configured
        ``store.token``), handed to each rank in its spec."""
        gpus = gpu_count()
        if 0 < gpus < config.trainer.dp_size:
            # Each rank would take a GPU of its own (NCCL refuses two ranks on one): the ranks
            # beyond the last GPU would fail to start with "invalid device ordinal".
            raise ConfigError(
                f"trainer.dp_size {config.trainer.dp_size} needs a GPU per rank on this machine "
                f"(the ranks' NCCL group puts one rank on each), and it has {gpus}; set "
                f"trainer.dp_size to at most {gpus}"
            )
        super().__init__(store, config)
        self.logs = [log_dir / f"trainer-rank-{r}.log" for r in range(config.trainer.dp_size)]
        #: This process's end of the weight-sync group (``weights.transport: broadcast`` or
        #: ``ipc``), once joined, and what kept joining from succeeding.
        self._receiver: BroadcastReceiver | None = None
        #: Where an ipc receiver stages each version: the GPU the rollout engines are on (the
        #: first, for engines on the CPU).
        rollout_device = config.rollout.device
        self._ipc_device: str | None = None
        if config.weights.transport == "ipc":
            self._ipc_device = rollout_device if rollout_device.startswith("cuda") else "cuda"
        self._join_error: BaseException | None = None
        self._joining: threading.Thread | None = None
        weight_sync: GroupSpec | None = None
        listener: socket.socket | None = None
        if config.weights.transport != "store":
            # This process serves the group's rendezvous on a port the system picks, listening
            # from now on: no other process can take it, and rank 0, joining once its engine
            # is built, connects at once.
            listener = socket.create_server(("127.0.0.1", 0))
            weight_sync = GroupSpec(
                port=listener.getsockname()[1],
                world_size=2,
                timeout=config.weights.timeout,
                # Rank 0 joins once its engine is built, which trainer.timeout bounds.
                join_timeout=config.trainer.timeout,
                # On GPUs too: the group's NCCL branch has never run (docs/weights.md).
                backend="gloo",
                server=1,
            )
        # Rank 0 serves the ranks' rendezvous on a port held from now on (see `listening`).
        rendezvous, port = listening()
        with rendezvous:  # rank 0 gets a copy of its own with its spec
            # Spawned, not forked: the job's process already runs threads and the store client.
            context = multiprocessing.get_context("spawn")
            self.procs: list[Any] = []
            self.conns: list[Connection] = []
            for rank, log in enumerate(self.logs):
                ours, theirs = context.Pipe()
                spec = RankSpec(
                    rank,
                    config.trainer.dp_size,
                    port,
                    model_dir,
                    config,
                    store_address,
                    store_token if store_token is not None else config.store.token,
                    log,
                    weight_sync=weight_sync,
                    listener=rendezvous if rank == 0 else None,
                    parent=os.getpid(),
                )
                proc = context.Process(
                    target=main, args=(spec, theirs), name=f"trainer-rank-{rank}", daemon=True
                )
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
        if weight_sync is not None and listener is not None:
            # Joined beside the ranks' start: rank 0 publishes version 0 to this process before
            # it reports ready.
            self._joining = threading.Thread(
                target=self._join,
                args=(weight_sync, listener),
                name="weight-sync join",
                daemon=True,
            )
            self._joining.start()

    # -- the weight-sync group ----------------------------------------------------------------

    def _join(self, spec: GroupSpec, listener: socket.socket) -> None:
        try:
            group = Group(spec, 1, "the job's rollout process", listener)
            if self._ipc_device is not None:
                self._receiver = IpcReceiver(self.store, group, device=self._ipc_device)
            else:
                self._receiver = BroadcastReceiver(self.store, group)
        except BaseException as e:
            self._join_error = e
            listener.close()  # unless the group took it over

    def weight_receiver(self) -> BroadcastReceiver | None:
        """This process's receiver of rank 0's versions (``weights.transport: broadcast`` or
        ``ipc``; else None), once every rank has started: version 0 is then in it."""
        if self._joining is None:
            return None
        self.wait_started()  # a rank that fails to start is named here
        self._joining.join(timeout=self.timeout)
        if self._receiver is None:
            raise EngineError(
                "the job's process could not join the weight-sync group with trainer rank 0: "
                f"{self._join_error!r}; see {self.logs[0]}"
            )
        return self._receiver

    def _weights(self) -> WeightSource:
        receiver = self.weight_receiver()
        return self._store_weights if receiver is None else ReceivedWeights(receiver)

    # -- talking to the ranks -----------------------------------------------------------------

    def _wait_started(self) -> list[Any] | None:
        return self._collect("starting", self.timeout, check=self._check_weight_sync)

    def _check_weight_sync(self) -> None:
        """Raises what stopped this process's end of the weight-sync group from joining or from
        receiving a version: rank 0 would otherwise wait for it (at the version's barrier, or to
        join) until its timeout, and then report only that."""
        error = self._join_error
        if error is None and self._receiver is not None:
            error = self._receiver.error
        if error is not None:
            raise EngineError(
                f"the job's end of the weight-sync group with trainer rank 0 failed: {error}; "
                f"rank 0's log: {self.logs[0]}"
            ) from error

    def _call(
        self,
        command: str,
        argument: Any,
        what: str,
        timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> list[Any] | None:
        self.wait_started()
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((command, argument))
            except OSError:
                raise self._died(rank, what) from None
        return self._collect(what, timeout or self.timeout, stop)

    def _died(self, rank: int, what: str) -> EngineDiedError:
        proc = self.procs[rank]
        proc.join(timeout=1.0)
        return EngineDiedError(
            f"{self.name} trainer rank {rank} exited (code {proc.exitcode}) while the job waited "
            f"for it to finish {what}; the end of {self.logs[rank]}:\n{log_tail(self.logs[rank])}"
        )

    def _collect(
        self,
        what: str,
        timeout: float,
        stop: threading.Event | None = None,
        check: Callable[[], None] | None = None,
    ) -> list[Any] | None:
        """Every rank's answer, in rank order; None if ``stop`` is set first. ``check`` is
        called as the wait goes on, to raise what else would keep the answers from coming."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(self.conns):
            waiting = [r for r in range(len(self.conns)) if r not in replies]
            for rank in waiting:
                conn = self.conns[rank]
                if conn.poll():
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        raise self._died(rank, what) from None
                    if kind == "error":
                        raise EngineError(
                            f"{self.name} trainer rank {rank} failed while {what}: {value}; "
                            f"its log: {self.logs[rank]}"
                        )
                    replies[rank] = value
                elif not self.procs[rank].is_alive():
                    raise self._died(rank, what)
            if stop is not None and stop.is_set():
                return None
            if check is not None:
                check()
            if len(replies) < len(self.conns):
                if time.monotonic() > deadline:
                    late = [r for r in range(len(self.conns)) if r not in replies]
                    raise EngineTimeoutError(
                        f"{self.name} trainer rank(s) {late} did not finish {what} within "
                        f"{timeout:.0f}s (trainer.timeout); see {self.logs[late[0]]}"
                    )
                sentinels = [self.procs[r].sentinel for r in waiting]
                wait([self.conns[r] for r in waiting] + sentinels, timeout=0.5)
        return [replies[r] for r in range(len(self.conns))]

    def close(self) -> None:
        """Asks every rank to stop, then ends those that do not within ten seconds (one mid-step
        cannot read the request until its step ends)."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver.group.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank that is gone needs no asking
                conn.send(("close", None))
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
