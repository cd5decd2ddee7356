"""Single workers against an embedded store: what each promises its neighbours."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.engines.base import (
    Completion,
    LossFn,
    RolloutEngine,
    Sampling,
    StepResult,
    TrainBatch,
)
from asyncflow.engines.errors import WeightLoadError
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.tasks.base import Problem
from asyncflow.tasks.dataset import DatasetTask
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks
from asyncflow.weight_sync.source import WeightsNotHereError, load_into
from asyncflow.weight_sync.versions import put_version
from asyncflow.workers import rollout as rollout_module
from asyncflow.workers.base import (
    LEASES,
    PROMPTS,
    Context,
    LeaseKeeper,
    RunState,
    StallError,
    step_partition,
)
from asyncflow.workers.feeder import Feeder
from asyncflow.workers.rollout import Rollout, load_version
from asyncflow.workers.steps import kept_rows
from asyncflow.workers.trainer import Ledger, Trainer


def context(*overrides: str) -> Context:
    config = cfg.load(None, ["rollout.n=2", "trainer.groups_per_step=2", *overrides])
    store = af.Store()
    register_tasks(store, reference=False)
    return Context(store, config, chatml_tokenizer(), Tracer(), RunState())


@pytest.fixture
def metrics(tmp_path: Path) -> Iterator[MetricsLog]:
    """A trainer's metrics log, closed with its trackers at teardown as the main job closes it."""
    log = MetricsLog(tmp_path)
    yield log
    log.close()
    log.finish()


def put_samples(store: af.Store, group: int) -> None:
    """One group of two samples of step 0, every field the trainer reads ready."""
    ids = [np.array([3, 4], np.int64)] * 2
    store.put(
        {
            "prompt_ids": ids,
            "response_ids": ids,
            "behaviour_logprobs": [np.zeros(2, np.float32)] * 2,
            "advantage": np.zeros(2, np.float32),
            "reward": np.zeros(2, np.float32),
        },
        partition=step_partition(0),
        groups=[group, group],
    )


def test_a_non_streaming_trainer_waits_for_the_whole_step(
    tmp_path: Path, metrics: MetricsLog
) -> None:
    ctx = context("trainer.streaming=false", "run.poll_interval=0.05")
    trainer = Trainer(ctx, None, metrics, Ledger(tmp_path / "ledger"))  # type: ignore[arg-type]
    put_samples(ctx.store, group=0)
    assert not trainer._whole_step_ready(0)
    put_samples(ctx.store, group=1)
    assert trainer._whole_step_ready(0)
    # The barrier hands the step back: the micro-batch claims that follow get all of it.
    batch = ctx.store.claim("train", trainer.fields, 4, timeout=1, partition=step_partition(0))
    assert len(batch) == 4


def test_a_steps_checkpoint_is_taken_once_its_record_is_logged(
    tmp_path: Path, metrics: MetricsLog
) -> None:
    # A kill between the two would otherwise resume past a step whose record was never written.
    logged_then: list[list[int]] = []
    trainer = Trainer(
        context(),
        None,  # type: ignore[arg-type]
        metrics,
        Ledger(tmp_path / "ledger"),
        lambda step: {"eval_accuracy": 0.5},
        lambda step: logged_then.append([r["step"] for r in metrics.history]),
    )
    trainer._record(0, StepResult())
    assert logged_then == [[1]] and metrics.history[0]["eval_accuracy"] == 0.5


def test_a_resumed_trainers_first_rate_counts_only_the_tokens_since_the_resume(
    tmp_path: Path, metrics: MetricsLog
) -> None:
    ctx = context()
    clock = iter([10.0, 12.0])  # the trainer starts at 10 s, its first step ends at 12 s
    ctx.tracer.now = lambda: next(clock)  # type: ignore[method-assign]
    ctx.state.generated_tokens = 5000  # the checkpoint's count, before this run generated any
    trainer = Trainer(ctx, None, metrics, Ledger(tmp_path / "ledger"))  # type: ignore[arg-type]
    ctx.state.generated_tokens += 40
    trainer._record(0, StepResult())
    (record,) = metrics.history
    assert record["tokens_per_s"] == 20.0  # 40 tokens in 2 s, not 5040


class ReloadedMidCall(RolloutEngine):
    """An engine shared with another worker, which loads version 1 while this call runs."""

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self.version = 1
        return [[Completion([5, 1], [-0.1, -0.1], "2")] * sampling.n for _ in prompts]

    def load_weights(self, version: int, weights: object) -> None:
        self.version = version


