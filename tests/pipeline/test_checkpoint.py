"""Checkpoints taken while rollout workers elsewhere (the Ray launcher's actors, which the
snapshot's lock does not stop) turn prompt groups into samples: every prompt group issued is in
the checkpoint exactly once, as its prompt or as its samples, whenever the delivery falls. On the
embedded store and on a store sharded over storage daemons, as the Ray launcher places it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncflow as af
from asyncflow import checkpoint
from asyncflow import config as cfg
from asyncflow.algorithms.lr_schedule import lr_factor
from asyncflow.batch import Batch
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.models.tiny import create_tiny_model
from asyncflow.train import register_tasks
from asyncflow.workers.base import PROMPTS, RunState

N = 2
#: Prompt groups issued (all for step 0); group 9's samples are in before the checkpoint.
GROUPS = [0, 1, 2, 3, 9]
ROOM = 100_000


class NoEngine:
    """A train engine whose state is an empty directory."""

    def save(self, directory: Path) -> None:
        directory.mkdir()


class Racing:
    """A store where a rollout elsewhere delivers groups while the checkpoint reads it: just
    before the prompts' fields are read, or just before every row is listed."""

    def __init__(self, store: af.Store) -> None:
        self.store = store
        self.before_read: Callable[[], None] | None = None
        self.before_listing: Callable[[], None] | None = None

    def ready_fields(self, indexes: Any) -> list[list[str]]:
        if self.before_read is not None:
            hook, self.before_read = self.before_read, None
            hook()
        return self.store.ready_fields(indexes)

    def rows(self, indexes: Any = None, *, partition: str | None = None) -> Any:
        if indexes is None and partition is None and self.before_listing is not None:
            hook, self.before_listing = self.before_listing, None
            hook()
        return self.store.rows(indexes, partition=partition)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@pytest.fixture(params=["embedded", "sharded"])
def store(
    request: pytest.FixtureRequest, sharded_store: Callable[..., af.Store]
) -> Iterator[af.Store]:
    if request.param == "embedded":
        yield af.Store()
        return
    yield sharded_store(2, "--memory-limit", str(ROOM))


def samples(group: int) -> dict[str, Any]:
    return {
        "prompt_ids": [np.array([1, 2, group], np.int64)] * N,
        "response_ids": [np.array([5, 6], np.int64)] * N,
        "behaviour_logprobs": [np.array([-0.5, -0.25], np.float32)] * N,
        "answer": [b"%d" % group] * N,
    }


def put_samples(store: af.Store, group: int, **options: Any) -> None:
    store.put(samples(group), partition="step-0", groups=[group] * N, group_size=N, **options)


def pipeline(store: af.Store) -> dict[int, tuple[Batch, int]]:
    """Prompt groups fed, claimed by a rollout; group 9 already delivered (its samples in, its
    prompt acked). The rollout's claim and each prompt's row, by group."""
    register_tasks(store, reference=False)
    store.put(
        {
            "prompt_ids": [np.array([1, 2, g], np.int64) for g in GROUPS],
            "answer": [b"%d" % g for g in GROUPS],
            "target_step": np.zeros(len(GROUPS), np.int64),
        },
        partition=PROMPTS,
        groups=GROUPS,
        group_size=1,
    )
    batch = store.claim("rollout", ["prompt_ids"], len(GROUPS), timeout=5)
    held = {int(g): (batch, int(i)) for g, i in zip(batch.groups, batch.indexes, strict=True)}
    deliver(store, held, 9)
    return held


def deliver(store: af.Store, held: dict[int, tuple[Batch, int]], group: int) -> None:
    """As a rollout does: the group's samples in, then its prompt acked."""
    put_samples(store, group)
    batch, index = held[group]
    batch.ack([index])


def restored(ckpt: Path) -> tuple[list[int], list[int]]:
    """The prompt groups and the sample groups a resumed run gets back from ``ckpt``."""
    fresh = af.Store()
    checkpoint.restore_rows(ckpt, fresh, N)
    rows = fresh.rows()
    prompts = [int(g) for p, g in zip(rows.partitions, rows.groups, strict=True) if p == PROMPTS]
    sampled = [int(g) for p, g in zip(rows.partitions, rows.groups, strict=True) if p != PROMPTS]
    for names in fresh.ready_fields(rows.indexes):
        assert names, "every row restored has its fields"
    for group in set(sampled):
        assert sampled.count(group) == N, f"group {group}'s samples are whole"
    return sorted(prompts), sorted(set(sampled))


def save(tmp_path: Path, store: Any) -> Path:
    return checkpoint.save(tmp_path, 1, NoEngine(), store, RunState(), {})  # type: ignore[arg-type]


def test_a_prompt_freed_before_the_checkpoint_reads_it_comes_back_as_its_samples(
    store: af.Store, tmp_path: Path
) -> None:
    held = pipeline(store)
    racing = Racing(store)
    racing.before_read = lambda: deliver(store, held, 0)
    assert restored(save(tmp_path, racing)) == ([1, 2, 3], [0, 9])


