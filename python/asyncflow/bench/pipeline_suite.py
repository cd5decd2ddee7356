"""The ``pipeline`` suite: the real workers, store daemon, scheduler and weight publication, in
real processes, on emulated devices that spend the cost model's time instead of computing.

Every mode of :mod:`asyncflow.bench.emulation.modes` runs the same workload, one after the
other, in the same run. Per mode:

- ``samples_per_s``: trained samples per modelled second over the measured steps (after the
  warm-up steps fill the pipeline), against ``colocated-sync`` and against ``ideal``: the
  placement's bound with its bottleneck busy all the time on useful work (a full decode batch,
  training tokens).
- ``busy_<role>``: the fraction of its devices' time each role kept them busy (``rollout``,
  ``weight_load``, ``reference``, ``trainer``, ``publish``, ``switch``; ``reward`` over its CPU
  workers); ``busy_bottleneck``: the busiest device pool, all its roles together.
- ``step_time``: modelled seconds per training step.
- ``overhead_per_sample``: CPU milliseconds the framework spent per trained sample, in every
  process and the store daemon: store, scheduling, weight publication and worker bookkeeping.
  The emulator is not the framework: its devices' serving threads (which wake at every modelled
  sequence's end to keep the batch's timing), and the workers' calls into the emulated engines
  and verifier (which stand for an accelerator's work and a reward function's: sleeps, and
  responses of the modelled lengths made up). Their CPU is left out and reported apart as
  ``emulator_per_sample``, of which ``emulated_calls_per_sample`` is the calls'.
- ``rollout_devices``: the devices generating; each separated mode runs at its own best split
  (:mod:`asyncflow.bench.split`), colocated-sync on all of them.
- ``sim_samples_per_s``: the simulator's figure for the same mode, split and cost model, in
  virtual time.

Every figure is emulated: accelerators spend the cost model's time, nothing is computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncflow as af
from asyncflow import _native
from asyncflow.bench import costs as cost_model
from asyncflow.bench.costs import CostModel
from asyncflow.bench.emulation.modes import (
    BASELINE,
    MODES,
    Mode,
    Placement,
    ProcessSpec,
    placement,
    processes,
)
from asyncflow.bench.records import Report
from asyncflow.bench.split import simulated_rate, with_best_split
from asyncflow.daemon import DaemonProcess
from asyncflow.train import register_tasks

#: Seconds (real) a mode may take before the suite gives up on it.
MODE_TIMEOUT = 1800.0
#: Roles measured on devices; ``reward`` runs on CPU workers.
DEVICE_ROLES = ("rollout", "weight_load", "reference", "trainer", "publish", "switch")
#: Meter entries that are not roles: sequence-seconds decoded, for the batch fill.
SLOTS = "decode_slots"


@dataclass
class ModeRun:
    """What one mode's processes left behind."""

    metrics: list[dict[str, Any]]
    reports: list[dict[str, Any]]
    daemon_cpu_s: float


def quick_costs(costs: CostModel) -> CostModel:
    """A much smaller, faster run of the same model, for smoke tests: 8 devices, 16 prompts per
    step, one warm-up and one measured step, at 100x compression. Its figures mean little."""
    small = costs.scaled(8)
    e = replace(
        small.emulation,
        compression=100,
        warmup_steps=1,
        steps=1,
        calls_per_device=8,
        micro_batch_groups=4,
    )
    return replace(small, workload=replace(small.workload, prompts_per_step=16), emulation=e)


