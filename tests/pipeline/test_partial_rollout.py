"""Partial rollout: weights that change while sequences are being generated. Every recorded token
must carry the policy version that sampled it and the log-prob it was sampled with, as a replay of
the same weight schedule recomputes them (bit for bit: the hf engine in fp32 on a CPU)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.agents.evaluation import agent_totals
from asyncflow.engines.base import Completion, Request, Sampling
from asyncflow.engines.errors import EngineDiedError, WeightLoadError
from asyncflow.engines.hf import HFRolloutEngine
from asyncflow.errors import StoreTimeoutError
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.progress import Reporter
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks, train
from asyncflow.weights import Watcher
from asyncflow.workers.base import LEASES, PROMPTS, Context, RunState, step_partition
from asyncflow.workers.partial import PartialRollout
from asyncflow.workers.rollout import token_versions
from asyncflow.workers.routing import Assignment, Dispatcher, Inbox
from asyncflow.workers.steps import kept_rows
from asyncflow.workers.trainer import Ledger, Trainer
from partial_replay import PROMPT, SWITCH, generate_with_switch, policy_versions, replay
from run_outputs import metrics


def settings(*overrides: str) -> cfg.Config:
    return cfg.load(
        None,
        [
            "rollout.n=2",
            "rollout.max_tokens=16",
            "rollout.max_num_seqs=4",
            "trainer.groups_per_step=1",
            "run.poll_interval=0.01",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(settings().model, tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def versions(model_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    return policy_versions(model_dir)


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(7)


def engine_at(
    model_dir: Path, config: cfg.Config, tensors: dict[str, torch.Tensor]
) -> HFRolloutEngine:
    engine = HFRolloutEngine(model_dir, config)
    engine.load_weights(0, tensors.items())
    return engine


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_each_token_carries_the_version_and_log_prob_it_was_sampled_with(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]], mode: str
) -> None:
    engine = engine_at(model_dir, settings(), versions[0])
    done = generate_with_switch(engine, versions[1], mode)
    spanning = [r for r in done if len(r.token_ids) > SWITCH]
    assert spanning, "a sequence outlived the switch (the seed gives long ones)"
    for r in done:
        n = len(r.token_ids)
        assert r.versions == [0] * min(n, SWITCH) + [1] * max(0, n - SWITCH)
        assert r.logprobs == replay(model_dir, versions, PROMPT, r.token_ids, r.versions, mode)
    # The replay tells the two schedules apart: the other one's log-probs differ.
    other = "abort" if mode == "continue" else "continue"
    r = spanning[0]
    assert r.logprobs != replay(model_dir, versions, PROMPT, r.token_ids, r.versions, other)


def test_queued_sequences_are_admitted_as_others_finish(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir, settings("rollout.max_num_seqs=2"))
    for key in range(5):
        engine.add_request(Request(key, PROMPT, Sampling(max_tokens=3)))
    finished_at = {}
    for step in range(10):
        assert len(engine.loop.running) <= 2
        for r in engine.step():
            finished_at[r.key] = step
    assert finished_at == {0: 2, 1: 2, 2: 5, 3: 5, 4: 8}


def test_requests_cut_by_key_leave_the_others_decoding(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir, settings("rollout.max_num_seqs=2"))
    for key in range(4):
        engine.add_request(Request(key, PROMPT, Sampling(max_tokens=3, greedy=True)))
    engine.step()  # 0 and 1 running, 2 and 3 queued
    cut = engine.abort_requests({1, 3})
    assert [(r.key, len(r.token_ids)) for r in cut] == [(1, 1), (3, 0)]
    done = []
    while engine.in_flight():
        done += engine.step()
    assert sorted(r.key for r in done) == [0, 2]


def context(*overrides: str) -> Context:
    store = af.Store()
    register_tasks(store, reference=False)
    ctx = Context(store, settings(*overrides), chatml_tokenizer(), Tracer(), RunState())
    ctx.weights = Watcher(store, 0.0)  # every step sees the newest publication
    return ctx


def put_prompts(store: af.Store, target: int, groups: int = 1) -> None:
    store.put(
        {
            "prompt_ids": [np.array(PROMPT, np.int64)] * groups,
            "answer": [b"7"] * groups,
            "target_step": np.full(groups, target, np.int64),
        },
        partition=PROMPTS,
        groups=list(range(groups)),
        group_size=1,
    )


def run_until_samples(
    worker: PartialRollout, target: int, rows: int, publish: dict[int, dict[str, torch.Tensor]]
) -> None:
    """Steps the worker until ``rows`` samples of step ``target`` are in; ``publish`` maps a step
    count to the weights published (as the next version) after that many steps."""
    store = worker.store
    for count in range(1, 200):
        worker.step()
        if count in publish:
            newest = weights.latest_version(store) or 0
            weights.publish(store, newest + 1, publish[count].items())
        if len(store.rows(partition=step_partition(target))) >= rows:
            return
    raise AssertionError("the samples never came")


def read_samples(store: af.Store, target: int) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
    rows = store.rows(partition=step_partition(target))
    data = store.read(rows.indexes, ["response_ids", "behaviour_logprobs", "token_versions"])
    return rows.versions.astype(np.int64), data


def test_a_completion_without_versions_of_its_own_is_all_of_the_calls_version() -> None:
    done = [
        Completion([1, 2, 3], [0.0] * 3, "", token_versions=[4, 2, 3]),
        Completion([5, 6], [0.0] * 2, ""),  # sampled by the call's version throughout
        Completion([], [], ""),  # empty: as old as the call
        Completion([7], [0.0], "", token_versions=[6]),
    ]
    lengths = np.array([len(c.token_ids) for c in done])
    versions, oldest, spans = token_versions(done, lengths, 5)
    assert versions.tolist() == [4, 2, 3, 5, 5, 6]
    assert oldest.tolist() == [2, 5, 5, 6] and oldest.dtype == np.uint64
    assert spans.tolist() == [2, 0, 0, 0]
    # None of them with versions of its own: every token, and every row, of the call's version.
    versions, oldest, spans = token_versions(done[1:3], lengths[1:3], 5)
    assert versions.tolist() == [5, 5] and oldest.tolist() == [5, 5] and spans.tolist() == [0, 0]


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_the_store_records_each_tokens_version_and_the_row_is_as_old_as_its_oldest_token(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]], mode: str
) -> None:
    ctx = context(f"rollout.partial={mode}")
    weights.publish(ctx.store, 0, versions[0].items())
    engine = HFRolloutEngine(model_dir, ctx.config)
    put_prompts(ctx.store, target=1)  # (a step the trainer is not past when version 1 is out)
    run_until_samples(PartialRollout(ctx, engine), 1, 2, {SWITCH: versions[1]})
    row_versions, data = read_samples(ctx.store, 1)
    assert engine.version == 1
    for k in range(2):
        tokens = data["response_ids"][k].tolist()
        recorded = data["token_versions"][k].tolist()
        assert recorded == sorted(recorded) and set(recorded) <= {0, 1}
        assert row_versions[k] == min(recorded)
        expected = replay(model_dir, versions, PROMPT, tokens, recorded, mode)
        assert data["behaviour_logprobs"][k].tolist() == pytest.approx(expected, abs=0, rel=1e-7)
    assert ctx.state.multi_version_share() > 0


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_under_wait_no_token_is_older_than_the_staleness_bound(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]], mode: str
) -> None:
    ctx = context(f"rollout.partial={mode}", "trainer.max_staleness=1")
    weights.publish(ctx.store, 0, versions[0].items())
    engine = HFRolloutEngine(model_dir, ctx.config)
    worker = PartialRollout(ctx, engine)
    put_prompts(ctx.store, target=2)  # needs version 1 at least
    worker._wait_for_weights = lambda version: None  # type: ignore[method-assign]
    for _ in range(3):
        worker.step()
    assert engine.in_flight() == 0, "nothing is generated for step 2 under version 0"
    run_until_samples(worker, 2, 2, {1: versions[1], SWITCH: versions[2]})
    row_versions, data = read_samples(ctx.store, 2)
    for k in range(2):
        assert min(data["token_versions"][k]) >= 1
        assert row_versions[k] == min(data["token_versions"][k])
    assert max(max(v) for v in data["token_versions"]) == 2, "weights changed mid-generation"


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_under_drop_a_sample_is_dropped_for_its_oldest_token_though_its_newest_is_fresh(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]], mode: str, tmp_path: Path
) -> None:
    ctx = context(
        f"rollout.partial={mode}", "trainer.max_staleness=1", "trainer.staleness_policy=drop"
    )
    weights.publish(ctx.store, 0, versions[0].items())
    engine = HFRolloutEngine(model_dir, ctx.config)
    put_prompts(ctx.store, target=2)
    run_until_samples(PartialRollout(ctx, engine), 2, 2, {1: versions[2]})
    row_versions, data = read_samples(ctx.store, 2)
    # Its newest tokens (version 1) are within the bound of step 2; its oldest (version 0) not.
    assert max(max(v) for v in data["token_versions"]) == 1
    assert list(row_versions) == [0, 0]
    idx = ctx.store.rows(partition=step_partition(2)).indexes
    ctx.store.put(
        {"advantage": np.ones(2, np.float32), "reward": np.ones(2, np.float32)}, indexes=idx
    )
    trainer = Trainer(ctx, None, None, Ledger(tmp_path / "ledger"))  # type: ignore[arg-type]
    outcome = trainer._accumulate(2)
    assert outcome is not None
    batches, result = outcome
    assert batches == [] and result.dropped_groups == [0] and not result.trained_groups


def test_under_drop_a_group_whose_rows_differ_in_age_is_dropped_whole() -> None:
    # Sequences of one group admitted on either side of a weight load (more of them than the
    # engine's slots, or prefills split over steps): rows of versions 0, 0, 1, 1. At step 2
    # with a bound of 1, keeping the two fresh rows would train half a group, whose advantages
    # no longer balance.
    store = af.Store()
    register_tasks(store, reference=False)
    store.put(
        {
            "response_ids": [np.array([5, 6], np.int64)] * 8,
            "advantage": np.array([1, -1, 1, -1, 1, -1, 1, -1], np.float32),
        },
        partition=step_partition(2),
        groups=[0] * 4 + [1] * 4,
        group_size=4,
        version=[0, 0, 1, 1, 1, 1, 1, 2],
    )
    batch = store.claim("train", ["response_ids", "advantage"], 8, whole_groups=True, timeout=5)
    age, stale, again, data = kept_rows(batch, 2, 1)
    assert not again.any()
    by_group = {int(g): bool(s) for g, s in zip(batch.groups, stale, strict=True)}
    assert by_group == {0: True, 1: False}
    assert sorted(age[~stale].tolist()) == [0, 1, 1, 1]
    assert [float(a) for a in data["advantage"]] == [1, -1, 1, -1]


def test_weights_that_fail_their_checks_leave_the_engine_whole_on_its_version(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]]
) -> None:
    engine = engine_at(model_dir, settings(), versions[0])
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    missing = dict(list(versions[1].items())[:-1])
    names = list(versions[1])
    wrong_shape = {**versions[1], names[-1]: versions[1][names[-1]][:-1]}
    for broken, why in [(missing, "lack 1 tensors"), (wrong_shape, "the shape")]:
        with pytest.raises(WeightLoadError, match=f"v1 .*{why}|v1 {why}"):
            engine.load_weights(1, broken.items())
        assert engine.version == 0
        for n, p in engine.model.named_parameters():
            assert torch.equal(p, before[n]), f"{n} was overwritten by a refused version"


@pytest.mark.parametrize("failure", ["transient", "unloadable"])
def test_under_abort_a_version_that_does_not_load_cuts_nothing(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]], failure: str
) -> None:
    """Sequences are cut only once the new weights are in: a version the store is slow to
    deliver (tried again at every decode step) or that fails to load leaves them decoding."""

    class Failing(Watcher):
        def load(self, engine: Any, version: int) -> int:
            if version > 0 and failure == "transient":
                raise StoreTimeoutError(f"fetching weights v{version}: timed out")
            if version > 0:
                raise WeightLoadError(f"weights v{version} lack 1 tensors")
            return super().load(engine, version)

    ctx = context("rollout.partial=abort", "rollout.max_tokens=12")
    ctx.weights = Failing(ctx.store, 0.0)
    engine = engine_at(model_dir, ctx.config, versions[0])
    weights.publish(ctx.store, 0, list(versions[0].items()))
    cut: list[Request] = []
    abort = engine.abort_requests

    def counted() -> list[Request]:
        requests = abort()
        cut.extend(requests)
        return requests

    engine.abort_requests = counted  # type: ignore[method-assign]
    put_prompts(ctx.store, target=1)  # v1 is the policy of step 1's prompts
    worker = PartialRollout(ctx, engine)
    worker.step()  # admitted, first decode step
    weights.publish(ctx.store, 1, list(versions[1].items()))
    run_until_samples(worker, 1, 2, {})
    assert cut == [], "sequences were cut for a version that never loaded"
    assert engine.version == 0


def test_a_truncated_publication_is_reported_and_generation_goes_on_with_the_old_version(
    model_dir: Path, versions: dict[int, dict[str, torch.Tensor]]
) -> None:
    ctx = context("rollout.partial=continue")
    weights.publish(ctx.store, 0, versions[0].items())
    engine = HFRolloutEngine(model_dir, ctx.config)
    put_prompts(ctx.store, target=1)
    name = next(iter(versions[1]))
    truncated = {**versions[1], name: versions[1][name][:5]}  # its first rows only
    run_until_samples(PartialRollout(ctx, engine), 1, 2, {2: truncated})
    assert engine.version == 0
    assert (
        len(ctx.state.weight_failures) == 1 and "weights v1 failed" in ctx.state.weight_failures[0]
    )
    _, data = read_samples(ctx.store, 1)
    assert all(set(v.tolist()) == {0} for v in data["token_versions"])


class DiesMidSequence(HFRolloutEngine):
    """Its process is killed at its ``fatal_step``-th decode step."""

    fatal_step = 5
    steps = 0

    def step(self) -> list[Request]:
        self.steps += 1
        if self.steps == self.fatal_step:
            raise EngineDiedError("hf rollout engine died")
        return super().step()


def test_an_engine_killed_mid_sequence_loses_only_its_in_flight_groups(model_dir: Path) -> None:
    # Room for one group at a time: group 0 finishes (3 tokens), group 1 is cut mid-sequence.
    ctx = context("rollout.partial=continue", "rollout.max_tokens=3", "rollout.max_num_seqs=2")
    engine = DiesMidSequence(model_dir, ctx.config)
    put_prompts(ctx.store, target=0, groups=2)
    worker = PartialRollout(ctx, engine)
    with pytest.raises(EngineDiedError):
        worker.run()  # the engine dies at its fifth decode step
    samples = ctx.store.rows(partition=step_partition(0))
    assert sorted(samples.groups.tolist()) == [0, 0]
    again = ctx.store.claim("rollout", "prompt_ids", 2, timeout=1, allow_partial=True)
    assert again.groups.tolist() == [1], "the cut group's prompt is back; the finished one is acked"


def test_a_stopped_run_hands_its_groups_in_flight_back(model_dir: Path) -> None:
    """Their leases were renewed for as long as the process lived, the engine decoding on."""
    ctx = context("rollout.partial=continue", "rollout.max_tokens=16")
    engine = HFRolloutEngine(model_dir, ctx.config)
    put_prompts(ctx.store, target=0)
    worker = PartialRollout(ctx, engine)
    worker.step()  # admits the group
    assert engine.in_flight() > 0 and len(LEASES) == 1
    ctx.stop.set()
    worker.run()
    assert (worker.groups, engine.in_flight(), len(LEASES)) == ({}, 0, 0)
    again = ctx.store.claim("rollout", "prompt_ids", 1, timeout=1, allow_partial=True)
    assert len(again) == 1


def test_a_long_generation_is_progress_not_a_stall(model_dir: Path) -> None:
    ctx = context("rollout.partial=continue")
    worker = PartialRollout(ctx, HFRolloutEngine(model_dir, ctx.config))
    put_prompts(ctx.store, target=0)
    worker.step()  # admits the group
    worker._idle_since = 0.0  # as if no prompt had come since long ago
    worker.step()
    assert worker._idle_since is None


@pytest.mark.parametrize(("mode", "engines"), [("continue", 1), ("abort", 1), ("continue", 2)])
def test_the_main_job_runs_with_partial_rollout_and_reports_version_spans(
    tmp_path: Path, mode: str, engines: int
) -> None:
    config = cfg.load(
        None,
        [
            f"rollout.engines={engines}",
            "data.digits=1",
            "data.eval_size=20",
            "model.hidden_size=64",
            "model.intermediate_size=256",
            "warm_start.steps=20",
            "trainer.max_steps=3",
            "trainer.groups_per_step=4",
            "rollout.n=4",
            "rollout.engine=hf",
            "trainer.engine=hf",
            f"rollout.partial={mode}",
            "rollout.max_num_seqs=8",
        ],
    )
    summary = train(config, run_dir=tmp_path, reporter=Reporter(enabled=False))
    assert summary["partial_rollout"] == mode
    assert sum(summary["version_span_histogram"].values()) == summary["samples_generated"]
    assert 0 <= summary["multi_version_sample_share"] <= 1
    assert max(int(a) for a in summary["staleness_histogram"]) <= 1
    assert sum(summary["staleness_histogram"].values()) == 3 * 4 * 4
    # Each step's record counts the samples generated by then (rollout may go on after it).
    last = metrics(tmp_path)[-1]
    assert 0 < sum(last["version_spans"].values()) <= summary["samples_generated"]
    assert 0 <= last["multi_version_share"] <= 1


def test_a_group_whose_lease_ran_out_mid_generation_is_generated_once(model_dir: Path) -> None:
    ctx = context("rollout.partial=continue")
    worker = PartialRollout(ctx, HFRolloutEngine(model_dir, ctx.config))
    put_prompts(ctx.store, target=0)
    worker.step()  # admitted: two sequences in flight
    # The lease expires and the same prompt row is claimed again by this worker.
    (entry,) = worker.groups.values()
    assert entry.work.batch is not None
    entry.work.batch.release()
    worker.step()
    assert worker.engine.in_flight() <= 2
    run_until_samples(worker, 0, 2, {})
    assert len(ctx.store.rows(partition=step_partition(0))) == 2
    again = ctx.store.claim("rollout", "prompt_ids", 1, timeout=0.1, allow_partial=True)
    assert len(again) == 0, "its prompt is acked"


def test_the_dispatcher_keeps_a_claims_lease_until_its_last_group_completes() -> None:
    """A group routed to an engine's inbox may wait there, behind a full engine, past its
    lease's term: the dispatcher keeps the claim's lease from the claim until its last group
    completes (the store handed the prompt out again, and the group's ack failed, before)."""
    ctx = context("rollout.groups_per_call=2")
    put_prompts(ctx.store, target=0, groups=2)
    inbox = Inbox()
    dispatcher = Dispatcher(ctx, {"engine-0": inbox})
    before = len(LEASES)
    dispatcher.step()
    (first, second) = sorted(inbox.take(2, 0.0), key=lambda a: a.group)
    assert first.batch.lease == second.batch.lease
    assert len(LEASES) == before + 1, "the claim's lease is kept"
    dispatcher.complete([first.group])
    assert len(LEASES) == before + 1, "a group of the claim is still out"
    dispatcher.complete([second.group])
    assert len(LEASES) == before, "held no longer"
    # A hold still open when the run stops ends with the dispatcher's loop.
    ctx.store.put(
        {"prompt_ids": [np.array(PROMPT, np.int64)], "answer": [b"7"], "target_step": [1]},
        partition=PROMPTS,
        groups=[2],
        group_size=1,
    )
    dispatcher.step()
    assert len(LEASES) == before + 1
    ctx.stop.set()
    dispatcher.run()
    assert len(LEASES) == before


def test_a_group_in_flight_longer_than_its_lease_keeps_it(model_dir: Path) -> None:
    """The worker renews the leases of the groups it holds: one in flight past its lease's term
    (half a lease between two decode steps here) is acked once done, its prompt never handed
    out again meanwhile."""
    lease = 4.0  # a decode step would have to take 2 s more than its sleep for it to lapse
    store = af.Store(lease_timeout=lease)
    register_tasks(store, reference=False)
    # The engine is full with the group's 2 sequences, so this worker claims nothing meanwhile.
    config = settings(
        "rollout.partial=continue",
        "rollout.max_num_seqs=2",
        "rollout.max_tokens=6",
        f"store.lease_timeout={lease}",
    )
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState())
    ctx.weights = Watcher(store, 0.0)
    worker = PartialRollout(ctx, HFRolloutEngine(model_dir, config))
    put_prompts(store, target=0)
    worker.step()  # admitted: its lease starts
    admitted = time.monotonic()
    while not len(store.rows(partition=step_partition(0))):
        assert time.monotonic() - admitted < 120, "the samples never came"
        time.sleep(lease / 2)
        worker.step()
    assert time.monotonic() - admitted > lease, "the group was in flight past its first term"
    assert len(store.rows(partition=step_partition(0))) == 2
    again = store.claim("rollout", "prompt_ids", 1, timeout=0.1, allow_partial=True)
    assert len(again) == 0, "its prompt is acked"


