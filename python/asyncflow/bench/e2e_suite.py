"""The ``e2e`` suite: the real main job, ``asyncflow train``, on this machine, with whatever
engines its defaults resolve to, at staleness 0, 1 and 2 over three seeds (cases ``staleness``);
and the same job against a peer, TRL's ``GRPOTrainer``, given the same work (cases ``peers``).

Each seed warms its model up once; the three staleness runs of that seed start from the same
warm-started model (copied into their run directories), so they differ only in staleness. Runs
alternate their order from seed to seed, so that a drift in the machine's load falls on every
staleness alike. Per staleness (case ``staleness-<k>``), averaged over seeds:

- ``time_to_target_s``: RL seconds until held-out accuracy first reaches the target. The runs
  evaluate after RL (``run.eval_deferred``: a copy of the weights is kept at each evaluation
  step and scored afterwards), so no evaluation is in RL time, and none lets the rollout run on
  while the trainer waits. A run that never reaches the target counts its whole RL time and
  lowers ``reached_target``.
- ``initial_accuracy`` and ``final_accuracy``: held-out accuracy before and after RL (each with
  ``_min`` / ``_max`` over seeds), ``tokens_per_s`` (generated tokens per RL second),
  ``rl_seconds``.

Ratios are against staleness 0 measured in the same run.

The ``peers`` cases start, per seed, from the same warm-started model too: the job with its
default engines (``asyncflow``, staleness 1), the same synchronous (``asyncflow-sync``,
staleness 0: on-policy, as TRL is), the job with the hf engines (``asyncflow-hf``), the job
with its default engines and its trainer in a thread of the job's process rather than a process
of its own (``asyncflow-thread``: ``trainer.own_process: false``), and TRL
(``trl``, see :mod:`asyncflow.bench.trl_peer`), each for the same steps of the same prompts, in
an order that rotates from seed to seed. Only the final model is evaluated (no evaluation
during RL, so none overlaps it). Per case: ``rl_seconds`` (the job: its RL phase less that final
evaluation; TRL: ``train()``), ``start_seconds`` (the job: engine start and the first held-out
evaluation; TRL: building its trainer, model load included), ``final_accuracy`` (with
``_min``/``_max``: greedy on the held-out problems, judged by the job's reward; the job's runs
with their own rollout engine, TRL's model with the default job's), ``tokens_per_s``
(generated tokens per RL second). Ratios are against TRL in the same run.

The ``partial`` cases run the job at staleness 1 on the built-in task's long-tail variant
(``addition-longtail``, as ``examples/longtail.yaml``: responses of 23 to 65 tokens) with each
``rollout.partial`` mode, ``off`` first, from one warm start per seed, in an order that rotates
from seed to seed, evaluating the final model only. Per mode (case ``partial-<mode>``):
``samples_per_s`` (samples trained per RL second, the final evaluation excluded), ``rl_seconds``,
``tokens_per_s``, the rollout's and the trainer's busy fractions over RL, the share of samples
whose tokens span more than one policy version, and held-out accuracy before and after (with
``_min``/``_max``). Ratios are against ``off`` in the same run.

The ``tools`` cases (``asyncflow bench e2e --task tools``; not among the defaults) run the
multi-turn tools job (``multiply-tools`` with a calculator that answers after a real sandboxed
process and a lognormal delay, as ``examples/tools.yaml``) at staleness 0, 1 and 2 from one warm
start per seed, and TRL's ``GRPOTrainer`` with its own tool support on the same work (second, as
in ``peers``). Each keeps a copy of its weights every 5 of its 40 steps and scores them after RL
(``run.eval_deferred``: no evaluation runs during RL, in the job or in TRL). Per case
(``tools-staleness-<k>``, ``tools-trl``): ``rl_seconds``, ``tokens_per_s``, held-out accuracy
before and after (``_min``/``_max``), and the RL seconds until held-out accuracy first comes
within 2 points of the seed's synchronous run's last evaluation (``time_to_sync_final_s``,
against the synchronous run's whole ``rl_seconds``) and of TRL's (``time_to_trl_final_s``,
against TRL's ``rl_seconds``), with the share of seeds that got there (``reached_sync_final``,
``reached_trl_final``; a run that never does counts its whole RL time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from asyncflow.bench import ArgumentError
from asyncflow.bench.records import Report
from asyncflow.cli import ONE_THREAD

STALENESS = (0, 1, 2)
SEEDS = (0, 1, 2)
CASES = ("staleness", "peers", "partial", "tools")
#: What runs when no cases are named (``tools``, hours long, runs when asked for).
DEFAULT_CASES = ("staleness", "peers", "partial")
#: The peers' cases, and the job's overrides for its own two.
PEERS: dict[str, list[str]] = {
    "asyncflow": [],
    "asyncflow-sync": ["trainer.max_staleness=0"],
    "asyncflow-hf": ["rollout.engine=hf", "trainer.engine=hf"],
    "asyncflow-thread": ["trainer.own_process=false"],
    "trl": [],
}
JOBS = [case for case in PEERS if case != "trl"]
PARTIAL = ("off", "continue", "abort")
#: The long-tail job, as examples/longtail.yaml sets it (a test holds the two together).
LONGTAIL = [
    "data.task=addition-longtail",
    "data.digits=6",
    "model.max_positions=96",
    "reward.fn=gsm8k",
    "rollout.max_tokens=72",
    "rollout.max_num_seqs=256",
    "trainer.micro_batch_tokens=8192",
]
#: The multi-turn tools job, as examples/tools.yaml sets it (a test holds the two together).
TOOLS = [
    "model.max_positions=192",
    "data.task=multiply-tools",
    "warm_start.steps=600",
    "warm_start.batch_size=64",
    "warm_start.mistake_rate=0.6",
    "rollout.n=8",
    "rollout.max_tokens=100",
    "rollout.groups_per_call=16",
    "trainer.micro_batch_tokens=8192",
    "trainer.groups_per_step=16",
    "store.lease_timeout=600",
    "reward.fn=exact_match",
    "agent.enabled=true",
    "agent.max_turns=3",
    "agent.max_tokens=170",
    "agent.tool_timeout=120",
    "agent.latency.distribution=lognormal",
    "agent.latency.median=0.2",
    "agent.latency.sigma=0.5",
    "agent.latency.subprocess=true",
]
#: What a run keeps from its seed's first run: the built model and its warm start.
SHARED = ("model-init", "warm_start")


@dataclass(frozen=True)
class Settings:
    """The job's settings: the defaults, except these."""

    steps: int
    eval_every: int
    eval_size: int
    #: Held-out accuracy the time-to-target clock stops at (the staleness cases).
    target: float = 0.0

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
#: The tools job's 40 steps (examples/tools.yaml), evaluated every 5.
TOOLS_FULL = Settings(steps=40, eval_every=5, eval_size=200)
TOOLS_QUICK = Settings(steps=2, eval_every=1, eval_size=20)
#: Points of held-out accuracy within which a run has reached another's final accuracy.
TOLERANCE = 0.02


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


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run's ``summary.json`` and its ``metrics.jsonl`` records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, read_history(run_dir)


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """A run's ``metrics.jsonl`` records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rl_seconds(summary: dict[str, Any], history: list[dict[str, Any]]) -> float:
    """A run's RL phase less the evaluations the trainer waited for inside it (every
    ``run.eval_every``-th step and the last, unless ``run.eval_deferred``), from its
    ``summary.json`` and ``metrics.jsonl`` records."""
    evaluating = float(sum(r.get("eval_seconds", 0.0) for r in history))
    return float(summary["phase_seconds"]["rl"]) - evaluating


def result(run_dir: Path, seed: int, staleness: int, target: float) -> RunResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    rl = float(summary["phase_seconds"]["rl"])  # no evaluation in it: they are deferred
    curve = summary["deferred_evaluations"]
    reached_at = next((e["time"] for e in curve if e["eval_accuracy"] >= target), None)
    return RunResult(
        seed=seed,
        staleness=staleness,
        time_to_target=reached_at if reached_at is not None else rl,
        reached=reached_at is not None,
        initial_accuracy=float(summary["accuracy_before"]),
        final_accuracy=float(summary["accuracy_after"]),
        tokens_per_s=summary["tokens_generated"] / rl,
        rl_seconds=rl,
        engines=summary["engines"],
    )


def rotated(items: list[Any], i: int) -> list[Any]:
    """``items`` starting at its ``i``-th (modulo its length): seed ``i``'s order of runs."""
    k = i % len(items)
    return items[k:] + items[:k]