def _proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_mode(mode: Mode, costs: CostModel, workdir: Path, report: Report) -> ModeRun:
    """Runs one mode to its last training step; returns what its processes recorded."""
    run_dir = workdir / mode.name
    run_dir.mkdir(parents=True)
    with DaemonProcess("--memory-limit", "8GiB", "--lease-timeout", "3600") as daemon:
        register_tasks(af.connect(daemon.url), reference=True)
        daemon_cpu = _proc_cpu_seconds(daemon.proc.pid)
        procs: dict[str, subprocess.Popen[str]] = {}
        for name, roles in processes(mode).items():
            spec = ProcessSpec(
                name,
                mode.name,
                roles,
                daemon.url,
                costs.as_dict(),
                str(run_dir),
                str(run_dir / f"{name}.report.json"),
            )
            spec.write(run_dir / f"{name}.spec.json")
            command = [sys.executable, "-m", "asyncflow.bench.emulation.process"]
            procs[name] = subprocess.Popen(
                [*command, str(run_dir / f"{name}.spec.json")], stdout=subprocess.PIPE, text=True
            )
        trainer = next(n for n, roles in processes(mode).items() if "trainer" in roles)
        try:
            _follow(procs, trainer, run_dir / "metrics.jsonl", mode, costs, report)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:  # deaf to SIGTERM: it fails the mode below
                    proc.kill()
                    proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
        daemon_cpu = _proc_cpu_seconds(daemon.proc.pid) - daemon_cpu
    _fail_if_any_failed(mode, procs)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reports = [json.loads((run_dir / f"{n}.report.json").read_text()) for n in procs]
    return ModeRun(metrics, reports, daemon_cpu)


def _fail_if_any_failed(mode: Mode, procs: dict[str, subprocess.Popen[str]]) -> None:
    """Raises if any of the mode's processes has exited with an error."""
    failed = {n: p.poll() for n, p in procs.items() if p.poll() not in (None, 0)}
    if failed:
        raise RuntimeError(
            f"{mode.name}: processes failed (exit status; negative: killed by that signal): "
            f"{failed}; see their stderr above"
        )


def _follow(
    procs: dict[str, subprocess.Popen[str]],
    trainer: str,
    metrics: Path,
    mode: Mode,
    costs: CostModel,
    report: Report,
) -> None:
    """Waits for the trainer's process, reporting its steps as they complete. Fails as soon as
    another process of the mode fails: the trainer would only wait for it until it stalled."""
    total = costs.emulation.warmup_steps + costs.emulation.steps
    started, seen = time.monotonic(), 0
    while procs[trainer].poll() is None:
        _fail_if_any_failed(mode, procs)
        if time.monotonic() - started > MODE_TIMEOUT:
            raise TimeoutError(f"{mode.name} did not finish within {MODE_TIMEOUT:.0f}s")
        time.sleep(0.5)
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done != seen:
            seen = done
            report.progress(f"{mode.name}: step {done}/{total}")


def _overlap(start: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(start, lo))


def busy_fractions(
    run: ModeRun, place: Placement, costs: CostModel, window: tuple[float, float]
) -> tuple[dict[str, float], float]:
    """Per role: device-seconds busy in the window over the devices it runs on; and the mean
    fill of the decode batches while the rollout devices were busy."""
    lo, hi = window
    device_s = dict.fromkeys((*DEVICE_ROLES, SLOTS), 0.0)
    reward_s = 0.0
    for r in run.reports:
        for role, start, end, devices in r["meter"]:
            device_s[role] += _overlap(start, end, lo, hi) * devices
        for role, start, end in r["worker_spans"]:
            if role == "reward":
                reward_s += _overlap(start, end, lo, hi)
    span = hi - lo
    slots = device_s.pop(SLOTS)
    busy = {role: s / (place.devices(role) * span) for role, s in device_s.items()}
    busy["reward"] = reward_s / (costs.reward.workers * span)
    pools = [("rollout", "weight_load"), ("reference", "trainer", "publish")]
    if place.colocated:
        pools = [(*pools[0], *pools[1], "switch")]
    busy["bottleneck"] = max(sum(busy[role] for role in pool) for pool in pools)
    fill = slots / (costs.rollout.max_batch * device_s["rollout"]) if device_s["rollout"] else 0.0
    return busy, fill


@dataclass(frozen=True)
class ModeResult:
    samples_per_s: float
    ideal: float
    step_time: float
    busy: dict[str, float]
    decode_fill: float
    overhead_ms: float
    emulator_ms: float
    emulated_calls_ms: float
    staleness: float
    rollout_devices: int
    simulated: float


