"""The pipeline, sim and e2e benchmark suites run (``--quick``) and report in the shared record
schema, with their table and figure beside the JSON. Their figures are not checked: benchmarks
are not tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow import cli
from asyncflow.algorithms.lr_schedule import lr_factor
from asyncflow.bench import costs, e2e_suite, pipeline_suite, run_suite
from asyncflow.bench import records as records_mod
from asyncflow.bench.emulation.modes import MODES
from asyncflow.bench.records import Report
from asyncflow.bench.trl_peer import grpo_config, scheduler_settings
from asyncflow.config import TrainerConfig, load
from asyncflow.engines.base import ADAM_BETAS
from sigterm import assert_sigterm_runs_cleanup

KEYS = {"suite", "case", "metric", "value", "unit", "baseline", "baseline_value", "ratio"}


def records(
    tmp_path: Path, suite: str, cases: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    out = tmp_path / f"{suite}.json"
    assert run_suite(suite, json_path=str(out), quick=True, cases=cases) == 0
    table = [line for line in out.with_suffix(".md").read_text().splitlines() if line[:2] == "| "]
    assert len(table) == len(json.loads(out.read_text())) + 1  # a header, then one row each
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    assert all(set(r) == KEYS and r["suite"] == suite for r in rows)
    for r in rows:
        if r["baseline_value"]:
            assert r["ratio"] == pytest.approx(r["value"] / r["baseline_value"])
        elif r["baseline_value"] == 0:
            assert r["ratio"] is None, "no ratio against a zero baseline"
    return rows


def metric(rows: list[dict[str, Any]], case: str, name: str, baseline: str | None = None) -> Any:
    return next(
        r for r in rows if r["case"] == case and r["metric"] == name and r["baseline"] == baseline
    )


@pytest.mark.slow
def test_the_pipeline_suite_compares_every_mode_with_the_colocated_baseline(
    tmp_path: Path,
) -> None:
    rows = records(tmp_path, "pipeline")
    assert [r["case"] for r in rows if r["metric"] == "step_time"] == list(MODES)
    for case in MODES:
        assert metric(rows, case, "samples_per_s", "colocated-sync")["value"] > 0
        assert metric(rows, case, "samples_per_s", "ideal")["baseline_value"] > 0
        for role in ("rollout", "reference", "trainer", "reward", "bottleneck"):
            assert 0 <= metric(rows, case, f"busy_{role}")["value"] <= 1.05
        # The asynchronous modes may have generated a quick run's one measured step during its
        # warm-up: no decoding in the window, then no fill either.
        fill = metric(rows, case, "decode_fill")["value"]
        assert 0 <= fill <= 1
        assert (fill > 0) == (metric(rows, case, "busy_rollout")["value"] > 0)
        assert metric(rows, case, "overhead_per_sample")["unit"] == "ms"
        # Every mode decodes on emulated devices, whose serving threads' CPU is counted apart,
        # as is that of the workers' calls into the emulated engines, part of it.
        emulator = metric(rows, case, "emulator_per_sample")["value"]
        assert 0 < metric(rows, case, "emulated_calls_per_sample")["value"] < emulator
    assert metric(rows, "colocated-sync", "samples_per_s", "colocated-sync")["ratio"] == 1
    assert metric(rows, "colocated-sync", "decode_fill")["value"] > 0
    assert metric(rows, "async-1", "staleness_mean")["value"] <= 1


def test_the_sim_suite_reports_scaling_from_the_smallest_cluster(tmp_path: Path) -> None:
    rows = records(tmp_path, "sim")
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert cases == ["32", "64", "128"]
    assert metric(rows, "32", "scaling_efficiency")["value"] == 1
    for case in cases:
        assert metric(rows, case, "samples_per_s", "colocated-sync")["value"] > 0
        assert metric(rows, case, "index_us_per_sample")["value"] > 0


@pytest.mark.slow
def test_the_e2e_suite_times_the_main_job_at_each_staleness(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each run wrote, read as the suite reads it (the runs live in a directory it removes).
    runs: dict[int, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    read_result = e2e_suite.result

    def keep_run(run_dir: Path, seed: int, staleness: int, target: float) -> Any:
        runs[staleness] = e2e_suite.read_run(run_dir)
        return read_result(run_dir, seed, staleness, target)

    monkeypatch.setattr(e2e_suite, "result", keep_run)
    rows = records(tmp_path, "e2e", cases=("staleness",))
    assert {r["case"] for r in rows} == {f"staleness-{k}" for k in e2e_suite.STALENESS}
    assert sorted(runs) == [0, 1, 2]
    quick = e2e_suite.QUICK
    for k, (summary, history) in runs.items():
        case = f"staleness-{k}"
        # Each case is a run of the main job at its staleness, with the quick settings.
        assert summary["max_staleness"] == k and summary["steps"] == quick.steps
        assert {int(age) for age in summary["staleness_histogram"]} <= set(range(k + 1))
        # Evaluated after RL, each step's weights, at the RL seconds they were copied.
        assert not any("eval_accuracy" in r for r in history)
        evaluations = summary["deferred_evaluations"]
        assert [e["step"] for e in evaluations] == list(range(quick.steps + 1))
        # Its figures are that run's (a quick run has one seed).
        rl = summary["phase_seconds"]["rl"]
        assert metric(rows, case, "rl_seconds", "staleness-0")["value"] == rl
        for name, key in (
            ("initial_accuracy", "accuracy_before"),
            ("final_accuracy", "accuracy_after"),
        ):
            assert metric(rows, case, name, "staleness-0")["value"] == summary[key]
            low, high = metric(rows, case, f"{name}_min"), metric(rows, case, f"{name}_max")
            assert low["value"] == high["value"] == summary[key]
        assert metric(rows, case, "tokens_per_s", "staleness-0")["value"] == pytest.approx(
            summary["tokens_generated"] / rl
        )
        # The quick target (accuracy 0) is met by the weights RL starts from: at 0 s.
        assert metric(rows, case, "reached_target")["value"] == 1
        time_to_target = metric(rows, case, "time_to_target_s", "staleness-0")["value"]
        assert time_to_target == evaluations[0]["time"] == 0
        assert 0 < evaluations[1]["time"] < rl
    # The three runs start from one warm-started model: only the first run warms one up.
    first, *later = runs  # in the order they ran
    assert "warm_start" in runs[first][0]["phase_seconds"]
    assert not any("warm_start" in runs[k][0]["phase_seconds"] for k in later)


@pytest.mark.slow
def test_the_e2e_suite_runs_trl_on_the_jobs_work_beside_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each run wrote, read as the suite reads it (the runs live in a directory it removes).
    runs: dict[str, dict[str, Any]] = {}
    histories: dict[str, list[dict[str, Any]]] = {}
    read_result = e2e_suite._peer_result

    def keep_run(run_dir: Path, seed: int, case: str) -> Any:
        runs[case] = json.loads((run_dir / "summary.json").read_text())
        if case != "trl":
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            histories[case] = [json.loads(line) for line in lines]
        return read_result(run_dir, seed, case)

    monkeypatch.setattr(e2e_suite, "_peer_result", keep_run)
    rows = records(tmp_path, "e2e", cases=("peers",))
    assert {r["case"] for r in rows} == set(e2e_suite.PEERS)
    steps = e2e_suite.QUICK.steps
    job, sync, hf, thread, trl = (runs[case] for case in e2e_suite.PEERS)
    assert hf["engines"] == {"rollout": "hf", "trainer": "hf"}
    assert job["max_staleness"] == 1 and sync["max_staleness"] == 0
    assert thread["engines"] == job["engines"] and thread["max_staleness"] == 1
    # Beside vLLM the trainer's rank has a process, and so a start, of its own by default.
    assert job["engines"]["rollout"] == "vllm" and "trainer_start" in job["phase_seconds"]
    assert "trainer_start" not in thread["phase_seconds"]
    assert job["steps"] == sync["steps"] == hf["steps"] == thread["steps"] == trl["steps"] == steps
    # TRL took one optimizer step per job step, each on a step's worth of completions.
    assert len(trl["train_loss"]) == len(trl["reward"]) == steps
    assert trl["tokens_generated"] >= steps * 4 * 16  # quick: 4 groups of 16, >= 1 token each
    for case, summary in zip(e2e_suite.PEERS, (job, sync, hf, thread, trl), strict=True):
        assert metric(rows, case, "final_accuracy", "trl")["value"] == summary["accuracy_after"]
        assert (
            metric(rows, case, "final_accuracy", "trl")["baseline_value"] == (trl["accuracy_after"])
        )
    # The job's RL seconds leave out its one evaluation, of the final model.
    evaluations = [r for r in histories["asyncflow"] if "eval_accuracy" in r]
    assert [r["step"] for r in evaluations] == [steps]
    phases = job["phase_seconds"]
    assert metric(rows, "asyncflow", "rl_seconds", "trl")["value"] == pytest.approx(
        phases["rl"] - evaluations[0]["eval_seconds"]
    )
    # Start: the engines, the first evaluation, and what is left of the trainer rank's own
    # process starting once they are done.
    assert metric(rows, "asyncflow", "start_seconds", "trl")["value"] == pytest.approx(
        phases["engine_start"] + phases["eval_before"] + phases["trainer_start"]
    )
    assert metric(rows, "trl", "rl_seconds", "trl")["value"] == trl["phase_seconds"]["rl"]
    # Both start from one warm-started model.
    assert metric(rows, "trl", "initial_accuracy")["value"] == job["accuracy_before"]
    # TRL, one process, computes on every core, as torch does by default (it inherited the
    # one thread per process that the command sets for the job's workers).
    default = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=e2e_suite.peer_environment(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert trl["torch_threads"] == int(default.stdout) > (1 if (os.cpu_count() or 1) > 1 else 0)


def test_a_peer_runs_without_the_one_thread_the_command_sets_for_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for var in cli.ONE_THREAD:
        monkeypatch.delenv(var, raising=False)
    cli._one_thread_per_worker()
    assert all(os.environ[var] == "1" for var in cli.ONE_THREAD)
    assert not set(cli.ONE_THREAD) & set(e2e_suite.peer_environment())


@pytest.mark.slow
def test_the_e2e_suite_runs_the_long_tail_job_in_each_partial_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    read_result = e2e_suite._partial_result

    def keep_run(run_dir: Path, seed: int, mode: str) -> Any:
        runs[mode] = e2e_suite.read_run(run_dir)
        return read_result(run_dir, seed, mode)

    monkeypatch.setattr(e2e_suite, "_partial_result", keep_run)
    rows = records(tmp_path, "e2e", cases=("partial",))
    assert {r["case"] for r in rows} == {f"partial-{m}" for m in e2e_suite.PARTIAL}
    assert list(runs) == list(e2e_suite.PARTIAL)  # seed 0 runs off first
    steps = e2e_suite.QUICK.steps
    for mode, (summary, history) in runs.items():
        case = f"partial-{mode}"
        assert summary["partial_rollout"] == mode and summary["max_staleness"] == 1
        assert summary["steps"] == steps
        # The final model only is evaluated, and every step trained its 4 groups of 16.
        assert [r["step"] for r in history if "eval_accuracy" in r] == [steps]
        assert sum(sum(r["staleness"].values()) for r in history if "staleness" in r) == (
            steps * 4 * 16
        )
        rl = summary["phase_seconds"]["rl"] - sum(r.get("eval_seconds", 0.0) for r in history)
        assert metric(rows, case, "samples_per_s", "partial-off")["value"] == pytest.approx(
            steps * 4 * 16 / rl
        )
        busy = metric(rows, case, "rollout_busy", "partial-off")["value"]
        assert busy == summary["busy_fraction"]["rollout"]
        accuracy = metric(rows, case, "final_accuracy", "partial-off")["value"]
        assert accuracy == summary["accuracy_after"]
    # Off, no sample spans two versions; all three start from the one warm start.
    assert runs["off"][0]["multi_version_sample_share"] == 0
    assert metric(rows, "partial-off", "multi_version_share", "partial-off")["value"] == 0
    assert "warm_start" in runs["off"][0]["phase_seconds"]
    assert not any("warm_start" in runs[m][0]["phase_seconds"] for m in ("continue", "abort"))
    assert len({runs[m][0]["accuracy_before"] for m in runs}) == 1


@pytest.mark.slow
def test_the_e2e_suite_runs_the_tools_job_at_each_staleness_and_trl_from_one_warm_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    read_result = e2e_suite._tools_result

    def keep_run(run_dir: Path, seed: int, case: str) -> Any:
        summary = json.loads((run_dir / "summary.json").read_text())
        history = e2e_suite.read_run(run_dir)[1] if case != "tools-trl" else []
        runs[case] = (summary, history)
        return read_result(run_dir, seed, case)

    monkeypatch.setattr(e2e_suite, "_tools_result", keep_run)
    rows = records(tmp_path, "e2e", cases=("tools",))
    assert {r["case"] for r in rows} == set(e2e_suite.TOOLS_CASES)
    # Seed 0: sync first (it warms up), then TRL on its warm start, then staleness 1 and 2.
    assert list(runs) == [
        "tools-staleness-0",
        "tools-trl",
        "tools-staleness-1",
        "tools-staleness-2",
    ]
    steps = e2e_suite.TOOLS_QUICK.steps
    sync_last = runs["tools-staleness-0"][0]["deferred_evaluations"][-1]["eval_accuracy"]
    for case, (summary, history) in runs.items():
        assert summary["steps"] == steps
        if case != "tools-trl":
            assert summary["max_staleness"] == e2e_suite.TOOLS_JOBS[case]
            assert summary["agent"]["trajectories"] > 0  # multi-turn rollouts, through the tools
            assert not any("eval_accuracy" in r for r in history)  # no evaluation during RL
        # The starting weights (at 0 s) and every step's, scored after RL, at the RL seconds
        # they were taken.
        curve = summary["deferred_evaluations"]
        assert [e["step"] for e in curve] == list(range(steps + 1))
        times = [e["time"] for e in curve]
        assert 0 == times[0] < times[1] < times[2] <= summary["phase_seconds"]["rl"]
        reached = metric(rows, case, "reached_sync_final")["value"]
        spent = metric(rows, case, "time_to_sync_final_s", "tools-staleness-0")["value"]
        got_there = [e for e in curve if e["eval_accuracy"] >= sync_last - e2e_suite.TOLERANCE]
        if got_there:
            assert (reached, spent) == (1, got_there[0]["time"])
        else:
            assert (reached, spent) == (0, summary["phase_seconds"]["rl"])
        rl = metric(rows, case, "rl_seconds", "tools-staleness-0")["value"]
        assert rl == summary["phase_seconds"]["rl"]
        final = metric(rows, case, "final_accuracy", "tools-staleness-0")["value"]
        assert final == summary["accuracy_after"]
    trl, _ = runs["tools-trl"]
    assert trl["tools"] == ["calculator"] and len(trl["train_loss"]) == steps
    assert "warm_start" in runs["tools-staleness-0"][0]["phase_seconds"]
    later = ("tools-staleness-1", "tools-staleness-2")
    assert not any("warm_start" in runs[c][0]["phase_seconds"] for c in later)
    before = {runs[c][0]["accuracy_before"] for c in e2e_suite.TOOLS_JOBS}
    assert len(before) == 1
    assert metric(rows, "tools-trl", "initial_accuracy", "tools-staleness-0")["value"] in before


def test_trl_is_given_the_jobs_work_and_optimiser_settings(tmp_path: Path) -> None:
    c = load(None, [])
    args = grpo_config(c, tmp_path, tools=False)
    assert args.max_steps == c.trainer.max_steps and args.num_generations == c.rollout.n
    assert args.per_device_train_batch_size == c.trainer.groups_per_step * c.rollout.n
    assert args.gradient_accumulation_steps == 1
    assert args.max_completion_length == c.rollout.max_tokens
    assert args.temperature == c.rollout.temperature
    assert (args.adam_beta1, args.adam_beta2) == ADAM_BETAS  # not TRL's default 0.999
    assert args.learning_rate == c.trainer.lr and args.weight_decay == c.trainer.weight_decay
    assert args.max_grad_norm == c.trainer.grad_clip and args.epsilon == c.trainer.clip_eps
    assert args.beta == c.trainer.kl_coef and args.num_iterations == c.trainer.ppo_epochs


def test_trl_trains_in_one_process_whatever_rank_variables_a_group_left_behind(
    tmp_path: Path,
) -> None:
    # DeepSpeed's group of one leaves these in its process; seeing them, accelerate would make
    # a process group of its own, listening on every address of the machine.
    build = (
        "import sys, torch; from pathlib import Path;"
        "from asyncflow.bench.trl_peer import grpo_config; from asyncflow.config import load;"
        "grpo_config(load(None, []), Path(sys.argv[1]), tools=False);"
        "print(torch.distributed.is_initialized())"
    )
    left = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env = {**os.environ, **left, "MASTER_PORT": "29500"}
    out = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


@pytest.mark.parametrize(
    "schedule", [{"lr_schedule": "cosine"}, {"lr_schedule": "constant", "warmup_steps": 3}]
)
def test_trl_gets_the_jobs_learning_rate_at_every_step_after_the_warm_up(
    schedule: dict[str, Any],
) -> None:
    from transformers import get_scheduler

    t = TrainerConfig(max_steps=20, **schedule)
    settings = scheduler_settings(t)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    trl_schedule = get_scheduler(
        settings["lr_scheduler_type"],
        optimizer,
        num_warmup_steps=settings["warmup_steps"],
        num_training_steps=t.max_steps,
        scheduler_specific_kwargs=settings.get("lr_scheduler_kwargs"),
    )
    theirs = []
    for _ in range(t.max_steps):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        trl_schedule.step()
    ours = [lr_factor(t)(step) for step in range(t.max_steps)]
    assert theirs[t.warmup_steps :] == pytest.approx(ours[t.warmup_steps :])


def test_a_pipeline_mode_fails_as_soon_as_one_of_its_processes_fails(tmp_path: Path) -> None:
    """Not after the trainer, waiting for that process's samples, has stalled."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs = {
        "train": subprocess.Popen(sleeper, text=True),
        "rollout": subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True),
    }
    try:
        # Named with its exit status: a process killed by a signal prints nothing to point at.
        with pytest.raises(RuntimeError, match=r"streaming: processes failed .*\{'rollout': 3\}"):
            pipeline_suite._follow(
                procs,
                "train",
                tmp_path / "metrics.jsonl",
                MODES["streaming"],
                costs.load(None),
                Report("pipeline"),
            )
        assert procs["train"].poll() is None, "the trainer had not finished"
    finally:
        procs["train"].kill()
        procs["train"].wait()


