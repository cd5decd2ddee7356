"""End to end: the main job with the hf engines on a small configuration.

One run is shared by the tests that only inspect its outputs, to keep the suite fast.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.checkpoint import made_whole
from asyncflow.daemon import DaemonProcess
from asyncflow.engines import register_rollout_engine
from asyncflow.engines.hf import HFRolloutEngine
from asyncflow.progress import Reporter
from asyncflow.scheduler import Rerouted, Router
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.train import train
from asyncflow.weight_sync import broadcast
from asyncflow.weight_sync.layout import Layout
from asyncflow.workers import routing
from asyncflow.workers.base import PROMPTS, SAMPLES, step_partition
from run_outputs import busy_spans, ledger, metrics, trained_groups

pytestmark = [pytest.mark.slow]

STEPS, GROUPS, N = 20, 16, 16
#: Small but real: 1-digit addition, where a short warm start leaves the model right about two
#: times in three and RL visibly raises that within seconds.
FAST = [
    "data.digits=1",
    "data.eval_size=20",  # of the 45 unordered 1-digit pairs, fewer than half may be held out
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "warm_start.steps=200",
    "warm_start.batch_size=128",
    f"trainer.max_steps={STEPS}",
    f"trainer.groups_per_step={GROUPS}",
    f"rollout.n={N}",
    "run.eval_every=10",
    "run.checkpoint_every=4",
    "rollout.engine=hf",
    "trainer.engine=hf",
]


#: The default job (2-digit addition, the default model and RL settings) with the hf engines,
#: cut down to what shows RL lifting held-out accuracy: a warm start of 450 steps (the default is
#: 600), then 4 RL steps. With the ChatML-framed prompts held-out accuracy went 0.425 -> 0.690
#: and 0.365 -> 0.665 on seeds 0 and 1; seed 2's short warm start failed (0.050 -> 0.085).
HELD_OUT = [
    "data.eval_size=200",
    "warm_start.steps=450",
    "trainer.max_steps=4",
    "rollout.engine=hf",
    "trainer.engine=hf",
]


def run(tmp: Path, *overrides: str) -> dict[str, Any]:
    config = cfg.load(None, [*FAST, *overrides])
    return train(config, run_dir=tmp, reporter=Reporter(enabled=False))


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("run")
    return directory, run(directory)


def test_the_run_directory_holds_every_output(finished: tuple[Path, dict[str, Any]]) -> None:
    run_dir, summary = finished
    for name in ["config.yaml", "metrics.jsonl", "summary.json", "summary.png", "trace.json"]:
        assert (run_dir / name).is_file(), name
    assert any((run_dir / "tensorboard").iterdir()), "TensorBoard event files"
    for key in [
        "accuracy_before",
        "accuracy_after",
        "engines",
        "logprob_max_abs_diff",
        "wall_seconds",
    ]:
        assert key in summary
    assert summary["engines"] == {"rollout": "hf", "trainer": "hf"}
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    busy = busy_spans(run_dir)
    assert {"generate", "put samples"} <= busy["rollout"], busy
    assert {"forward/backward", "optimizer step", "publish"} <= busy["trainer"], busy
    assert "verify" in busy["reward"] and "advantages" in busy["advantage"], busy
    assert cfg.load(run_dir / "config.yaml").trainer.max_steps == STEPS


def test_every_step_is_logged_with_its_metrics(finished: tuple[Path, dict[str, Any]]) -> None:
    records = metrics(finished[0])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ["reward_mean", "accuracy", "pg_loss", "staleness", "tokens_per_s", "busy"]:
        assert key in records[0], key
    assert set(records[-1]["busy"]) >= {"rollout", "trainer", "reward", "advantage"}
    # The trainer's publication of each new version, timed.
    assert all(r["publish_seconds"] > 0 for r in records), records


def test_reward_rises_during_rl(finished: tuple[Path, dict[str, Any]]) -> None:
    rewards = [r["reward_mean"] for r in metrics(finished[0])]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.05, rewards


def test_rl_raises_accuracy_on_held_out_problems(tmp_path: Path) -> None:
    # Held out by unordered pair: neither a held-out problem nor its commuted twin is trained on,
    # so a gain here is addition learnt, not answers remembered. The seed is fixed; the margin,
    # 10 of the 200 problems, is below the gain of every seed tried, so it also covers what the
    # order of asynchronous work changes from run to run.
    config = cfg.load(None, [*HELD_OUT, "run.seed=0"])
    summary = train(config, run_dir=tmp_path, reporter=Reporter(enabled=False))
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary


def test_the_final_model_loads_in_transformers(finished: tuple[Path, dict[str, Any]]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = finished[0] / "final"
    model = AutoModelForCausalLM.from_pretrained(str(final))
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    ids = torch.tensor([tokenizer.encode("12+34=", add_special_tokens=False)])
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


def test_rollout_and_trainer_log_probs_agree(finished: tuple[Path, dict[str, Any]]) -> None:
    assert finished[1]["logprob_max_abs_diff"] < 1e-3


def test_no_trained_sample_exceeds_the_staleness_bound(
    finished: tuple[Path, dict[str, Any]],
) -> None:
    summary = finished[1]
    ages = {int(a) for a in summary["staleness_histogram"]}
    assert ages and max(ages) <= summary["max_staleness"] == 1
    for record in metrics(finished[0]):
        assert all(int(a) <= 1 for a in record["staleness"])


def test_synchronous_training_is_the_same_pipeline_with_no_staleness(tmp_path: Path) -> None:
    summary = run(tmp_path, "trainer.max_staleness=0", "trainer.max_steps=3", "warm_start.steps=20")
    assert set(summary["staleness_histogram"]) == {"0"}
    assert summary["samples_dropped"] == 0


def test_deferred_evaluation_scores_each_steps_weights_after_rl(tmp_path: Path) -> None:
    summary = run(tmp_path, "trainer.max_steps=4", "run.eval_every=2", "run.eval_deferred=true")
    records = metrics(tmp_path)
    assert not any("eval_accuracy" in r for r in records)  # none during RL
    deferred = summary["deferred_evaluations"]
    assert [e["step"] for e in deferred] == [0, 2, 4]
    # The weights RL started from, at 0 s; each other copy was taken after its step was logged,
    # and before the next step's record.
    assert deferred[0]["time"] == 0.0
    assert records[1]["time"] <= deferred[1]["time"] <= records[2]["time"]
    assert records[3]["time"] <= deferred[2]["time"] <= summary["phase_seconds"]["rl"]
    # The first and last copies are the warm start and the final model: the evaluator scores
    # them as the evaluations before and after RL do.
    assert deferred[0]["eval_accuracy"] == summary["accuracy_before"]
    assert deferred[2]["eval_accuracy"] == summary["accuracy_after"]
    assert summary["phase_seconds"]["eval_deferred"] > 0


def test_the_drop_policy_discards_only_too_stale_samples(tmp_path: Path) -> None:
    summary = run(
        tmp_path,
        "trainer.max_staleness=0",
        "trainer.staleness_policy=drop",
        "trainer.max_steps=4",
        "warm_start.steps=20",
    )
    assert set(summary["staleness_histogram"]) <= {"0"}
    trained = sum(summary["staleness_histogram"].values())
    assert trained + summary["samples_dropped"] == 4 * GROUPS * N


class CountingEngine(HFRolloutEngine):
    calls = 0

    def generate(self, prompts, sampling):  # type: ignore[no-untyped-def]
        CountingEngine.calls += 1
        return super().generate(prompts, sampling)


def test_a_custom_engine_registered_by_name_is_used(tmp_path: Path) -> None:
    register_rollout_engine("counting", CountingEngine)
    summary = run(tmp_path, "rollout.engine=counting", "trainer.max_steps=2", "warm_start.steps=10")
    assert summary["engines"]["rollout"] == "counting"
    assert CountingEngine.calls > 0


def test_an_unknown_engine_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="unknown rollout engine"):
        run(tmp_path, "rollout.engine=nope", "warm_start.enabled=false")


#: The multi-turn tools job (examples/tools.yaml) on a small model, with the tool's answer
#: computed in process after a short delay.
TOOLS = [
    "--config",
    str(Path(__file__).resolve().parents[2] / "examples" / "tools.yaml"),
    "model.hidden_size=64",
    "model.intermediate_size=256",
    f"trainer.groups_per_step={GROUPS}",
    "rollout.n=4",
    "data.eval_size=8",
    "rollout.engine=hf",
    "trainer.engine=hf",
    "agent.latency.subprocess=false",
    "agent.latency.median=0.01",
]


def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(tmp_path: Path) -> None:
    """What its ledger said it trained before the kill is forgotten with the rest: each group is
    listed once, as in a run never killed."""
    config = cfg.load(None, [*FAST, "trainer.max_steps=2", "run.checkpoint_every=10"])
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    before_kill = [{"step": 0, "trained": [0, 1]}, {"step": 1, "trained": [2, 3]}]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in before_kill))
    logged = MetricsLog(tmp_path, loggers=["tensorboard"])
    logged.log({"step": 1, "reward_mean": -7.0})
    logged.close()
    logged.finish()
    train(config, resume=tmp_path, reporter=Reporter(enabled=False))
    assert [entry["step"] for entry in ledger(tmp_path)] == [0, 1]
    assert trained_groups(tmp_path) == list(range(2 * GROUPS))
    # TensorBoard shows each step once, as metrics.jsonl does (the killed run's step 1 too).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]
    assert -7.0 not in [e.value for e in events.Scalars("reward_mean")]


def test_a_resume_that_fails_to_load_its_checkpoint_keeps_the_runs_settings(
    tmp_path: Path,
) -> None:
    """Written before the checkpoint loaded, the failed resume's settings were taken for the
    run's by the next plain resume, which failed the same way."""
    config = cfg.load(None, [*FAST, "warm_start.steps=10"])
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    (tmp_path / "checkpoints" / "step-000004" / "trainer").mkdir(parents=True)  # no state in it
    with pytest.raises(FileNotFoundError):
        train(
            cfg.load(tmp_path / "config.yaml", ["trainer.lr=1e-5"]),
            resume=tmp_path,
            reporter=Reporter(enabled=False),
        )
    assert cfg.load(tmp_path / "config.yaml").trainer.lr == config.trainer.lr