def copy_warm_start(first: Path | None, run_dir: Path) -> None:
    if first is not None:
        for name in SHARED:
            shutil.copytree(first / name, run_dir / name)


def _staleness_runs(
    workdir: Path, seed: int, i: int, settings: Settings, report: Report, quick: bool
) -> tuple[list[RunResult], Path | None]:
    results = []
    order = rotated(list(STALENESS), i)
    first: Path | None = None
    for k in order:
        run_dir = workdir / f"seed-{seed}" / f"staleness-{k}"
        copy_warm_start(first, run_dir)
        started = time.monotonic()
        train(run_dir, [*settings.overrides(seed, k), "run.eval_deferred=true"], quick)
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
    return results, first


@dataclass(frozen=True)
class PeerResult:
    seed: int
    case: str
    rl_seconds: float
    start_seconds: float
    initial_accuracy: float
    final_accuracy: float
    tokens_per_s: float


def _peer_runs(
    workdir: Path, seed: int, i: int, first: Path | None, settings: Settings, quick: bool
) -> list[PeerResult]:
    """The peers of one seed; the job's runs rotate their order from seed to seed, TRL runs
    second (on the warm start the first made, unless ``first`` already has one)."""
    jobs = rotated(JOBS, i)
    overrides = [
        *settings.overrides(seed, 1),
        f"run.eval_every={settings.steps + 1}",  # the final model only
    ]
    results: dict[str, PeerResult] = {}
    for case in (jobs[0], "trl", *jobs[1:]):
        run_dir = workdir / f"seed-{seed}" / case
        copy_warm_start(first, run_dir)
        if case == "trl":
            assert first is not None
            trl(first / "warm_start", run_dir, overrides, quick)
        else:
            train(run_dir, [*overrides, *PEERS[case]], quick)
            first = first or run_dir
        results[case] = _peer_result(run_dir, seed, case)
    # One warm start: TRL's model before RL is the job's.
    before = results["asyncflow"].initial_accuracy
    results["trl"] = dataclasses.replace(results["trl"], initial_accuracy=before)
    return [results[case] for case in PEERS]


