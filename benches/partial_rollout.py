"""async-1 with and without partial rollout (``rollout.partial``: ``continue``, ``abort``) in the
pipeline emulation: the real workers, store daemon and weight publication on emulated devices
(``asyncflow.bench.emulation``), cost model ``paper-7b.yaml`` unless ``--costs`` names another.

    python benches/partial_rollout.py [--seeds 0 1 2] [--quick] [--sim-only] [--json PATH]

Per workload seed, the three modes run on async-1's best split (found by the simulator, as the
``pipeline`` suite does), one after the other; the figures are emulated. The partial modes run
one request-level worker per generating device, keeping as many sequences in flight as
async-1's calls do (``calls_per_device x groups_per_call x group_size``) and claiming
``groups_per_call`` prompt groups at a time, as one call does. Prints a markdown table:
per mode, the mean over the seeds with the smallest and largest beside it.

``sim samples/s`` is the simulator's (``asyncflow-sim``) figure for the same mode, split and cost
model: it models the partial modes as the emulation runs them (one request-level loop per
generating device with the same sequences in flight, each published version loaded at the next
decode-step boundary, and under ``abort`` the cut prefixes prefilled again), and its
``x async-1`` column is the simulated ratio to the simulator's async-1. ``--sim-only`` prints
the simulated figures alone, without running the emulation.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from statistics import mean
from typing import Any

from asyncflow import _native
from asyncflow.bench import costs as cost_model
from asyncflow.bench.emulation.modes import ALL_MODES
from asyncflow.bench.pipeline_suite import ModeResult, measure, quick_costs
from asyncflow.bench.records import Report
from asyncflow.bench.split import STEPS, WARMUP_STEPS, with_best_split

MODES = ("async-1", "async-1+continue", "async-1+abort")
BASELINE = "async-1"


def run_seed(costs: cost_model.CostModel, seed: int, report: Report) -> dict[str, ModeResult]:
    seeded = replace(costs, workload=replace(costs.workload, seed=seed))
    split = with_best_split(seeded, BASELINE, False)
    results = {}
    with tempfile.TemporaryDirectory(prefix="asyncflow-partial-") as tmp:
        for name in MODES:
            results[name] = measure(ALL_MODES[name], split, Path(tmp), report)
            report.progress(f"seed {seed} {name}: {results[name].samples_per_s:.3f} samples/s")
    return results


def simulate_seed(costs: cost_model.CostModel, seed: int) -> dict[str, dict[str, Any]]:
    """The simulator's outcome of each mode on async-1's best split, as :func:`run_seed` runs
    them (and with the warm-up and measured steps the split search and ``measure`` use)."""
    seeded = replace(costs, workload=replace(costs.workload, seed=seed))
    params = with_best_split(seeded, BASELINE, False).params()
    return {
        name: _native.simulate(params, name, warmup_steps=WARMUP_STEPS, steps=STEPS)
        for name in MODES
    }


def sim_table(by_seed: dict[int, dict[str, dict[str, Any]]]) -> str:
    rows = [
        (
            "| mode | sim samples/s | x async-1 | rollout busy | weight load busy | decode fill "
            "| staleness mean | staleness max | generating devices |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in MODES:
        runs = [by_seed[s][name] for s in by_seed]
        base = [by_seed[s][BASELINE] for s in by_seed]
        rate = [r["samples_per_s"] for r in runs]
        ratios = [r / b["samples_per_s"] for r, b in zip(rate, base, strict=True)]
        cells = [
            rate,
            ratios,
            [r["busy"]["rollout"] for r in runs],
            [r["busy"]["weight_load"] for r in runs],
            [r["decode_fill"] for r in runs],
            [r["staleness"] for r in runs],
        ]
        most = max(r["staleness_max"] for r in runs)
        devices = "-".join(str(d) for d in sorted({r["rollout_devices"] for r in runs}))
        rows.append(
            f"| {name} | " + " | ".join(spread(c) for c in cells) + f" | {most} | {devices} |"
        )
    return "\n".join(rows)


def spread(values: list[float]) -> str:
    return f"{mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def table(by_seed: dict[int, dict[str, ModeResult]]) -> str:
    rows = [
        (
            "| mode | samples/s | x async-1 | generation pool busy | training pool busy "
            "| decode fill | weight load busy | sim samples/s | sim x async-1 |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in MODES:
        runs = [by_seed[s][name] for s in by_seed]
        base = [by_seed[s][BASELINE] for s in by_seed]
        ratios = [r.samples_per_s / b.samples_per_s for r, b in zip(runs, base, strict=True)]
        generation = [r.busy["rollout"] + r.busy["weight_load"] for r in runs]
        training = [r.busy["reference"] + r.busy["trainer"] + r.busy["publish"] for r in runs]
        cells = [
            [r.samples_per_s for r in runs],
            ratios,
            generation,
            training,
            [r.decode_fill for r in runs],
            [r.busy["weight_load"] for r in runs],
            [r.simulated for r in runs],
            [r.simulated / b.simulated for r, b in zip(runs, base, strict=True)],
        ]
        rows.append(f"| {name} | " + " | ".join(spread(c) for c in cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny smoke run; figures mean little"
    )
    parser.add_argument(
        "--sim-only", action="store_true", help="the simulated figures alone (no emulation)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    costs = cost_model.load(args.costs)
    if args.quick:
        costs = quick_costs(costs)
    if args.sim_only:
        simulated = {seed: simulate_seed(costs, seed) for seed in args.seeds}
        print(sim_table(simulated), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(simulated, indent=1) + "\n")
        return
    report = Report("partial")
    by_seed: dict[int, dict[str, ModeResult]] = {}
    for seed in args.seeds:
        by_seed[seed] = run_seed(costs, seed, report)
        print(table(by_seed), flush=True)  # after each seed: a run cut short keeps its seeds
        if args.json:
            out = {str(s): {n: asdict(r) for n, r in runs.items()} for s, runs in by_seed.items()}
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
