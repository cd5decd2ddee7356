"""``weights.transport: broadcast`` (and ``ipc``, on a GPU) in the main job: two FSDP2 trainer ranks
(or one hf rank) in processes of their own, rank 0 publishing each version over the weight-sync
group (gloo over loopback) to the job's process, whose rollout engine, evaluator and final-weights
read take them from its receiver. The store carries the versions' layouts and never a tensor; a rank
0 that dies mid-broadcast ends the job with an error naming it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.config import Config
from asyncflow.daemon import DaemonProcess
from asyncflow.engines.base import RolloutEngine
from asyncflow.engines.errors import EngineDiedError, EngineError
from asyncflow.launch import local
from asyncflow.launch.local import WorkerError
from asyncflow.launch.ranks import RankGroup
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.progress import Reporter
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import train
from asyncflow.weight_sync import WeightSyncError, ipc
from asyncflow.weight_sync import broadcast as bc
from asyncflow.weight_sync.broadcast import BroadcastReceiver
from asyncflow.weight_sync.layout import Layout, as_bytes
from asyncflow.weight_sync.source import ReceivedWeights
from asyncflow.workers.base import PROMPTS, Context, RunState
from asyncflow.workers.rollout import Rollout

STEPS = 3
#: A job small enough for two CPU cores: no warm start, a tiny model, four groups of four a step.
JOB = [
    "warm_start.enabled=false",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "trainer.engine=fsdp",
    "trainer.dp_size=2",
    "trainer.groups_per_step=4",
    "rollout.n=4",
    "rollout.engine=hf",
    "data.eval_size=8",
    "run.progress=false",
    "weights.transport=broadcast",
    # Several segments a version: tensors straddle their ends.
    "weights.bucket_size=16KiB",
    # On-policy: the rollout worker must load each new version before generating again.
    "trainer.max_staleness=0",
]


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """The run's store, started here so that the test can read it after the run."""
    with DaemonProcess() as d:
        yield d


def job(daemon: DaemonProcess, *overrides: str) -> Config:
    return cfg.load(None, [*JOB, f"store.address={daemon.url}", *overrides])


@pytest.fixture
def rollouts(monkeypatch: pytest.MonkeyPatch) -> list[RolloutEngine]:
    """The rollout engines the job makes, recorded."""
    made: list[RolloutEngine] = []
    create = local.create_rollout_engine

    def recording(*args: Any) -> RolloutEngine:
        made.append(create(*args))
        return made[-1]

    monkeypatch.setattr(local, "create_rollout_engine", recording)
    return made


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [
        [],
        # One rank of the hf engine: the transport still runs it in a process of its own.
        ["trainer.engine=hf", "trainer.dp_size=1"],
    ],
    ids=["fsdp-x2", "hf-x1"],
)
def test_a_broadcast_job_ends_with_the_trainers_final_weights_in_its_engine_and_no_tensor_in_the_store(  # noqa: E501
    tmp_path: Path,
    daemon: DaemonProcess,
    rollouts: list[RolloutEngine],
    monkeypatch: pytest.MonkeyPatch,
    listeners_off_loopback: Callable[[], list[str]],
    trainer: list[str],
) -> None:
    check_job_ends_bit_exact(
        tmp_path, daemon, rollouts, monkeypatch, listeners_off_loopback, trainer, {bc.LAYOUT}
    )


@pytest.mark.slow
@needs_cuda
def test_an_ipc_job_ends_with_the_trainers_final_weights_in_its_engine_and_no_tensor_in_the_store(
    tmp_path: Path,
    daemon: DaemonProcess,
    rollouts: list[RolloutEngine],
    monkeypatch: pytest.MonkeyPatch,
    listeners_off_loopback: Callable[[], list[str]],
) -> None:
    """One FSDP2 rank on the GPU, the rollout engine on the same GPU."""
    overrides = ["weights.transport=ipc", "trainer.dp_size=1", "rollout.device=cuda"]
    check_job_ends_bit_exact(
        tmp_path,
        daemon,
        rollouts,
        monkeypatch,
        listeners_off_loopback,
        overrides,
        {bc.LAYOUT, ipc.HANDLE, ipc.OWNER},
    )