def put_prompt(store: af.Store, target: int = 0) -> None:
    store.put(
        {
            "prompt_ids": [np.array([3, 4], np.int64)],
            "answer": [b"2"],
            "target_step": np.full(1, target, np.int64),
        },
        partition=PROMPTS,
        groups=[0],
        group_size=1,
    )


def test_samples_carry_the_version_their_generation_started_with() -> None:
    ctx = context()
    put_prompt(ctx.store)
    Rollout(ctx, ReloadedMidCall()).step()
    assert list(ctx.store.rows(partition=step_partition(0)).versions) == [0, 0]


def test_prompts_of_a_step_already_trained_are_acked_and_their_samples_not_put() -> None:
    # Version 1 is out: step 0 was trained whole. A prompt of step 0 claimable again was
    # delivered by a holder that died before acking it; its samples again would sit untrained.
    ctx = context()
    weights.publish(ctx.store, 1, [("w", torch.zeros(2))])
    put_prompt(ctx.store, target=0)
    Rollout(ctx, ReloadedMidCall()).step()
    assert len(ctx.store.rows(partition=step_partition(0))) == 0
    assert len(ctx.store.rows(partition=PROMPTS)) == 0  # acked


def test_a_second_copy_of_a_group_the_step_had_is_let_go_uncounted() -> None:
    ctx = context()
    put_samples(ctx.store, group=0)
    put_samples(ctx.store, group=1)
    batch = ctx.store.claim("train", ["advantage"], 4, whole_groups=True, timeout=5)
    _, stale, again, data = kept_rows(batch, 0, 1, had=[1])
    assert [int(g) for g in batch.groups[again]] == [1, 1]
    assert not stale.any() and len(data["advantage"]) == 2


class OutlastsItsLease(ReloadedMidCall):
    """Generates until the prompts' lease has been renewed ``renewals`` times."""

    def __init__(self, renewed: list[float], renewals: int) -> None:
        super().__init__()
        self.renewed, self.renewals = renewed, renewals
        self.enough = threading.Event()

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        assert self.enough.wait(timeout=120), "the lease was not renewed"  # generous
        return super().generate(prompts, sampling)


@pytest.mark.slow
def test_a_generation_call_that_outlasts_its_prompt_lease_still_delivers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 3 s lease renewed every second; the call lasts five renewals, past the lease's end.
    ctx = context("store.lease_timeout=3")
    put_prompt(ctx.store)
    renewed: list[float] = []
    engine = OutlastsItsLease(renewed, renewals=5)
    renew = af.Batch.renew

    def counted(batch: af.Batch, timeout: float | None = None) -> float:
        left = renew(batch, timeout)
        renewed.append(left)
        if len(renewed) >= engine.renewals:
            engine.enough.set()
        return left

    monkeypatch.setattr(af.Batch, "renew", counted)
    Rollout(ctx, engine).step()
    assert list(ctx.store.rows(partition=step_partition(0)).versions) == [0, 0]
    assert len(ctx.store.rows(partition=PROMPTS)) == 0  # acked
    assert len(renewed) >= 5 and all(left > 0 for left in renewed)
    assert len(LEASES) == 0, "the leases are let go with the call"


class Renewals:
    """A claim whose renewals are counted; ``enough`` is set at the ``wanted``-th."""

    def __init__(self, wanted: int) -> None:
        self.count, self.wanted = 0, wanted
        self.enough = threading.Event()

    def renew(self, timeout: float | None = None) -> float:
        self.count += 1
        if self.count >= self.wanted:
            self.enough.set()
        return 1.0


def test_one_keeper_renews_each_block_of_work_at_its_own_period_until_it_ends() -> None:
    keeper = LeaseKeeper()
    fast, slow, other = Renewals(20), Renewals(2), Renewals(1)
    with keeper.kept([slow], 0.6):  # type: ignore[list-item]  # (renewed every 0.2 s)
        with keeper.kept([fast, other], 0.015):  # type: ignore[list-item]
            assert fast.enough.wait(60) and other.enough.wait(60)  # generous
            assert len(keeper) == 2
        assert slow.enough.wait(60)
        assert slow.count < fast.count
        after = fast.count
    assert len(keeper) == 0
    assert fast.count <= after + 1  # at most a renewal under way as the block ended


class Saturated(ReloadedMidCall):
    def wait_for_room(self, timeout: float) -> bool:
        return False


