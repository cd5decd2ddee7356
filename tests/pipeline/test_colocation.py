"""Colocated mode (``rollout.sleep_while_training``): the rollout engines sleep through every
training step and are awake, with the step's new version loaded, for every generation; the
settings it cannot work with are refused, each saying why."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.engines import registry
from asyncflow.engines.base import (
    Completion,
    LossFn,
    RolloutEngine,
    Sampling,
    StepResult,
    StepTrainEngine,
    TrainBatch,
    TrainEngine,
)
from asyncflow.engines.hf import HFRolloutEngine
from asyncflow.errors import ConfigError
from asyncflow.launch.local import run_threads
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.progress import Reporter
from asyncflow.tasks.base import Problem
from asyncflow.tasks.dataset import DatasetTask
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks, train
from asyncflow.workers.advantage import AdvantageWorker
from asyncflow.workers.base import Context, RunState, step_partition
from asyncflow.workers.colocation import EngineSleep
from asyncflow.workers.feeder import Feeder
from asyncflow.workers.reward import RewardWorker, resolve_reward
from asyncflow.workers.rollout import Rollout
from asyncflow.workers.trainer import Ledger, Trainer

#: The colocated synchronous mode.
SLEEP = [
    "rollout.engine=vllm",
    "rollout.sleep_while_training=true",
    "trainer.max_staleness=0",
    "trainer.streaming=false",
]
STEPS = 3


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reports a CUDA device (the config's check; no GPU is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


class Events:
    """One ordered record of what the rollout engine and the train engine were asked."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, int]] = []

    def note(self, name: str, version: int) -> None:
        with self.lock:
            self.seen.append((name, version))


class SleepyEngine(RolloutEngine):
    """A rollout engine that answers ``2`` to everything and notes each call."""

    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self.events.note("generate", self.version)
        return [[Completion([17, 1], [-0.5, -0.5], "2")] * sampling.n for _ in prompts]

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        list(weights)
        self.version = version
        self.events.note("load", version)

    def sleep(self) -> None:
        self.events.note("sleep", self.version)

    def wake_up(self) -> None:
        # Waking takes a while, as vLLM's does: a worker that did not wait for it would load the
        # version just published into the sleeping engine meanwhile.
        time.sleep(0.05)
        self.events.note("wake_up", self.version)


class NotingTrainEngine(TrainEngine):
    """A train engine that computes nothing and notes each pass and step."""

    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.zeros(batch.input_ids.shape)

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self.events.note("forward_backward", self.version)
        return {}

    def optimizer_step(self) -> dict[str, float]:
        self.events.note("optimizer_step", self.version)
        return {}

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", torch.full((4,), float(self.version))

    def save(self, directory: Path) -> None:
        pass

    def load(self, directory: Path) -> None:
        pass

    def save_pretrained(self, directory: Path) -> None:
        pass


def run_colocated(tmp_path: Path) -> list[tuple[str, int]]:
    """A synchronous run of ``STEPS`` steps with one sleeping engine: what the engines were
    asked, in order."""
    config = cfg.load(
        None,
        [
            *SLEEP,
            "rollout.n=2",
            "trainer.groups_per_step=2",
            f"trainer.max_steps={STEPS}",
            "run.poll_interval=0.02",
        ],
    )
    store = af.Store()
    register_tasks(store, reference=False)
    events = Events()
    engine = SleepyEngine(events)
    ctx = Context(
        store,
        config,
        chatml_tokenizer(),
        Tracer(),
        RunState(),
        engine_sleep=EngineSleep([engine]),
    )
    train_engine = NotingTrainEngine(events)
    weights.publish(store, 0, train_engine.export_weights())
    task = DatasetTask([Problem("1+1=", "2"), Problem("2+2=", "4")], [], {})
    metrics = MetricsLog(tmp_path)
    trainer = Trainer(ctx, train_engine, metrics, Ledger(tmp_path / "ledger.jsonl"))
    workers = [
        Feeder(ctx, task),
        Rollout(ctx, engine),
        RewardWorker(ctx, resolve_reward(config.reward.fn)),
        AdvantageWorker(ctx),
        trainer,
    ]
    try:
        run_threads(workers, ctx.stop, trainer, join_timeout=30)
    finally:
        metrics.close()
        metrics.finish()
    return events.seen