def test_a_model_directory_is_made_whole_or_not_at_all(tmp_path: Path) -> None:
    """A run killed while it writes its built-in model or warm start (``config.json`` comes
    before the weights) left a directory every rerun took for a whole model."""

    def cut_short() -> None:
        with made_whole(tmp_path / "warm_start") as into:
            into.mkdir()
            (into / "config.json").write_text("{}")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cut_short()
    assert not (tmp_path / "warm_start").exists()
    with made_whole(tmp_path / "warm_start") as into:
        into.mkdir()
    assert (tmp_path / "warm_start").is_dir()
    assert not (tmp_path / "warm_start.tmp").exists()


@pytest.mark.parametrize("job", [FAST, TOOLS], ids=["addition", "tools"])
def test_a_killed_run_resumes_with_no_sample_lost_or_trained_twice(
    tmp_path: Path, job: list[str]
) -> None:
    run_dir = tmp_path / "killed"
    args = [
        *job,
        "trainer.max_steps=8",
        "run.checkpoint_every=2",
        "warm_start.steps=20",
        "run.progress=false",
    ]
    command = [sys.executable, "-m", "asyncflow.cli", "train", "--run-dir", str(run_dir), *args]
    log = tmp_path / "killed.log"  # a file, not a pipe: nobody reads while it runs
    with log.open("wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step-000004").is_dir():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run was killed before it finished"

    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncflow.cli",
            "train",
            "--resume",
            str(run_dir),
            "run.progress=true",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step-00000" in resumed.stderr
    assert [entry["step"] for entry in ledger(run_dir)] == list(range(8))
    # Every prompt group trained exactly once.
    assert trained_groups(run_dir) == list(range(8 * GROUPS))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 9)), "one record per step"
    if job is TOOLS:  # each step's trajectories: at least one model turn each
        assert all(r["agent_turns_mean"] >= 1 for r in metrics(run_dir))


