"""The ``sim`` suite: the pipeline on 32 to 1024 devices, simulated in virtual time by
``asyncflow-sim`` (Rust), which drives the real store index and scheduler with the same cost
model the ``pipeline`` suite emulates in real time. Prompts per step and the trainer's
micro-batch grow with the cluster (weak scaling).

Per cluster size (case = number of devices):

- ``samples_per_s`` of ``async-1``, against ``colocated-sync`` on the same devices;
- ``scaling_efficiency``: ``async-1``'s samples/s per device, divided by its value at the
  smallest size;
- ``scaling_efficiency_sync``: the same for ``colocated-sync``;
- ``busy_rollout``, ``decode_fill`` (batch fill while decoding) and ``busy_trainer`` of
  ``async-1``;
- ``index_us_per_sample``: real time the store index (the control plane) took per sample, in
  µs; the whole simulated cluster's claims, puts and acks run through it.
"""

from __future__ import annotations

import time
from typing import Any

from asyncflow import _native
from asyncflow.bench import costs as cost_model
from asyncflow.bench.records import Report

SIZES = (32, 64, 128, 256, 512, 1024)
QUICK_SIZES = (32, 64, 128)
HEADLINE = "async-1"
BASELINE = "colocated-sync"


def simulate(costs: cost_model.CostModel, mode: str, devices: int, quick: bool) -> dict[str, Any]:
    warmup, steps = (2, 3) if quick else (4, 8)
    return _native.simulate(costs.params(), mode, devices, warmup_steps=warmup, steps=steps)


def run(report: Report, quick: bool = False, costs_path: str | None = None) -> None:
    costs = cost_model.load(costs_path)
    sizes = QUICK_SIZES if quick else SIZES
    warmup, steps = (2, 3) if quick else (4, 8)
    report.note(
        f"cost model {costs_path or cost_model.DEFAULT.name}, prompts per step, trainer "
        f"micro-batch and reward workers grown with the devices; {warmup} warm-up and {steps} "
        f"measured steps per run, simulated"
    )
    per_device: dict[str, float] = {}
    for n in sizes:
        started = time.monotonic()
        ours = simulate(costs, HEADLINE, n, quick)
        base = simulate(costs, BASELINE, n, quick)
        report.progress(
            f"{n} devices ({ours['rollout_devices']} generate, {ours['train_devices']} train): "
            f"simulated in {time.monotonic() - started:.1f}s"
        )
        case = str(n)
        report.add(
            case,
            "samples_per_s",
            ours["samples_per_s"],
            "samples/s",
            BASELINE,
            base["samples_per_s"],
        )
        for mode, outcome, metric in [
            (HEADLINE, ours, "scaling_efficiency"),
            (BASELINE, base, "scaling_efficiency_sync"),
        ]:
            rate = outcome["samples_per_s"] / n
            per_device.setdefault(mode, rate)
            report.add(case, metric, rate / per_device[mode], "x")
        report.add(case, "busy_rollout", ours["busy"]["rollout"], "fraction")
        report.add(case, "decode_fill", ours["decode_fill"], "fraction")
        report.add(case, "busy_trainer", ours["busy"]["trainer"], "fraction")
        per_sample = ours["index_seconds"] / ours["trained_samples"]
        report.add(case, "index_us_per_sample", 1e6 * per_sample, "us")