@dataclass(frozen=True)
class PartialResult:
    seed: int
    mode: str
    samples_per_s: float
    rl_seconds: float
    tokens_per_s: float
    rollout_busy: float
    trainer_busy: float
    multi_version_share: float
    initial_accuracy: float
    final_accuracy: float


def _partial_runs(
    workdir: Path, seed: int, i: int, settings: Settings, quick: bool
) -> list[PartialResult]:
    """The long-tail job of one seed in each ``rollout.partial`` mode, from one warm start."""
    modes = rotated(list(PARTIAL), i)
    overrides = [
        *settings.overrides(seed, 1),
        *LONGTAIL,
        f"run.eval_every={settings.steps + 1}",  # the final model only
    ]
    first: Path | None = None
    results = {}
    for mode in modes:
        run_dir = workdir / f"seed-{seed}" / f"partial-{mode}"
        copy_warm_start(first, run_dir)
        train(run_dir, [*overrides, f"rollout.partial={mode}"], quick)
        first = first or run_dir
        results[mode] = _partial_result(run_dir, seed, mode)
    return [results[mode] for mode in PARTIAL]


def _partial_result(run_dir: Path, seed: int, mode: str) -> PartialResult:
    summary, history = read_run(run_dir)
    rl = rl_seconds(summary, history)
    # A step's trained samples, by age.
    trained = sum(sum(r["staleness"].values()) for r in history if "staleness" in r)
    busy = summary["busy_fraction"]
    return PartialResult(
        seed=seed,
        mode=mode,
        samples_per_s=trained / rl,
        rl_seconds=rl,
        tokens_per_s=summary["tokens_generated"] / rl,
        rollout_busy=float(busy.get("rollout", 0.0)),
        trainer_busy=float(busy.get("trainer", 0.0)),
        multi_version_share=float(summary["multi_version_sample_share"]),
        initial_accuracy=float(summary["accuracy_before"]),
        final_accuracy=float(summary["accuracy_after"]),
    )