def test_a_rollout_worker_claims_no_prompts_while_its_engine_is_full() -> None:
    ctx = context()
    put_prompt(ctx.store)
    Rollout(ctx, Saturated()).step()
    assert len(ctx.store.rows(partition=step_partition(0))) == 0
    assert len(ctx.store.claim("rollout", "prompt_ids", 1, timeout=1)) == 1


class Loads(RolloutEngine):
    """An engine that loads what it is given, or refuses every version (``refuse``)."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.refuse = refuse

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        return [[Completion([5, 1], [-0.1, -0.1], "2")] * sampling.n for _ in prompts]

    def load_weights(self, version: int, weights: object) -> None:
        if self.refuse:
            raise WeightLoadError(f"v{version} refused")
        self.version = version


def test_a_version_the_store_failed_to_deliver_is_loaded_at_the_next_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store's trouble (an answer too late, a lost connection) says nothing of the version:
    it is neither reported nor given up, as a broken publication is."""
    ctx = context()
    weights.publish(ctx.store, 1, [("w", torch.zeros(2))])
    failures = [af.errors.StoreTimeoutError("the daemon answered too late")]
    load = ctx.weights.load

    def late_once(engine: RolloutEngine, version: int) -> int:
        if failures:
            raise failures.pop()
        return load(engine, version)

    monkeypatch.setattr(ctx.weights, "load", late_once)
    waits: list[float | None] = []
    monkeypatch.setattr(ctx.stop, "wait", waits.append)
    engine = Loads()
    worker = Rollout(ctx, engine)
    assert not worker.sync_weights()
    assert engine.version == 0 and not failures and ctx.state.weight_failures == []
    assert waits == []  # (a partial rollout's decode loop calls it between two steps)
    # A worker that waits for it waits a poll interval before the next try: not at once, again
    # and again, from a store in trouble.
    worker._wait_for_weights(1)
    assert waits == [ctx.config.run.poll_interval]
    assert worker.sync_weights() and engine.version == 1
    assert len(waits) == 1


def test_with_work_in_flight_an_undelivered_load_is_tried_again_a_poll_interval_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between decode steps or agent turns: each try may wait out the store's timeout, while
    the work in flight could go on with the weights it has."""
    ctx = context("run.poll_interval=5")
    weights.publish(ctx.store, 1, [("w", torch.zeros(2))])
    tries: list[int] = []
    load = ctx.weights.load

    def late_once(engine: RolloutEngine, version: int) -> int:
        tries.append(version)
        if len(tries) == 1:
            raise af.errors.StoreTimeoutError("the daemon answered too late")
        return load(engine, version)

    monkeypatch.setattr(ctx.weights, "load", late_once)
    now = [100.0]
    monkeypatch.setattr(rollout_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    engine = Loads()
    worker = Rollout(ctx, engine)
    assert not worker.sync_weights_in_flight() and tries == [1]
    now[0] += 4.9
    assert not worker.sync_weights_in_flight() and tries == [1], "not within the interval"
    now[0] += 0.1
    assert worker.sync_weights_in_flight() and tries == [1, 1] and engine.version == 1


def test_a_version_gone_from_the_store_with_none_newer_is_tried_again_not_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 1's row is deleted after the worker saw it listed (a resumed run republishes it
    on the same daemon): nothing says it is broken, so it is neither reported nor skipped for
    good, and it loads once it is back."""
    ctx = context()
    weights.publish(ctx.store, 1, [("w", torch.zeros(2))])
    monkeypatch.setattr(ctx.weights, "latest", lambda: 1)  # as listed before the delete
    ctx.store.delete(ctx.store.rows(partition=weights.PARTITION).indexes)
    monkeypatch.setattr(ctx.stop, "wait", lambda timeout: None)
    engine = Loads()
    worker = Rollout(ctx, engine)
    assert not worker.sync_weights()
    assert engine.version == 0 and ctx.state.weight_failures == []
    assert worker._loadable() == 1
    weights.publish(ctx.store, 1, [("w", torch.zeros(2))])
    assert worker.sync_weights() and engine.version == 1