def measure(mode: Mode, costs: CostModel, workdir: Path, report: Report) -> ModeResult:
    run = run_mode(mode, costs, workdir, report)
    e, w = costs.emulation, costs.workload
    origin = next(r["tracer_origin"] for r in run.reports if r["name"] in ("train", "devices"))
    times = [origin + m["time"] for m in run.metrics]
    window = (times[e.warmup_steps - 1], times[-1])
    steps = len(times) - e.warmup_steps
    modelled = (window[1] - window[0]) * e.compression
    place = placement(mode, costs)
    ideal = (
        costs.colocated_bound() if place.colocated else costs.separated_bound(place.rollout_devices)
    )
    emulator = sum(r["emulator_cpu_s"] for r in run.reports)
    calls = sum(r["emulated_calls_cpu_s"] for r in run.reports)
    cpu = sum(r["cpu_s"] for r in run.reports) + run.daemon_cpu_s - emulator
    trained = len(times) * w.samples_per_step
    ages = [(int(a), n) for m in run.metrics for a, n in m["staleness"].items()]
    busy, fill = busy_fractions(run, place, costs, window)
    simulated = (
        _native.simulate(costs.params(), mode.simulated_as)["samples_per_s"]
        if place.colocated
        else simulated_rate(costs, mode.simulated_as, place.rollout_devices)
    )
    return ModeResult(
        samples_per_s=steps * w.samples_per_step / modelled,
        ideal=ideal,
        step_time=modelled / steps,
        busy=busy,
        decode_fill=fill,
        overhead_ms=1e3 * cpu / trained,
        emulator_ms=1e3 * emulator / trained,
        emulated_calls_ms=1e3 * calls / trained,
        staleness=sum(a * n for a, n in ages) / max(1, sum(n for _, n in ages)),
        rollout_devices=place.rollout_devices,
        simulated=float(simulated),
    )


def run(report: Report, quick: bool = False, costs_path: str | None = None) -> None:
    costs = cost_model.load(costs_path)
    if quick:
        costs = quick_costs(costs)
    per_mode = {name: with_best_split(costs, name, mode.colocated) for name, mode in MODES.items()}
    splits = ", ".join(
        f"{name} {c.rollout_devices}" for name, c in per_mode.items() if c.rollout_devices
    )
    e = costs.emulation
    report.note(
        f"emulated accelerators, cost model {costs_path or cost_model.DEFAULT.name}"
        f"{' (quick)' if quick else ''}: {costs.devices} devices, devices generating in the "
        f"separated modes (each at its own best split): {splits}; "
        f"{costs.workload.samples_per_step} samples per step; {e.warmup_steps} warm-up and "
        f"{e.steps} measured steps per mode, time and tokens compressed {e.compression:g}x"
    )
    results: dict[str, ModeResult] = {}
    with tempfile.TemporaryDirectory(prefix="asyncflow-pipeline-") as tmp:
        for name, mode in MODES.items():
            results[name] = measure(mode, per_mode[name], Path(tmp), report)
            _add(report, name, results[name], results[BASELINE])


def _add(report: Report, case: str, r: ModeResult, base: ModeResult) -> None:
    report.add(case, "samples_per_s", r.samples_per_s, "samples/s", BASELINE, base.samples_per_s)
    report.add(case, "samples_per_s", r.samples_per_s, "samples/s", "ideal", r.ideal)
    report.add(case, "step_time", r.step_time, "s")
    for role, fraction in r.busy.items():
        report.add(case, f"busy_{role}", fraction, "fraction")
    report.add(case, "decode_fill", r.decode_fill, "fraction")
    report.add(case, "overhead_per_sample", r.overhead_ms, "ms")
    report.add(case, "emulator_per_sample", r.emulator_ms, "ms")
    report.add(case, "emulated_calls_per_sample", r.emulated_calls_ms, "ms")
    report.add(case, "staleness_mean", r.staleness, "versions")
    report.add(case, "rollout_devices", r.rollout_devices, "devices")
    report.add(case, "sim_samples_per_s", r.simulated, "samples/s")