def test_a_decode_step_longer_than_the_lease_keeps_it(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leases are kept while the worker is busy elsewhere: a decode step (or a weight load)
    that outlasts the lease does not hand the group's prompt out again."""
    lease = 3.0
    store = af.Store(lease_timeout=lease)
    register_tasks(store, reference=False)
    config = settings(
        "rollout.partial=continue", "rollout.max_tokens=6", f"store.lease_timeout={lease}"
    )
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState())
    ctx.weights = Watcher(store, 0.0)
    engine = HFRolloutEngine(model_dir, config)
    step = engine.step

    def slow_step() -> list[Request]:
        time.sleep(2 * lease)  # the lease would run out twice over during it
        return step()

    worker = PartialRollout(ctx, engine)
    put_prompts(store, target=0)
    worker.step()  # admitted: its lease starts
    monkeypatch.setattr(engine, "step", slow_step)
    worker.step()
    again = store.claim("rollout", "prompt_ids", 1, timeout=0.1, allow_partial=True)
    assert len(again) == 0, "its prompt was handed out again during the step"
    monkeypatch.setattr(engine, "step", step)
    run_until_samples(worker, 0, 2, {})
    assert len(store.rows(partition=step_partition(0))) == 2


def test_a_routed_engine_takes_only_the_groups_it_has_room_for(model_dir: Path) -> None:
    """With a router, as without: of the 3 groups routed to it (3 per call), the engine takes the
    2 whose sequences fit (4 slots, 2 sequences a group); the third stays for later or for
    another engine, its lease not running while it queues in this one."""
    ctx = context("rollout.partial=continue", "rollout.groups_per_call=3")
    put_prompts(ctx.store, target=0, groups=3)
    batch = ctx.store.claim("rollout", ["prompt_ids", "answer"], 3, timeout=1)
    cells = batch.read()
    routed = [
        Assignment(batch, int(i), int(g), cells["prompt_ids"][k], cells["answer"][k], 0, 4)
        for k, (i, g) in enumerate(zip(batch.indexes, batch.groups, strict=True))
    ]
    inbox = Inbox()
    dispatcher = Dispatcher(ctx, {"engine-0": inbox})
    inbox.put(routed)
    worker = PartialRollout(ctx, HFRolloutEngine(model_dir, ctx.config), "engine-0", dispatcher)
    worker.step()
    assert sorted(worker.groups) == [0, 1] and len(inbox) == 1
    assert worker.engine.in_flight() <= 4


