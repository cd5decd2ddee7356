"""Runs one mode of the ``pipeline`` suite as the suite runs it (same split, processes and
measurement) and prints its framework CPU per sample, process by process (the emulated devices'
serving threads apart), for profiling::

    py-spy record --subprocesses --gil --nonblocking -r 50 --format speedscope -o OUT.json -- \\
        .venv/bin/python benches/profiles/one_mode.py streaming [COSTS.yaml]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from asyncflow.bench import costs as cost_model
from asyncflow.bench import pipeline_suite as suite
from asyncflow.bench.emulation.modes import MODES
from asyncflow.bench.records import Report
from asyncflow.bench.split import with_best_split


def main(mode_name: str, costs_path: str | None) -> None:
    mode = MODES[mode_name]
    costs = with_best_split(cost_model.load(costs_path), mode_name, mode.colocated)
    e = costs.emulation
    samples = (e.warmup_steps + e.steps) * costs.workload.samples_per_step
    run_mode = suite.run_mode

    def reporting(*args: Any, **kwargs: Any) -> suite.ModeRun:
        run = run_mode(*args, **kwargs)
        cpu = {r["name"]: r["cpu_s"] - r["emulator_cpu_s"] for r in run.reports}
        cpu |= {"daemon": run.daemon_cpu_s}
        cpu |= {"(emulator)": sum(r["emulator_cpu_s"] for r in run.reports)}
        cpu |= {"(of which calls)": sum(r["emulated_calls_cpu_s"] for r in run.reports)}
        for name, seconds in cpu.items():
            print(f"  {name}: {seconds:.2f} s CPU = {1e3 * seconds / samples:.3f} ms/sample")
        return run

    suite.run_mode = reporting
    with tempfile.TemporaryDirectory() as tmp:
        result = suite.measure(mode, costs, Path(tmp), Report("pipeline"))
    print(
        f"{mode_name}: framework overhead {result.overhead_ms:.3f} ms/sample "
        f"(emulator apart: {result.emulator_ms:.3f}), "
        f"{result.samples_per_s:.2f} samples/s (simulated {result.simulated:.2f})"
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