def test_a_run_on_a_daemon_frees_what_a_killed_run_left_there_and_its_versions_as_it_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DaemonProcess() as daemon:
        store = daemon.connect()
        # What a run killed on this daemon leaves: prompts its dead rollout worker holds, the
        # samples of an unfinished step, its last weight versions (of another model: its tensor of
        # the same name is bfloat16 and of another shape) and their broadcast layouts.
        store.register_task("rollout", partitions=[PROMPTS])
        store.register_task("reference", partitions=[SAMPLES])  # a consumer this run lacks
        store.put({"left": [1, 2, 3]}, partition=PROMPTS)
        store.claim("rollout", "left", 3, timeout=1)  # leased, never acked
        store.put({"left": [4]}, partition=step_partition(7))
        for v in (49, 50):
            embed = torch.ones(4, 4, dtype=torch.bfloat16)
            weights.publish(store, v, [("model.embed_tokens.weight", embed)])
            broadcast.announce(store, Layout.of(v, [("w", embed)], 64))
        store.put({"mine": [5]}, partition="__mine__")  # a partition of someone else's
        with caplog.at_level(logging.WARNING, logger="asyncflow.launch.local"):
            summary = run(
                tmp_path,
                f"store.address={daemon.url}",
                "trainer.max_steps=2",
                "warm_start.steps=10",
            )
        assert (
            "freed 8 rows an earlier run left in the store at "
            f"{daemon.url} (__weight_layouts__, __weights__, prompts, step-7)"
        ) in caplog.text
        assert summary["steps"] == 2 and summary["weight_load_failures"] == []
        assert trained_groups(tmp_path) == list(range(2 * GROUPS))  # its own prompts, once
        # Every sample was freed (the absent consumer's acks too), the run's weight versions went
        # with it; the other partition stays.
        assert store.stats()["partitions"] == {"__mine__": 1}