def trl(model_dir: Path, out: Path, overrides: list[str], quick: bool) -> None:
    if quick:
        overrides = [*overrides, "trainer.groups_per_step=4"]
    command = [sys.executable, "-m", "asyncflow.bench.trl_peer", "--model", str(model_dir)]
    subprocess.run(
        [*command, "--out", str(out), *overrides],
        check=True,
        stdout=subprocess.DEVNULL,
        env=peer_environment(),
    )


def peer_environment() -> dict[str, str]:
    """The environment of a peer's process: without the one thread per process that the
    ``asyncflow`` command sets for its own workers (a peer that runs in one process computes on
    every core, as torch does by default)."""
    return {k: v for k, v in os.environ.items() if k not in ONE_THREAD}


def _peer_result(run_dir: Path, seed: int, case: str) -> PeerResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    phases = summary["phase_seconds"]
    if case == "trl":
        rl, start, before = float(phases["rl"]), float(phases["start"]), float("nan")
    else:
        rl = rl_seconds(summary, read_history(run_dir))
        # With trainer ranks in processes of their own, what is left of their start too.
        start = (
            float(phases["engine_start"])
            + float(phases["eval_before"])
            + float(phases.get("trainer_start", 0.0))
        )
        before = float(summary["accuracy_before"])
    return PeerResult(
        seed=seed,
        case=case,
        rl_seconds=rl,
        start_seconds=start,
        initial_accuracy=before,
        final_accuracy=float(summary["accuracy_after"]),
        tokens_per_s=summary["tokens_generated"] / rl,
    )


@dataclass(frozen=True)
class ToolsResult:
    seed: int
    case: str
    rl_seconds: float
    tokens_per_s: float
    initial_accuracy: float
    final_accuracy: float
    #: (RL seconds, held-out accuracy) of the weights of every ``eval_every``-th step and the
    #: last, scored after RL.
    curve: tuple[tuple[float, float], ...]

    def time_to(self, accuracy: float) -> float | None:
        """RL seconds until held-out accuracy came within ``TOLERANCE`` of ``accuracy``."""
        return next((t for t, a in self.curve if a >= accuracy - TOLERANCE - 1e-9), None)


#: The tools job's staleness runs, by case.
TOOLS_JOBS = {f"tools-staleness-{k}": k for k in STALENESS}
TOOLS_CASES = (*TOOLS_JOBS, "tools-trl")


def _tools_runs(
    workdir: Path, seed: int, i: int, settings: Settings, quick: bool
) -> list[ToolsResult]:
    """The tools job of one seed at each staleness, and TRL, from one warm start; the job's
    runs rotate their order from seed to seed, TRL runs second. Every run evaluates after RL
    (``run.eval_deferred``), so its RL seconds hold no evaluation."""
    jobs = rotated(list(TOOLS_JOBS), i)
    first: Path | None = None
    results: dict[str, ToolsResult] = {}
    for case in (jobs[0], "tools-trl", *jobs[1:]):
        run_dir = workdir / f"seed-{seed}" / case
        copy_warm_start(first, run_dir)
        overrides = [
            *settings.overrides(seed, TOOLS_JOBS.get(case, 0)),
            *TOOLS,
            "run.eval_deferred=true",
        ]
        if case == "tools-trl":
            assert first is not None
            trl(first / "warm_start", run_dir, overrides, quick)
        else:
            train(run_dir, overrides, quick)
            first = first or run_dir
        results[case] = _tools_result(run_dir, seed, case)
    before = results[jobs[0]].initial_accuracy  # one warm start: TRL's model before RL
    results["tools-trl"] = dataclasses.replace(results["tools-trl"], initial_accuracy=before)
    return [results[case] for case in TOOLS_CASES]


def _tools_result(run_dir: Path, seed: int, case: str) -> ToolsResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    rl = float(summary["phase_seconds"]["rl"])
    return ToolsResult(
        seed=seed,
        case=case,
        rl_seconds=rl,
        tokens_per_s=summary["tokens_generated"] / rl,
        initial_accuracy=float(summary.get("accuracy_before", "nan")),  # TRL: the job's
        final_accuracy=float(summary["accuracy_after"]),
        curve=tuple((e["time"], e["eval_accuracy"]) for e in summary["deferred_evaluations"]),
    )