def test_under_wait_a_needed_version_that_failed_to_load_is_waited_past() -> None:
    """Step 1's prompt needs version 1 (staleness 0), which the engine refused: the worker waits
    for a newer version (and names it when the run stalls), rather than claiming and handing
    back the prompt again and again."""
    ctx = context("trainer.max_staleness=0", "run.stall_timeout=1")
    weights.publish(ctx.store, 1, [("w", torch.zeros(2))])
    put_prompt(ctx.store, target=1)
    worker = Rollout(ctx, Loads(refuse=True))
    with pytest.raises(StallError, match="policy weights version 2"):
        worker.step()
    assert len(ctx.state.weight_failures) == 1 and "v1" in ctx.state.weight_failures[0]
    assert len(ctx.store.claim("rollout", "prompt_ids", 1, timeout=1)) == 1, "handed back"


class RefusesSome(Loads):
    """An engine that refuses the versions in ``refused`` and loads the others."""

    def __init__(self, refused: set[int]) -> None:
        super().__init__()
        self.refused = refused

    def load_weights(self, version: int, weights: object) -> None:
        if version in self.refused:
            raise WeightLoadError(f"v{version} refused")
        self.version = version


def test_while_the_newest_version_fails_to_load_the_one_before_it_is_loaded() -> None:
    """Versions 1 and 2 came out before the engine's next weight check, and it refuses 2. Step
    2's prompt needs version 1 or newer (staleness 1); the store still keeps version 1: the
    worker loads it and generates, rather than waiting for version 3, which needs step 2's
    samples (it stalled until ``run.stall_timeout``)."""
    ctx = context("trainer.max_staleness=1", "run.stall_timeout=10")
    for v in (1, 2):
        weights.publish(ctx.store, v, [("w", torch.zeros(2))])
    put_prompt(ctx.store, target=2)
    engine = RefusesSome({2})
    worker = Rollout(ctx, engine)
    for _ in range(3):  # the first step finds version 2 refused and hands the prompt back
        worker.step()
        if len(ctx.store.rows(partition=step_partition(2))):
            break
    assert engine.version == 1
    assert len(ctx.store.rows(partition=step_partition(2))) == ctx.config.rollout.n
    assert len(ctx.state.weight_failures) == 1 and "v2" in ctx.state.weight_failures[0]


def test_the_version_before_a_refused_one_is_tried_only_where_the_source_keeps_it() -> None:
    ctx = context()
    for v in (1, 2):
        weights.publish(ctx.store, v, [("w", torch.zeros(2))])
    worker = Rollout(ctx, RefusesSome({2}))
    assert not worker.sync_weights()  # version 2 refused
    assert worker._loadable() == 1
    ctx.weights.keeps_previous = False  # as a broadcast receiver, which holds only the newest
    assert worker._loadable() is None


def test_waiting_workers_see_new_weights_once_they_are_published() -> None:
    store = af.Store()
    watcher = weights.Watcher(store, interval=0.01)
    assert watcher.latest() is None
    publisher = threading.Timer(0.1, weights.publish, (store, 3, [("w", torch.zeros(2))]))
    publisher.start()
    started = time.monotonic()
    assert watcher.wait_for(3, timeout=10)
    assert time.monotonic() - started < 5
    assert watcher.latest() == 3
    assert not watcher.wait_for(4, timeout=0.1)
    publisher.join()


class FailingOnce:
    """A store whose first listing fails (a daemon restarting); ``failed`` is set then."""

    def __init__(self, store: af.Store) -> None:
        self.store = store
        self.failed = threading.Event()

    def rows(self, **kwargs: object) -> af.Rows:
        if not self.failed.is_set():
            self.failed.set()
            raise af.errors.ConnectionError("the daemon restarts")
        return self.store.rows(**kwargs)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


@pytest.mark.parametrize("waiting", ["throughout", "after"])
def test_waiters_see_new_weights_after_a_store_read_failed_once(waiting: str) -> None:
    """A failed read (a daemon restarting) is tried again while anyone waits: a waiter that
    waited through it, and one that came after, both see the version published next."""
    store = af.Store()
    flaky = FailingOnce(store)
    watcher = weights.Watcher(flaky, interval=0.01)  # type: ignore[arg-type]
    seen: list[bool] = []
    patience = 60.0 if waiting == "throughout" else 1.0  # generous; or gives up unanswered
    first = threading.Thread(target=lambda: seen.append(watcher.wait_for(1, patience)), daemon=True)
    first.start()
    assert flaky.failed.wait(60)  # generous
    if waiting == "after":
        first.join(timeout=120)
        assert seen == [False]
        seen.clear()
        first = threading.Thread(target=lambda: seen.append(watcher.wait_for(1, 60)), daemon=True)
        first.start()
    weights.publish(store, 1, [("w", torch.zeros(2))])
    first.join(timeout=120)
    assert seen == [True]