def test_a_group_rerouted_while_in_flight_is_cut_from_the_silent_engine(model_dir: Path) -> None:
    """An engine silent past ``rollout.heartbeat_timeout`` (a long decode step, say) loses its
    groups to another engine; at its next step its worker cuts their sequences, which would
    otherwise go on taking its slots only to be discarded when they finish."""
    ctx = context("rollout.partial=continue", "rollout.groups_per_call=1")
    put_prompts(ctx.store, target=0, groups=2)
    inboxes = {"engine-0": Inbox(), "engine-1": Inbox()}
    dispatcher = Dispatcher(ctx, inboxes)
    now = time.monotonic()
    dispatcher.clock = lambda: now
    dispatcher.step()
    dispatcher.step()  # one group to each engine
    worker = PartialRollout(ctx, HFRolloutEngine(model_dir, ctx.config), "engine-0", dispatcher)
    worker.step()
    (mine,) = worker.groups
    assert worker.engine.in_flight() == 2
    now += ctx.config.rollout.heartbeat_timeout + 1  # engine-0 silent since; engine-1 reports
    dispatcher.report("engine-1")
    dispatcher.step()
    assert dispatcher.router.assigned_to(mine) == "engine-1"
    worker.step()
    assert worker.groups == {} and worker.engine.in_flight() == 0
    assert mine in [a.group for a in inboxes["engine-1"].take(2, 0.0)]


