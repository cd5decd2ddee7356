"""The ``sim`` suite: the pipeline on 32 to 1024 devices, simulated in virtual time by
``asyncflow-sim`` (Rust), which drives the real store index and scheduler with the same cost
model the ``pipeline`` suite emulates in real time. Prompts per step and the trainer's
micro-batch grow with the cluster (weak scaling). async-1 generates on its own best split
(:mod:`asyncflow.bench.split`), found at the cost model's size and grown with the cluster.

Per cluster size (case = number of devices), each figure the mean over the workload seeds
``SEEDS`` (the response lengths drawn), with the smallest and largest beside it:

- ``samples_per_s`` of ``async-1``, against ``colocated-sync`` on the same devices;
- ``scaling_efficiency``: ``async-1``'s samples/s per device, divided by its value at the
  smallest size (per seed, then averaged); ``scaling_efficiency_min`` / ``_max``;
- ``scaling_efficiency_sync``: the same for ``colocated-sync``;
- ``busy_rollout``, ``decode_fill`` (batch fill while decoding) and ``busy_trainer`` of
  ``async-1``;
- ``index_us_per_sample``: real time the store index (the control plane) took per sample, in
  µs; the whole simulated cluster's claims, puts and acks run through it.

What the simulation leaves out, so that its scaling efficiency is not comparable with a measured
one: no device is slower than another (no stragglers, no failures), links are not shared (a
weight publication or all-reduce costs the same whatever else crosses the network), and the
all-reduce and broadcast grow with the ranks only through the cost model's per-hop latency.
"""

from __future__ import annotations

import time
from dataclasses import replace
from statistics import mean
from typing import Any

from asyncflow import _native
from asyncflow.bench import costs as cost_model
from asyncflow.bench.records import Report
from asyncflow.bench.split import with_best_split

SIZES = (32, 64, 128, 256, 512, 1024)
QUICK_SIZES = (32, 64, 128)
SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)
HEADLINE = "async-1"
BASELINE = "colocated-sync"


def simulate(costs: cost_model.CostModel, mode: str, devices: int, quick: bool) -> dict[str, Any]:
    warmup, steps = (2, 3) if quick else (4, 8)
    return _native.simulate(costs.params(), mode, devices, warmup_steps=warmup, steps=steps)


def run(report: Report, quick: bool = False, costs_path: str | None = None) -> None:
    costs = cost_model.load(costs_path)
    sizes = QUICK_SIZES if quick else SIZES
    seeds = QUICK_SEEDS if quick else SEEDS
    warmup, steps = (2, 3) if quick else (4, 8)
    models = [
        with_best_split(replace(costs, workload=replace(costs.workload, seed=s)), HEADLINE, False)
        for s in seeds
    ]
    splits = ", ".join(f"seed {s}: {m.rollout_devices}" for s, m in zip(seeds, models, strict=True))
    report.note(
        f"simulated, cost model {costs_path or cost_model.DEFAULT.name}; async-1 generates on "
        f"its best split of {costs.devices} devices ({splits}), grown with the cluster, as are "
        f"prompts per step, trainer micro-batch and reward workers; {warmup} warm-up and "
        f"{steps} measured steps per run; mean over seeds {list(seeds)}. No stragglers, no "
        f"shared links: see the suite's docstring"
    )
    first: dict[tuple[str, int], float] = {}
    for n in sizes:
        started = time.monotonic()
        ours = [simulate(m, HEADLINE, n, quick) for m in models]
        base = [simulate(m, BASELINE, n, quick) for m in models]
        report.progress(
            f"{n} devices ({ours[0]['rollout_devices']} generate, {ours[0]['train_devices']} "
            f"train at seed {seeds[0]}): simulated in {time.monotonic() - started:.1f}s"
        )
        case = str(n)
        rate = mean(o["samples_per_s"] for o in ours)
        base_rate = mean(b["samples_per_s"] for b in base)
        report.add(case, "samples_per_s", rate, "samples/s", BASELINE, base_rate)
        for mode, outcomes, metric in [
            (HEADLINE, ours, "scaling_efficiency"),
            (BASELINE, base, "scaling_efficiency_sync"),
        ]:
            effs = []
            for i, o in enumerate(outcomes):
                per_device = o["samples_per_s"] / n
                first.setdefault((mode, i), per_device)
                effs.append(per_device / first[(mode, i)])
            report.add(case, metric, mean(effs), "x")
            report.add(case, f"{metric}_min", min(effs), "x")
            report.add(case, f"{metric}_max", max(effs), "x")
        report.add(case, "busy_rollout", mean(o["busy"]["rollout"] for o in ours), "fraction")
        report.add(case, "decode_fill", mean(o["decode_fill"] for o in ours), "fraction")
        report.add(case, "busy_trainer", mean(o["busy"]["trainer"] for o in ours), "fraction")
        per_sample = mean(o["index_seconds"] / o["trained_samples"] for o in ours)
        report.add(case, "index_us_per_sample", 1e6 * per_sample, "us")