def test_a_prompt_read_whose_samples_come_before_the_listing_is_left_out(
    store: af.Store, tmp_path: Path
) -> None:
    held = pipeline(store)
    racing = Racing(store)
    racing.before_listing = lambda: deliver(store, held, 1)
    assert restored(save(tmp_path, racing)) == ([0, 2, 3], [1, 9])


def test_samples_still_being_put_are_left_out_and_their_prompt_kept(
    sharded_store: Callable[..., af.Store], tmp_path: Path
) -> None:
    """On a sharded store a put's rows are listed (admitted) before their payloads are stored:
    a put held up by a full storage daemon stays so until room is made."""
    store = sharded_store(1, "--memory-limit", str(ROOM))
    held = pipeline(store)
    full = np.zeros(ROOM - store.stats()["memory_used"], np.uint8)
    [filler] = store.put({"fill": [full]}, partition="other")
    putting = threading.Thread(target=put_samples, args=(store, 2), kwargs={"timeout": 120})
    putting.start()
    deadline = time.monotonic() + 60
    while 2 not in store.rows(partition="step-0").groups:
        assert time.monotonic() < deadline, "the put's rows were never admitted"
        time.sleep(0.05)
    ckpt = save(tmp_path, store)
    store.delete([filler])  # room: the put completes
    putting.join()
    batch, index = held[2]
    batch.ack([index])  # as the rollout does once its samples are in
    assert restored(ckpt) == ([0, 1, 2, 3], [9])
    assert sorted(set(store.rows(partition="step-0").groups.tolist())) == [2, 9], "put in since"


def test_a_checkpoint_keeps_the_runs_counts_for_the_resumed_runs_summary(tmp_path: Path) -> None:
    """A resumed run adds them to its own: its summary counts the whole run, not what was
    generated since the resume."""
    state = RunState(generated_samples=24, generated_tokens=184, reward_failures=1)
    state.staleness.update({0: 4, 1: 20})
    state.note_version_spans([0, 0, 2])
    state.weight_failures.append("version 3 failed to load")
    saved = checkpoint.save(tmp_path, 1, NoEngine(), af.Store(), state, {})  # type: ignore[arg-type]
    resumed = RunState(generated_samples=2)
    resumed.staleness.update({1: 1})
    resumed.add_counts(checkpoint.read_state(saved)["counts"])
    assert (resumed.generated_samples, resumed.generated_tokens) == (26, 184)
    assert resumed.reward_failures == 1 and resumed.dropped_samples == 0
    assert resumed.staleness == {0: 4, 1: 21}
    assert resumed.version_span_histogram() == {"0": 2, "2": 1}
    assert resumed.weight_failures == ["version 3 failed to load"]


def test_a_checkpoint_is_on_disk_before_it_takes_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synced, then renamed: after a power cut its newest checkpoint held empty files, and the
    run could not resume (an older whole one was there)."""
    synced: list[Path] = []
    real_fsync = os.fsync

    def noting(fd: int) -> None:
        synced.append(Path(f"/proc/self/fd/{fd}").readlink())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", noting)
    final = checkpoint.save(tmp_path, 3, NoEngine(), af.Store(), RunState(), {})  # type: ignore[arg-type]
    tmp = final.with_name(final.name + ".tmp")
    written = {tmp / p.relative_to(final) for p in final.rglob("*")} | {tmp}
    assert written <= set(synced[: len(written)]), "each file and directory, before the rename"
    assert synced[-1] == final.parent, "and the rename itself"


def test_a_resumed_train_engine_takes_this_runs_learning_rate_and_weight_decay(
    tmp_path: Path,
) -> None:
    """The optimiser and schedule a checkpoint brings back carry the rate, weight decay and
    base rate they were saved with; the resumed run's own (a resume may change them) apply,
    at the schedule's place."""
    first = cfg.load(None, ["trainer.warmup_steps=2", "trainer.max_steps=8"])
    model_dir = create_tiny_model(first.model, tmp_path / "model", 0)
    engine = HFTrainEngine(model_dir, first)
    for _ in range(3):
        engine.optimizer.step()
        engine.schedule.step()
    engine.save(tmp_path / "ckpt")
    changed = ["trainer.lr=1e-5", "trainer.weight_decay=0.1", "trainer.max_steps=20"]
    second = cfg.load(None, ["trainer.warmup_steps=2", *changed])
    resumed = HFTrainEngine(model_dir, second)
    resumed.load(tmp_path / "ckpt")
    (group,) = resumed.optimizer.param_groups
    factor = lr_factor(second.trainer)
    assert group["lr"] == pytest.approx(1e-5 * factor(3))
    assert group["weight_decay"] == 0.1
    resumed.optimizer.step()
    resumed.schedule.step()
    assert group["lr"] == pytest.approx(1e-5 * factor(4))