def test_the_engine_sleeps_through_every_step_and_generates_awake_with_the_new_version(
    tmp_path: Path, cuda: None
) -> None:
    seen = run_colocated(tmp_path)
    names = [name for name, _ in seen]
    assert names.count("sleep") == names.count("wake_up") == STEPS
    asleep, wakes, trained = False, 0, 0
    for name, version in seen:
        if name == "sleep":
            assert not asleep
            asleep = True
        elif name == "wake_up":
            assert asleep
            asleep, wakes = False, wakes + 1
        elif name in ("forward_backward", "optimizer_step"):
            assert asleep, f"the trainer ran {name} of step {version} beside an awake engine"
            trained += name == "optimizer_step"
        else:  # generate, load
            assert not asleep, f"the engine was asked to {name} while asleep"
            # Every step's version was published while the engine slept, and is loaded after it
            # woke: before the step's generation, which is on-policy.
            assert version == wakes, f"{name} with v{version} after {wakes} steps"
    assert trained == STEPS
    # The version each step published was loaded once, after the wake-up that ended that step
    # (the last one too, if the engine got to it before the run stopped).
    loads = [version for name, version in seen if name == "load"]
    assert loads in (list(range(1, STEPS)), list(range(1, STEPS + 1)))


class NotingRanks(NotingTrainEngine, StepTrainEngine):
    """Data-parallel ranks that claim and train each step themselves: only the call is noted."""

    def train_step(self, step: int, stop: threading.Event) -> StepResult | None:
        self.events.note("train_step", step)
        return StepResult()

    def wait_started(self) -> None:
        """Started when made."""


def put_step_samples(store: af.Store, groups: list[int]) -> None:
    """Samples of step 0 (two per group), every field the trainer reads ready."""
    ids = [np.array([3, 4], np.int64)] * 2
    for group in groups:
        store.put(
            {
                "prompt_ids": ids,
                "response_ids": ids,
                "behaviour_logprobs": [np.zeros(2, np.float32)] * 2,
                "token_versions": [np.zeros(2, np.int64)] * 2,
                "advantage": np.zeros(2, np.float32),
                "reward": np.zeros(2, np.float32),
            },
            partition=step_partition(0),
            groups=[group, group],
        )


def test_ranks_step_only_once_the_step_is_generated_with_the_engines_asleep(
    tmp_path: Path, cuda: None
) -> None:
    config = cfg.load(
        None, [*SLEEP, "rollout.n=2", "trainer.groups_per_step=2", "run.poll_interval=0.02"]
    )
    store = af.Store()
    register_tasks(store, reference=False)
    events = Events()
    sleep = EngineSleep([SleepyEngine(events)])
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState(), engine_sleep=sleep)
    metrics = MetricsLog(tmp_path)
    trainer = Trainer(ctx, NotingRanks(events), metrics, Ledger(tmp_path / "ledger.jsonl"))
    try:
        put_step_samples(store, [0])
        assert trainer.step()  # half the step: the engines generate on
        assert events.seen == []
        put_step_samples(store, [1])
        assert trainer.step()
    finally:
        metrics.close()
        metrics.finish()
    assert [name for name, _ in events.seen] == ["sleep", "train_step", "wake_up"]
    # The trainer's look at the whole step handed it back for the ranks to claim.
    assert len(store.claim("train", ["advantage"], 4, timeout=1, partition="step-0")) == 4


class Clock(Tracer):
    """A tracer on the test's clock: its time moves only when a test moves it."""

    clock = 10.0

    def now(self) -> float:
        return self.clock