def _add_tools(report: Report, results: list[ToolsResult]) -> None:
    by_case = {c: [r for r in results if r.case == c] for c in TOOLS_CASES}
    sync, peer = by_case["tools-staleness-0"], by_case["tools-trl"]
    for case, runs in by_case.items():
        for metric, unit in [
            ("rl_seconds", "s"),
            ("tokens_per_s", "tokens/s"),
            ("initial_accuracy", "fraction"),
            ("final_accuracy", "fraction"),
        ]:
            report.add(
                case, metric, _mean(runs, metric), unit, "tools-staleness-0", _mean(sync, metric)
            )
        for metric in ("initial_accuracy", "final_accuracy"):
            values = [float(getattr(r, metric)) for r in runs]
            report.add(case, f"{metric}_min", min(values), "fraction")
            report.add(case, f"{metric}_max", max(values), "fraction")
        for name, base_case, base in (
            ("sync", "tools-staleness-0", sync),
            ("trl", "tools-trl", peer),
        ):
            # The last evaluation of the curve: the same engine as the others.
            finals = {r.seed: r.curve[-1][1] for r in base}
            times = [r.time_to(finals[r.seed]) for r in runs]
            spent = [t if t is not None else r.rl_seconds for t, r in zip(times, runs, strict=True)]
            report.add(
                case,
                f"time_to_{name}_final_s",
                mean(spent),
                "s",
                base_case,
                _mean(base, "rl_seconds"),
            )
            reached = sum(t is not None for t in times) / len(runs)
            report.add(case, f"reached_{name}_final", reached, "fraction")


def run(
    report: Report,
    quick: bool = False,
    costs_path: str | None = None,
    cases: tuple[str, ...] = DEFAULT_CASES,
    seeds: tuple[int, ...] | None = None,
) -> None:
    """``seeds``: a part of ``SEEDS`` (default: all, or the first with ``quick``); a seed's
    runs keep the order they have in the full run, so seeds run apart add up to it."""
    settings = QUICK if quick else FULL
    unknown = set(cases) - set(CASES)
    if unknown:
        raise ArgumentError(f"e2e cases are {CASES}, not {sorted(unknown)}")
    if seeds is None:
        seeds = SEEDS[:1] if quick else SEEDS
    if not seeds or not set(seeds) <= set(SEEDS):
        raise ArgumentError(f"e2e seeds are some of {SEEDS}, not {list(seeds)}")
    if set(cases) & set(DEFAULT_CASES):
        report.note(
            f"asyncflow train with its defaults except: {settings.steps} steps, evaluation every "
            f"{settings.eval_every} steps on {settings.eval_size} held-out problems (peers: the "
            f"final model only); target accuracy {settings.target}"
        )
    tool_settings = TOOLS_QUICK if quick else TOOLS_FULL
    if "tools" in cases:
        report.note(
            f"tools: asyncflow train as examples/tools.yaml and TRL, {tool_settings.steps} "
            f"steps, the weights of every {tool_settings.eval_every}th step scored after RL on "
            f"{tool_settings.eval_size} held-out problems; reached: within {TOLERANCE} of the "
            "final accuracy"
        )
    staleness: list[RunResult] = []
    peers: list[PeerResult] = []
    partial: list[PartialResult] = []
    tools: list[ToolsResult] = []
    with tempfile.TemporaryDirectory(prefix="asyncflow-e2e-") as tmp:
        for seed in seeds:
            i = SEEDS.index(seed)
            first = None
            if "staleness" in cases:
                runs, first = _staleness_runs(Path(tmp), seed, i, settings, report, quick)
                staleness += runs
            if "peers" in cases:
                runs_p = _peer_runs(Path(tmp), seed, i, first, settings, quick)
                for r in runs_p:
                    report.progress(
                        f"seed {seed} {r.case}: start "
                        f"{r.start_seconds:.1f}s, RL {r.rl_seconds:.1f}s, accuracy -> "
                        f"{r.final_accuracy:.3f}, {r.tokens_per_s:.0f} tokens/s"
                    )
                peers += runs_p
            if "partial" in cases:
                runs_q = _partial_runs(Path(tmp), seed, i, settings, quick)
                for q in runs_q:
                    report.progress(
                        f"seed {seed} partial {q.mode}: RL {q.rl_seconds:.1f}s, "
                        f"{q.samples_per_s:.1f} samples/s, busy rollout {q.rollout_busy:.2f} "
                        f"trainer {q.trainer_busy:.2f}, multi-version "
                        f"{q.multi_version_share:.3f}, accuracy {q.initial_accuracy:.3f} -> "
                        f"{q.final_accuracy:.3f}"
                    )
                partial += runs_q
            if "tools" in cases:
                runs_t = _tools_runs(Path(tmp), seed, i, tool_settings, quick)
                for t in runs_t:
                    report.progress(
                        f"seed {seed} {t.case}: RL {t.rl_seconds:.1f}s, accuracy "
                        f"{t.initial_accuracy:.3f} -> {t.final_accuracy:.3f}, curve "
                        + ", ".join(f"{a:.3f} at {s:.0f}s" for s, a in t.curve)
                    )
                tools += runs_t
    if staleness:
        by_k = {k: [r for r in staleness if r.staleness == k] for k in STALENESS}
        for k, runs in by_k.items():
            _add(report, f"staleness-{k}", runs, by_k[0])
    if peers:
        by_case = {c: [r for r in peers if r.case == c] for c in PEERS}
        for case, runs_c in by_case.items():
            _add_peer(report, case, runs_c, by_case["trl"])
    if partial:
        by_mode = {m: [r for r in partial if r.mode == m] for m in PARTIAL}
        for mode, runs_m in by_mode.items():
            _add_partial(report, f"partial-{mode}", runs_m, by_mode["off"])
    if tools:
        _add_tools(report, tools)