def test_a_version_published_below_ones_left_in_the_store_is_the_newest() -> None:
    # A daemon that outlived an earlier run (or a resume against it) still holds its versions.
    store = af.Store()
    for v in (10, 11):
        weights.publish(store, v, [("w", torch.full((2,), float(v)))])
    weights.publish(store, 9, [("w", torch.full((2,), 9.0))])
    assert weights.latest_version(store) == 9
    assert weights.fetch(store)[1][0][1].tolist() == [9.0, 9.0]
    weights.publish(store, 10, [("w", torch.full((2,), 100.0))])
    assert sorted(weights.published(store)) == [9, 10]
    assert weights.fetch(store, 10)[1][0][1].tolist() == [100.0, 100.0]


@pytest.mark.parametrize("keep", [1, 2, 3, 4])
def test_a_put_version_keeps_the_newest_versions_it_is_told_to(keep: int) -> None:
    store = af.Store()
    for v in range(1, 5):
        put_version(store, "versions", {"x": np.zeros(1)}, v, keep)
    assert sorted(int(v) for v in store.rows(partition="versions").versions) == list(
        range(5 - keep, 5)
    )


def test_publishing_needs_room_for_the_versions_kept_only() -> None:
    # Room for two versions of 4 KiB and a little more: the third goes in once the first left.
    store = af.Store(memory_limit=2 * 4096 + 2048)
    for v in range(5):
        weights.publish(store, v, [("w", torch.zeros(1024))])
    assert sorted(weights.published(store)) == [3, 4]


def test_a_version_replaced_before_it_was_read_loads_the_newest_instead() -> None:
    ctx = context()
    for v in (1, 2, 3):  # version 1 read as the newest, then two more published before the load
        weights.publish(ctx.store, v, [("w", torch.zeros(2))])
    engine = Loads()
    assert load_version(ctx.weights, engine, 1) is None
    assert engine.version == 3


def test_a_newer_version_that_failed_in_place_of_the_one_asked_for_is_the_one_named() -> None:
    """Version 1 was replaced before it was read, so the source went on to the newest, version
    3, which the engine refused: the failure names version 3, not 1."""
    ctx = context()
    for v in (1, 2, 3):
        weights.publish(ctx.store, v, [("w", torch.zeros(2))])
    engine = Loads(refuse=True)
    failure = load_version(ctx.weights, engine, 1)
    assert failure is not None and engine.version == 0
    failed, why = failure
    assert failed == 3 and "weights v3 failed to load" in why, why
    # And a refusal raised without a version gets the one the source tried to load.
    with pytest.raises(WeightLoadError) as refused:
        load_into(engine, 7, [])
    assert refused.value.version == 7


def test_a_version_is_published_only_once_its_manifest_is_ready() -> None:
    # A store spread over several daemons lists a row once its put is admitted, before its cells
    # are in; a row of the weights partition without its manifest stands for that here.
    store = af.Store()
    weights.publish(store, 3, [("w", torch.ones(2))])
    store.put({"weights/w": np.zeros((1, 2), np.float32)}, partition=weights.PARTITION, version=4)
    assert weights.latest_version(store) == 3
    version, tensors = weights.fetch(store)
    assert version == 3 and torch.equal(tensors[0][1], torch.ones(2))
    with pytest.raises(WeightsNotHereError, match="version 4 is not in the store"):
        weights.fetch(store, 4)


def test_a_version_replaced_by_newer_ones_is_gone_and_a_later_one_yet_to_come() -> None:
    """Only the second is worth trying again (see ``WeightsNotHereError``)."""
    store = af.Store()
    for version in range(1, weights.KEEP_VERSIONS + 2):
        weights.publish(store, version, [("w", torch.zeros(2))])
    with pytest.raises(LookupError, match="version 1 is not in the store") as replaced:
        weights.fetch(store, 1)
    assert not isinstance(replaced.value, WeightsNotHereError)
    with pytest.raises(WeightsNotHereError, match="is not in the store"):
        weights.fetch(store, weights.KEEP_VERSIONS + 2)


def test_a_version_deleted_while_the_versions_are_listed_is_left_out() -> None:
    store = af.Store()
    for version in (1, 2, 3):
        weights.publish(store, version, [("w", torch.full((2,), float(version)))])

    class DeletingAfterListing:
        """The store, as a publisher deleting version 2 just after the listing leaves it."""

        def rows(self, **kwargs: object) -> af.Rows:
            rows = store.rows(**kwargs)  # type: ignore[arg-type]
            store.delete([i for i, v in zip(rows.indexes, rows.versions, strict=True) if v == 2])
            return rows

        def ready_fields(self, indexes: np.ndarray) -> list[list[str]]:
            return store.ready_fields(indexes)

    assert set(weights.published(DeletingAfterListing())) == {3}  # type: ignore[arg-type]