def check_job_ends_bit_exact(
    tmp_path: Path,
    daemon: DaemonProcess,
    rollouts: list[RolloutEngine],
    monkeypatch: pytest.MonkeyPatch,
    listeners_off_loopback: Callable[[], list[str]],
    overrides: list[str],
    announced: set[str],
) -> None:
    """A job of ``STEPS`` steps whose every version goes over the weight-sync group: each is
    loaded in order, the engine ends bit for bit the trainer's final model, and the store holds
    at most the last two announcements (fields ``announced``), never a tensor, and nothing once
    the run ends."""
    # Looked at while the group is up (the job, its ranks and its daemon), at each load.
    off_loopback: list[str] = []
    loads: list[int] = []
    kept: list[list[int]] = []  # the versions whose layouts the store holds, at each load
    load = ReceivedWeights.load
    store = daemon.connect()

    def looking_load(self: ReceivedWeights, engine: RolloutEngine, version: int) -> int:
        off_loopback.extend(listeners_off_loopback())
        loads.append(load(self, engine, version))
        kept.append(sorted(int(v) for v in store.rows(partition=bc.PARTITION).versions))
        return loads[-1]

    monkeypatch.setattr(ReceivedWeights, "load", looking_load)
    config = job(daemon, f"trainer.max_steps={STEPS}", *overrides)
    summary = train(config, tmp_path, reporter=Reporter(False))
    # The rollout worker loaded each version it generated with from the receiver, in order (it
    # starts on v0, the model's own weights); the last one it may load or not before the run
    # stops, and the final evaluation loads it anyway.
    assert loads in (list(range(1, STEPS)), list(range(1, STEPS + 1))), loads
    assert off_loopback == []

    # Every sample of step s came from version s: each new version reached the rollout engine
    # through the receiver while the run went on.
    assert summary["staleness_histogram"] == {"0": STEPS * 4 * 4}
    assert summary["weight_load_failures"] == []
    (engine,) = rollouts
    assert engine.version == STEPS
    # Bit for bit the model the ranks saved from their own parameters.
    engine_matches_saved_model(engine, tmp_path)
    # The wait for the trainer's process to start is a phase of its own, not a part of RL.
    assert "trainer_start" in summary["phase_seconds"], summary["phase_seconds"]
    # Rank 0 timed each publication, until the job's receiver had the version.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["publish_seconds"] > 0 for r in records), records

    # The version loaded and the one before it, no older (v0's layout is gone by v2's load).
    assert kept[-1] == [loads[-1] - 1, loads[-1]] and all(len(k) <= 2 for k in kept), kept
    stats = store.stats()
    fields = set(stats["fields"])
    assert not {f for f in fields if f.startswith(weights.PREFIX)}, "a tensor went through it"
    assert announced <= fields
    # The daemon outlives the run, which freed its layouts as it ended.
    assert stats["partitions"] == {}


def engine_matches_saved_model(engine: RolloutEngine, run_dir: Path) -> None:
    """The engine's parameters are bit for bit those the trainer ranks saved as final."""
    final = load_file(run_dir / "final" / "model.safetensors")
    mine = dict(engine.model.named_parameters())  # type: ignore[attr-defined]
    assert set(final) <= set(mine)
    for name, tensor in final.items():
        theirs = as_bytes(tensor).numpy().tobytes()
        assert as_bytes(mine[name].detach().cpu()).numpy().tobytes() == theirs, name


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer", [[], ["trainer.engine=hf", "trainer.dp_size=1"]], ids=["fsdp-x2", "hf-x1"]
)
def test_a_broadcast_job_resumed_from_its_checkpoint_broadcasts_the_restored_version_first(
    tmp_path: Path,
    rollouts: list[RolloutEngine],
    monkeypatch: pytest.MonkeyPatch,
    trainer: list[str],
) -> None:
    """A job killed with its daemon: the resumed job's fresh store has no layout and its engine
    the model's starting weights, so rank 0 must send the checkpoint's version before the step
    after it is generated (on-policy here: generated only from it)."""
    overrides = ["trainer.max_steps=2", "run.checkpoint_every=1", *trainer]
    with DaemonProcess() as first:
        train(job(first, *overrides), tmp_path, reporter=Reporter(False))
    assert (tmp_path / "checkpoints" / "step-000001").is_dir()
    rollouts.clear()

    loads: list[int] = []
    load = ReceivedWeights.load

    def recording_load(self: ReceivedWeights, engine: RolloutEngine, version: int) -> int:
        loads.append(load(self, engine, version))
        return loads[-1]

    monkeypatch.setattr(ReceivedWeights, "load", recording_load)
    with DaemonProcess() as second:
        summary = train(job(second, *overrides), resume=tmp_path, reporter=Reporter(False))
    assert summary["steps"] == 2
    assert loads[:1] == [1], loads  # the restored version, before step 2's samples
    (engine,) = rollouts
    assert engine.version == 2
    engine_matches_saved_model(engine, tmp_path)