def test_sigterm_stops_a_bench_suite_through_its_cleanup() -> None:
    """A suite killed with SIGTERM stops the daemons and worker processes it started (its
    cleanup runs, exit status 143), instead of dying at once and leaving them running."""
    script = (
        "import sys, time\n"
        "from asyncflow import bench, cli\n"
        "def suite(*args, **kwargs):\n"
        "    try:\n"
        "        print('ready', flush=True)\n"
        "        while True: time.sleep(0.1)\n"
        "    finally:\n"
        "        print('cleaned up', flush=True)\n"
        "bench.run_suite = suite\n"
        "sys.exit(cli.main(['bench', 'sched']))\n"
    )
    assert_sigterm_runs_cleanup(script)


def test_a_suites_report_names_the_commit_it_measured() -> None:
    # Reports said the date and machine but not the code: two published runs named the wrong one.
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], check=False).returncode != 0
    assert records_mod.commit() == head + ("-dirty" if dirty else "")


def test_rl_seconds_leave_out_the_evaluations_the_trainer_waited_for(tmp_path: Path) -> None:
    """Every suite that reads a job's RL seconds (e2e peers and partial modes, the algorithms
    script) subtracts the evaluations run inside RL, and only those."""
    (tmp_path / "summary.json").write_text(json.dumps({"phase_seconds": {"rl": 10.0}}))
    records = [{"step": 1}, {"step": 2, "eval_seconds": 1.5}, {"step": 4, "eval_seconds": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert e2e_suite.rl_seconds(*e2e_suite.read_run(tmp_path)) == pytest.approx(8.25)