class RecordingTrainEngine(HFTrainEngine):
    """The hf engine, noting the size of every micro-batch it is handed."""

    def __init__(self, model_dir: Path, config: cfg.Config) -> None:
        super().__init__(model_dir, config)
        self.seen: list[tuple[int, int, int]] = []  # (tensor tokens, samples, response tokens)

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        responses = int(batch.response_mask.sum())
        self.seen.append((batch.input_ids.numel(), batch.sequences, responses))
        return super().forward_backward(batch, loss_fn)


def put_long_samples(store: af.Store, groups: int, n: int, rng: np.random.Generator) -> int:
    """Samples of step 0 with prompts of 20 to 200 tokens; returns their response tokens."""
    total = 0
    for g in range(groups):
        prompt = rng.integers(4, 90, int(rng.integers(20, 200)))
        responses = [rng.integers(4, 90, int(rng.integers(1, 9))) for _ in range(n)]
        total += sum(len(r) for r in responses)
        store.put(
            {
                "prompt_ids": [prompt] * n,
                "response_ids": responses,
                "behaviour_logprobs": [np.full(len(r), -1.0, np.float32) for r in responses],
                "advantage": rng.normal(size=n).astype(np.float32),
                "reward": np.zeros(n, np.float32),
            },
            partition=step_partition(0),
            groups=[g] * n,
        )
    return total


@pytest.mark.parametrize(("packing", "share"), [(True, True), (True, False), (False, False)])
def test_the_trainer_keeps_every_micro_batch_within_the_token_budget_on_long_prompts(
    tmp_path: Path, metrics: MetricsLog, packing: bool, share: bool
) -> None:
    budget, groups, n = 400, 6, 2
    ctx = context(
        f"trainer.micro_batch_tokens={budget}",
        f"trainer.groups_per_step={groups}",
        f"rollout.n={n}",
        f"trainer.packing={str(packing).lower()}",
        f"trainer.share_prompts={str(share).lower()}",
        "model.hidden_size=32",
        "model.heads=2",
        "model.kv_heads=1",
        "model.intermediate_size=64",
        "model.max_positions=256",
    )
    model = create_tiny_model(ctx.config.model, tmp_path / "model", seed=0)
    engine = RecordingTrainEngine(model, ctx.config)
    total = put_long_samples(ctx.store, groups, n, np.random.default_rng(1))
    trainer = Trainer(ctx, engine, metrics, Ledger(tmp_path / "ledger"))
    outcome = trainer._accumulate(0)
    assert outcome is not None
    assert engine.seen and max(tensor for tensor, _, _ in engine.seen) <= budget
    assert sum(samples for _, samples, _ in engine.seen) == groups * n, "every sample once"
    assert sum(tokens for _, _, tokens in engine.seen) == total
    # Shared, each group's prompt (most of its samples' tokens here) is laid out once.
    assert any(batch.shared_mask is not None for batch in outcome[0]) == share
    padding = outcome[1].padding()
    if packing:  # short samples fill the rows beside long ones: less padding than padded
        assert padding["padding_fraction"] < padding["padding_fraction_unpacked"]
    assert padding["micro_batch_tokens_max"] <= budget


def test_the_feeder_puts_prompts_rendered_by_the_chat_template_with_the_system_prompt() -> None:
    ctx = context("data.system_prompt=Be brief.", "trainer.max_steps=1")
    chat = [{"role": "user", "content": "1+1="}]
    task = DatasetTask([Problem(chat, "2"), Problem("2+2=", "4")], [], {})
    Feeder(ctx, task).step()
    batch = ctx.store.claim("rollout", ["prompt_ids", "answer"], 2, timeout=1, partition=PROMPTS)
    rendered = [ctx.tokenizer._tok.decode(ids) for ids in batch.read()["prompt_ids"]]  # type: ignore[attr-defined]
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    opened = "<|im_end|>\n<|im_start|>assistant\n"
    assert sorted(rendered) == [
        f"{system}<|im_start|>user\n1+1={opened}",
        f"{system}<|im_start|>user\n2+2={opened}",
    ]