class WaitingRanks(NotingRanks):
    """Ranks that waited 1.5 s of a 4 s step for its samples, on the tracer's clock."""

    def __init__(self, events: Events, tracer: Clock) -> None:
        super().__init__(events)
        self.tracer = tracer

    def train_step(self, step: int, stop: threading.Event) -> StepResult | None:
        self.tracer.clock += 4.0
        return StepResult(wait_seconds=1.5)


def test_ranks_waiting_for_a_steps_samples_leave_the_trainer_waiting_not_busy(
    tmp_path: Path,
) -> None:
    config = cfg.load(None, ["rollout.n=2", "trainer.groups_per_step=2"])
    tracer = Clock()
    ctx = Context(af.Store(), config, chatml_tokenizer(), tracer, RunState())
    metrics = MetricsLog(tmp_path)
    trainer = Trainer(ctx, WaitingRanks(Events(), tracer), metrics, Ledger(tmp_path / "ledger"))
    try:
        assert trainer.step()
    finally:
        metrics.close()
        metrics.finish()
    spans = [(s.kind, s.name, s.start, s.end) for s in tracer.spans() if s.role == "trainer"]
    assert spans == [
        ("wait", "step 0 samples", 10.0, 11.5),
        ("busy", "ranks train step 0", 11.5, 14.0),
    ]
    (record,) = metrics.history
    assert record["busy"]["trainer"] == 0.625  # 2.5 s of the step's 4


class SleepingHF(HFRolloutEngine):
    """The hf engine standing in for the vllm one: notes its sleeps and wake-ups, and fails the
    run if it is asked to generate or load weights while asleep."""

    events: ClassVar[list[str]] = []

    def __init__(self, model_dir: Path, config: cfg.Config) -> None:
        super().__init__(model_dir, config)
        self.asleep = False

    def sleep(self) -> None:
        self.asleep = True
        self.events.append("sleep")

    def wake_up(self) -> None:
        self.asleep = False
        self.events.append("wake_up")

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        assert not self.asleep, "asked to generate while asleep"
        self.events.append("generate")
        return super().generate(prompts, sampling)

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        assert not self.asleep, f"asked to load v{version} while asleep"
        self.events.append(f"load v{version}")
        super().load_weights(version, weights)


def test_the_main_job_puts_its_rollout_engines_to_sleep_for_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as during_load:
        during_load.setattr(torch.cuda, "is_available", lambda: True)
        config = cfg.load(
            None,
            [
                *SLEEP,
                "trainer.engine=hf",
                "rollout.engines=2",
                "rollout.n=2",
                "trainer.groups_per_step=2",
                f"trainer.max_steps={STEPS}",
                "warm_start.enabled=false",
                "data.eval_size=4",
                "model.hidden_size=32",
                "model.heads=2",
                "model.kv_heads=1",
                "model.intermediate_size=64",
                "run.poll_interval=0.02",
            ],
        )
    monkeypatch.setitem(registry._ROLLOUT, "vllm", SleepingHF)
    monkeypatch.setattr(SleepingHF, "events", [])
    summary = train(config, run_dir=tmp_path / "run", reporter=Reporter(enabled=False))
    assert summary["engines"]["rollout"] == "vllm"
    events = SleepingHF.events
    # Each of the two engines slept through every step and woke after it.
    assert events.count("sleep") == events.count("wake_up") == 2 * STEPS
    assert events.count(f"load v{STEPS}") >= 1  # the final accuracy is measured on it
    assert summary["rollout_sleep_while_training"]["steps"] == STEPS