def _mean(runs: Sequence[Any], field: str) -> float:
    """The mean of ``field`` over the runs of a case (its seeds)."""
    return mean(float(getattr(r, field)) for r in runs)


def _add_partial(
    report: Report, case: str, runs: list[PartialResult], base: list[PartialResult]
) -> None:
    for metric, unit in [
        ("samples_per_s", "samples/s"),
        ("rl_seconds", "s"),
        ("tokens_per_s", "tokens/s"),
        ("rollout_busy", "fraction"),
        ("trainer_busy", "fraction"),
        ("multi_version_share", "fraction"),
        ("initial_accuracy", "fraction"),
        ("final_accuracy", "fraction"),
    ]:
        report.add(case, metric, _mean(runs, metric), unit, "partial-off", _mean(base, metric))
    for metric in ("samples_per_s", "final_accuracy"):
        values = [float(getattr(r, metric)) for r in runs]
        unit = "samples/s" if metric == "samples_per_s" else "fraction"
        report.add(case, f"{metric}_min", min(values), unit)
        report.add(case, f"{metric}_max", max(values), unit)


def _add_peer(report: Report, case: str, runs: list[PeerResult], base: list[PeerResult]) -> None:
    for metric, unit in [
        ("rl_seconds", "s"),
        ("start_seconds", "s"),
        ("tokens_per_s", "tokens/s"),
        ("final_accuracy", "fraction"),
    ]:
        report.add(case, metric, _mean(runs, metric), unit, "trl", _mean(base, metric))
    values = [r.final_accuracy for r in runs]
    report.add(case, "final_accuracy_min", min(values), "fraction")
    report.add(case, "final_accuracy_max", max(values), "fraction")
    report.add(case, "initial_accuracy", _mean(runs, "initial_accuracy"), "fraction")


def _add(report: Report, case: str, runs: list[RunResult], base: list[RunResult]) -> None:
    sync = "staleness-0"
    for metric, field, unit in [
        ("time_to_target_s", "time_to_target", "s"),
        ("rl_seconds", "rl_seconds", "s"),
        ("tokens_per_s", "tokens_per_s", "tokens/s"),
        ("initial_accuracy", "initial_accuracy", "fraction"),
        ("final_accuracy", "final_accuracy", "fraction"),
    ]:
        report.add(case, metric, _mean(runs, field), unit, sync, _mean(base, field))
    for field in ("initial_accuracy", "final_accuracy"):
        values = [float(getattr(r, field)) for r in runs]
        report.add(case, f"{field}_min", min(values), "fraction")
        report.add(case, f"{field}_max", max(values), "fraction")
    report.add(case, "reached_target", _mean(runs, "reached"), "fraction")