class _Remote:
    def remote(self) -> object:
        return object()


class _FakeActor:
    run = _Remote()
    report = _Remote()


def test_the_ray_supervisor_adds_each_actors_version_spans_once() -> None:
    from asyncflow.launch.ray_workers import Report, Supervisor

    ctx = context()
    supervisor = Supervisor(ctx, {"rollout-0": _FakeActor()})

    def report(life: str, spans: dict[int, int], failures: list[str]) -> Report:
        return Report(life, 0, 0, 0, [], 0.0, spans, failures)

    supervisor._count("rollout-0", report("a", {0: 4}, []), spans=False)
    supervisor._count("rollout-0", report("a", {0: 6, 1: 2}, ["v3 failed"]), spans=False)
    supervisor._count("rollout-0", report("b", {1: 1}, []), spans=False)  # restarted
    assert ctx.state.version_spans == {0: 6, 1: 3}
    assert ctx.state.weight_failures == ["v3 failed"]
    assert ctx.state.multi_version_share() == pytest.approx(3 / 9)


def test_the_ray_supervisor_adds_each_actors_agent_counters_over_its_lives() -> None:
    """Each report holds its life's counters so far: the run's are what each adds, a restarted
    actor counting from zero again; a counter at zero is kept, as a local run's summary has it."""
    from asyncflow.launch.ray_workers import Report, Supervisor

    supervisor = Supervisor(context(), {"rollout-0": _FakeActor()})

    def report(life: str, counts: dict[str, int]) -> Report:
        return Report(life, 0, 0, 0, [], 0.0, agent_counts=counts)

    supervisor._count("rollout-0", report("a", {"turns": 3, "tool_calls": 0}), spans=False)
    supervisor._count("rollout-0", report("a", {"turns": 5, "tool_calls": 1}), spans=False)
    supervisor._count("rollout-0", report("b", {"turns": 2, "error_bad_json": 0}), spans=False)
    assert agent_totals([supervisor]) == {"error_bad_json": 0, "tool_calls": 1, "turns": 7}