@pytest.mark.slow
def test_a_trainer_rank_0_killed_mid_broadcast_fails_the_job_naming_it(
    tmp_path: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups: list[RankGroup] = []

    class Recorded(RankGroup):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            groups.append(self)

    monkeypatch.setattr(local, "RankGroup", Recorded)
    receive = BroadcastReceiver._fill

    def killing_rank_0(self: BroadcastReceiver, layout: Layout, buffer: torch.Tensor) -> None:
        if layout.version == 1:  # its header is in, its segments not
            os.kill(groups[0].procs[0].pid, signal.SIGKILL)
        receive(self, layout, buffer)

    monkeypatch.setattr(BroadcastReceiver, "_fill", killing_rank_0)
    with pytest.raises(WorkerError, match="trainer rank 0") as failed:
        train(job(daemon, "trainer.max_steps=2"), tmp_path, reporter=Reporter(False))
    # The trainer sees its rank die, or the rollout worker sees the broadcast break: either way
    # the run ends with the cause, not waiting.
    assert isinstance(failed.value.__cause__, (WeightSyncError, EngineDiedError)), failed.value


def fail_receiving(monkeypatch: pytest.MonkeyPatch, version: int, error: Exception) -> None:
    """The job's receiver raises ``error`` once ``version``'s header is in, before its bytes."""
    receive = BroadcastReceiver._fill

    def failing(self: BroadcastReceiver, layout: Layout, buffer: torch.Tensor) -> None:
        if layout.version == version:
            raise error
        receive(self, layout, buffer)

    monkeypatch.setattr(BroadcastReceiver, "_fill", failing)


@pytest.mark.slow
def test_a_broadcast_that_breaks_mid_version_fails_the_job_with_the_receivers_error(
    tmp_path: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's end of the group fails as gloo fails when its peer goes (rank 0 lives on,
    stuck sending, so only the receiver can tell): the rollout worker waiting for the version
    ends the run with the receiver's error."""
    fail_receiving(monkeypatch, 1, RuntimeError("Connection closed by peer [127.0.0.1]:1"))
    with pytest.raises(WorkerError, match="rollout worker failed: WeightSyncError") as failed:
        train(job(daemon, "trainer.max_steps=2"), tmp_path, reporter=Reporter(False))
    message = str(failed.value)
    assert "weights v1: the broadcast from trainer rank 0 failed" in message
    assert "engines keep v0" in message


@pytest.mark.slow
def test_a_first_version_the_job_cannot_receive_ends_the_job_with_its_error_not_a_timeout(
    tmp_path: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 0 comes over the group while the ranks start: rank 0 waits at its barrier for a
    receiver that gave up, so the job must end with the receiver's error, not rank 0's timeout
    (nor after it)."""
    fail_receiving(monkeypatch, 0, ValueError("weights v0: a layout this receiver cannot place"))
    timeout = 900.0  # far beyond the job's own length (tens of seconds)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"weight-sync group .* failed: .*cannot place"):
        train(
            job(daemon, "trainer.max_steps=2", f"weights.timeout={timeout}"),
            tmp_path,
            reporter=Reporter(False),
        )
    assert time.monotonic() - started < timeout / 3


@pytest.mark.slow
def test_a_receiver_that_fails_for_its_own_reason_ends_the_job_before_the_broadcast_timeout(
    tmp_path: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a broken connection: the receiver gives up on a version by itself (here, a layout it
    cannot use), while rank 0 is left waiting to send. The job must end with that error, its
    rank processes stopped, rather than when the group's timeout fails rank 0."""
    fail_receiving(monkeypatch, 1, ValueError("weights v1: a layout this receiver cannot place"))
    timeout = 900.0  # far beyond the job's own length (tens of seconds)
    started = time.monotonic()
    with pytest.raises(WorkerError, match="a layout this receiver cannot place"):
        train(
            job(daemon, "trainer.max_steps=2", f"weights.timeout={timeout}"),
            tmp_path,
            reporter=Reporter(False),
        )
    assert time.monotonic() - started < timeout / 3


# -- the job's weight source over a receiver (no group) ------------------------------------------


class FakeReceiver:
    """What :class:`ReceivedWeights` asks of a receiver: the newest version and its bytes, or the
    error that broke the group."""

    def __init__(self, version: int | None, error: WeightSyncError | None = None) -> None:
        self.version, self.error = version, error
        self.loaded: list[int] = []

    def latest(self) -> int | None:
        if self.error is not None:
            raise self.error
        return self.version

    def wait_for(self, version: int, timeout: float) -> bool:
        newest = self.latest()
        return newest is not None and newest >= version

    def load(self, engine: Any, version: int | None = None) -> int:
        assert self.version is not None
        self.loaded.append(self.version)
        return self.version


def test_the_received_source_loads_the_newest_version_and_refuses_one_not_yet_here() -> None:
    receiver = FakeReceiver(5)
    source = ReceivedWeights(receiver)  # type: ignore[arg-type]
    assert source.load(object(), 3) == 5, "an older version gives way to the newest held"
    with pytest.raises(LookupError, match="v6 has not been received"):
        source.load(object(), 6)
    assert receiver.loaded == [5]


def test_waiting_on_the_received_source_ends_when_the_run_stops() -> None:
    stop = threading.Event()
    stop.set()
    source = ReceivedWeights(FakeReceiver(None), interval=0.01, stop=stop)  # type: ignore[arg-type]
    assert source.wait_for(1, timeout=3600.0) is False  # returns at once, not in an hour


def test_a_broken_weight_sync_group_fails_the_rollout_worker_instead_of_being_skipped() -> None:
    broken = WeightSyncError("weights v2: the broadcast from trainer rank 0 failed at bucket 3/9")
    config = cfg.load(None, ["trainer.max_staleness=0"])
    store = af.Store()
    store.register_task("rollout", partitions=[PROMPTS])
    ctx = Context(
        store,
        config,
        chatml_tokenizer(),
        Tracer(),
        RunState(),
        weight_receiver=FakeReceiver(None, broken),  # type: ignore[arg-type]
    )
    assert isinstance(ctx.weights, ReceivedWeights)

    worker = Rollout(ctx, Idle())
    with pytest.raises(WeightSyncError, match="trainer rank 0"):
        worker.step()
    assert ctx.state.weight_failures == [], "not reported as one version failing to load"
    with pytest.raises(WeightSyncError, match="trainer rank 0"):  # waiting for one, the same
        worker._wait_for_weights(1)


class Idle(RolloutEngine):
    """An engine that is never asked for anything here."""

    def generate(self, prompts: Any, sampling: Any) -> Any:
        raise AssertionError("nothing is generated without weights")

    def load_weights(self, version: int, weights: Any) -> None:
        raise AssertionError("no weights to load")


@pytest.mark.slow
def test_a_store_job_whose_one_trainer_rank_has_a_process_of_its_own_ends_with_its_weights(
    tmp_path: Path, rollouts: list[RolloutEngine]
) -> None:
    """``trainer.own_process``: the one rank of ``dp_size`` 1 runs in a process beside the daemon
    started for the run, and its versions reach the job's rollout engine through the store."""
    overrides = [
        "trainer.engine=hf",
        "trainer.dp_size=1",
        "trainer.own_process=true",
        "weights.transport=store",
        f"trainer.max_steps={STEPS}",
    ]
    config = cfg.load(None, [*JOB, *overrides])
    assert config.store.address == "embedded"  # so the run starts a daemon for its rank
    summary = train(config, tmp_path, reporter=Reporter(False))
    # Only a rank in a process of its own has a start the job waits for.
    assert "trainer_start" in summary["phase_seconds"], summary["phase_seconds"]
    # On-policy: each version reached the engine before it generated again.
    assert summary["staleness_histogram"] == {"0": STEPS * 4 * 4}
    (engine,) = rollouts
    assert engine.version == STEPS
    engine_matches_saved_model(engine, tmp_path)
    # The trainer's timeline: each step a wait for its samples (the rank's), then busy from
    # where that wait ended, not busy throughout.
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    (tid,) = [e["tid"] for e in events if e["ph"] == "M" and e["args"]["name"] == "trainer"]
    spans = {e["name"]: e for e in events if e["ph"] == "X" and e["tid"] == tid}
    for s in range(STEPS):
        wait, busy = spans[f"step {s} samples"], spans[f"ranks train step {s}"]
        assert (wait["cat"], busy["cat"]) == ("wait", "busy")
        assert busy["ts"] == pytest.approx(wait["ts"] + wait["dur"], abs=1.0)