def test_a_version_published_while_the_engine_sleeps_is_loaded_after_it_wakes(
    cuda: None,
) -> None:
    config = cfg.load(None, [*SLEEP, "run.poll_interval=0.02"])
    store = af.Store()
    register_tasks(store, reference=False)
    events = Events()
    engine = SleepyEngine(events)
    sleep = EngineSleep([engine])
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState(), engine_sleep=sleep)
    rollout = Rollout(ctx, engine)
    with sleep.training():
        weights.publish(store, 1, [("w", torch.ones(4))])
        worker = threading.Thread(target=rollout.step)
        worker.start()
        # (A worker that did not wait would have loaded it by now; a slow machine can only make
        # the test pass without proving much, never fail it.)
        worker.join(0.2)
        assert worker.is_alive()
        assert [name for name, _ in events.seen] == ["sleep"]
    worker.join(timeout=30)
    ctx.stop.set()
    assert events.seen == [("sleep", 0), ("wake_up", 0), ("load", 1)]


def test_a_step_waits_for_the_engine_calls_under_way_before_putting_it_to_sleep() -> None:
    events = Events()
    sleep = EngineSleep([SleepyEngine(events)])
    stop = threading.Event()
    stepped = threading.Event()

    def train() -> None:
        with sleep.training():
            stepped.set()

    with sleep.awake(stop, 0.01) as awake:
        assert awake
        trainer = threading.Thread(target=train)
        trainer.start()
        # (A step that did not wait would have set this by now; a slow machine can only make
        # the test pass without proving much, never fail it.)
        assert not stepped.wait(0.2)
        assert events.seen == []
    trainer.join(timeout=30)
    assert stepped.is_set()
    assert [name for name, _ in events.seen] == ["sleep", "wake_up"]


def test_an_engine_call_waits_while_the_engine_sleeps_and_stops_with_the_run() -> None:
    sleep = EngineSleep([SleepyEngine(Events())])
    stop = threading.Event()
    entered: list[bool] = []

    def call() -> None:
        with sleep.awake(stop, 0.01) as awake:
            entered.append(awake)

    with sleep.training():
        caller = threading.Thread(target=call)
        caller.start()
        caller.join(0.2)
        assert caller.is_alive()
        stop.set()
        caller.join(timeout=30)
    assert entered == [False]


def test_engines_shared_by_workers_sleep_and_wake_once() -> None:
    events = Events()
    engine = SleepyEngine(events)
    with EngineSleep([engine, engine]).training():
        pass
    assert [name for name, _ in events.seen] == ["sleep", "wake_up"]


class FailingToWake(SleepyEngine):
    def wake_up(self) -> None:
        self.events.note("wake_up failed", self.version)
        raise RuntimeError("out of memory")


def test_every_engine_is_woken_even_when_one_fails_and_the_failure_is_raised() -> None:
    events = Events()
    sleep = EngineSleep([FailingToWake(events), SleepyEngine(events)])
    with pytest.raises(RuntimeError, match="out of memory"), sleep.training():
        pass
    assert [name for name, _ in events.seen] == ["sleep", "sleep", "wake_up failed", "wake_up"]
    with sleep.awake(threading.Event(), poll=0.01) as awake:  # the gate is open again
        assert awake


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.engine=hf", "needs rollout.engine: vllm"),
        ("rollout.engine=auto", "needs rollout.engine: vllm"),
        ("trainer.max_staleness=1", "needs the synchronous mode, trainer.max_staleness: 0"),
        ("trainer.staleness_policy=drop", "needs trainer.staleness_policy: wait"),
        ("trainer.streaming=true", "needs trainer.streaming: false"),
        ("rollout.partial=continue", "cannot be combined with rollout.partial: continue"),
        ("launcher=ray", "needs launcher: local"),
    ],
)
def test_sleeping_while_training_is_refused_where_the_engines_would_generate_meanwhile(
    cuda: None, override: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=f"rollout.sleep_while_training {message}"):
        cfg.load(None, [*SLEEP, override])


def test_the_colocated_synchronous_mode_is_accepted(cuda: None) -> None:
    assert cfg.load(None, SLEEP).rollout.sleep_while_training
