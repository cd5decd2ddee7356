"""The ``e2e`` suite: the real main job, ``asyncflow train``, on this machine, with whatever
engines its defaults resolve to, at staleness 0, 1 and 2 over three seeds.

Each seed warms its model up once; the three staleness runs of that seed start from the same
warm-started model (copied into their run directories), so they differ only in staleness. Runs
alternate their order from seed to seed, so that a drift in the machine's load falls on every
staleness alike. Per staleness (case ``staleness-<k>``), averaged over seeds:

- ``time_to_target_s``: RL seconds until held-out accuracy first reaches the target, evaluation
  time excluded (the trainer waits for it). A run that never reaches it counts its whole RL time
  and lowers ``reached_target``.
- ``initial_accuracy`` and ``final_accuracy``: held-out accuracy before and after RL (each with
  ``_min`` / ``_max`` over seeds), ``tokens_per_s``
  (generated tokens per RL second, evaluation excluded), ``rl_seconds``.

Ratios are against staleness 0 measured in the same run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from asyncflow.bench.records import Report

STALENESS = (0, 1, 2)
SEEDS = (0, 1, 2)
#: What a run keeps from its seed's first run: the built model and its warm start.
SHARED = ("model-init", "warm_start")


@dataclass(frozen=True)
class Settings:
    """The job's settings: the defaults, except these."""

    steps: int
    eval_every: int
    eval_size: int
    #: Held-out accuracy the time-to-target clock stops at.
    target: float

    def overrides(self, seed: int, staleness: int) -> list[str]:
        return [
            f"run.seed={seed}",
            f"trainer.max_staleness={staleness}",
            f"trainer.max_steps={self.steps}",
            f"run.eval_every={self.eval_every}",
            f"run.checkpoint_every={self.steps + 1}",
            f"data.eval_size={self.eval_size}",
            "run.progress=false",
        ]


#: The default job's 30 steps; it reaches 0.93 held-out accuracy (from about 0.35 after the
#: warm start) in roughly 12 of them.
FULL = Settings(steps=30, eval_every=2, eval_size=500, target=0.93)
QUICK = Settings(steps=2, eval_every=1, eval_size=50, target=0.0)


@dataclass(frozen=True)
class RunResult:
    seed: int
    staleness: int
    time_to_target: float
    reached: bool
    initial_accuracy: float
    final_accuracy: float
    tokens_per_s: float
    rl_seconds: float
    engines: dict[str, str]


def train(run_dir: Path, overrides: list[str], quick: bool) -> None:
    command = [sys.executable, "-m", "asyncflow.cli", "train", "--run-dir", str(run_dir)]
    if quick:
        overrides = [*overrides, "warm_start.steps=20", "trainer.groups_per_step=4"]
    subprocess.run([*command, *overrides], check=True, stdout=subprocess.DEVNULL)


def result(run_dir: Path, seed: int, staleness: int, target: float) -> RunResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = float(summary["phase_seconds"]["rl"])
    evaluating, reached_at = 0.0, None
    for record in history:
        if "eval_accuracy" not in record:
            continue
        if record["eval_accuracy"] >= target:
            reached_at = record["time"] - evaluating
            break
        evaluating += record["eval_seconds"]
    total_eval = sum(r.get("eval_seconds", 0.0) for r in history)
    return RunResult(
        seed=seed,
        staleness=staleness,
        time_to_target=reached_at if reached_at is not None else rl - total_eval,
        reached=reached_at is not None,
        initial_accuracy=float(summary["accuracy_before"]),
        final_accuracy=float(summary["accuracy_after"]),
        tokens_per_s=summary["tokens_generated"] / (rl - total_eval),
        rl_seconds=rl,
        engines=summary["engines"],
    )


def run_all(workdir: Path, settings: Settings, report: Report, quick: bool) -> list[RunResult]:
    results = []
    seeds = SEEDS[:1] if quick else SEEDS
    for i, seed in enumerate(seeds):
        order = STALENESS[i % 3 :] + STALENESS[: i % 3]
        first: Path | None = None
        for k in order:
            run_dir = workdir / f"seed-{seed}" / f"staleness-{k}"
            if first is not None:
                for name in SHARED:
                    shutil.copytree(first / name, run_dir / name)
            started = time.monotonic()
            train(run_dir, settings.overrides(seed, k), quick)
            first = first or run_dir
            r = result(run_dir, seed, k, settings.target)
            report.progress(
                f"seed {seed} staleness {k}: {time.monotonic() - started:.0f}s, RL "
                f"{r.rl_seconds:.0f}s, target {'at ' if r.reached else 'not reached, '}"
                f"{r.time_to_target:.0f}s, accuracy {r.initial_accuracy:.3f} -> "
                f"{r.final_accuracy:.3f}, "
                f"{r.tokens_per_s:.0f} tokens/s, engines {r.engines}"
            )
            results.append(r)
    return results


def run(report: Report, quick: bool = False, costs_path: str | None = None) -> None:
    settings = QUICK if quick else FULL
    report.note(
        f"asyncflow train with its defaults except: {settings.steps} steps, evaluation every "
        f"{settings.eval_every} steps on {settings.eval_size} held-out problems; target "
        f"accuracy {settings.target}"
    )
    with tempfile.TemporaryDirectory(prefix="asyncflow-e2e-") as tmp:
        results = run_all(Path(tmp), settings, report, quick)
    by_k: dict[int, list[RunResult]] = {
        k: [r for r in results if r.staleness == k] for k in STALENESS
    }
    base = by_k[0]
    for k, runs in by_k.items():
        _add(report, f"staleness-{k}", runs, base)


def _add(report: Report, case: str, runs: list[RunResult], base: list[RunResult]) -> None:
    def avg(rs: list[RunResult], field: str) -> float:
        return mean(float(getattr(r, field)) for r in rs)

    sync = "staleness-0"
    for metric, field, unit in [
        ("time_to_target_s", "time_to_target", "s"),
        ("rl_seconds", "rl_seconds", "s"),
        ("tokens_per_s", "tokens_per_s", "tokens/s"),
        ("initial_accuracy", "initial_accuracy", "fraction"),
        ("final_accuracy", "final_accuracy", "fraction"),
    ]:
        report.add(case, metric, avg(runs, field), unit, sync, avg(base, field))
    for field in ("initial_accuracy", "final_accuracy"):
        values = [float(getattr(r, field)) for r in runs]
        report.add(case, f"{field}_min", min(values), "fraction")
        report.add(case, f"{field}_max", max(values), "fraction")
    report.add(case, "reached_target", avg(runs, "reached"), "fraction")