def test_two_rollout_engines_share_the_prompt_groups_through_the_router(tmp_path: Path) -> None:
    summary = run(tmp_path, "rollout.engines=2", "trainer.max_steps=3", "warm_start.steps=10")
    busy = busy_spans(tmp_path)
    assert "router" in busy
    for engine in ("rollout-0", "rollout-1"):  # each generated samples and put them in
        assert {"generate", "put samples"} <= busy[engine], busy
    assert trained_groups(tmp_path) == list(range(3 * GROUPS))
    assert summary["samples_generated"] >= 3 * GROUPS * N


class WatchedRouter(Router):
    """The dispatcher's router, telling the test what it moved off silent engines."""

    moved: ClassVar[list[Rerouted]] = []
    rerouted = threading.Event()

    def expire(self, *, now: float | None = None) -> list[Rerouted]:
        moved = super().expire(now=now)
        WatchedRouter.moved += moved
        if moved:
            WatchedRouter.rerouted.set()
        return moved


class StallingEngine(HFRolloutEngine):
    """The first engine made falls silent on its first generation call for the rollout (not the
    evaluation before RL, which runs on the main thread) until the router has moved work off it;
    it then answers, late."""

    made = 0
    stalled: ClassVar[list[str]] = []

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        StallingEngine.made += 1
        self.stalls = StallingEngine.made == 1

    def generate(self, prompts, sampling):  # type: ignore[no-untyped-def]
        if self.stalls and threading.current_thread() is not threading.main_thread():
            self.stalls = False
            StallingEngine.stalled.append(self.label)
            WatchedRouter.rerouted.wait(timeout=300)
        return super().generate(prompts, sampling)


def test_a_silent_rollout_engine_loses_its_prompt_groups_to_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    StallingEngine.made, StallingEngine.stalled, WatchedRouter.moved = 0, [], []
    WatchedRouter.rerouted.clear()
    register_rollout_engine("stalling", StallingEngine)
    monkeypatch.setattr(routing, "Router", WatchedRouter)
    summary = run(
        tmp_path,
        "rollout.engine=stalling",
        "rollout.engines=2",
        # The silent engine stays silent until it has lost its groups, however long that takes;
        # the other has 5 s for each call before it would count as silent too.
        "rollout.heartbeat_timeout=5",
        "trainer.max_steps=2",
        "warm_start.steps=10",
    )
    assert StallingEngine.stalled == ["rollout-0"]
    moved = WatchedRouter.moved
    assert moved and all((m.source, m.to) == ("rollout-0", "rollout-1") for m in moved), moved
    assert summary["groups_rerouted"] == len(moved)
    assert trained_groups(tmp_path) == list(range(2 * GROUPS))
    assert summary["steps"] == 2
