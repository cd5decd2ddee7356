"""How the asynchronous modes' gain over ``colocated-sync`` depends on the workload, simulated on
the cost model's cluster: ``python benches/sensitivity.py [--costs FILE]`` prints a markdown
table (a few seconds).

The gain comes from the long tail of response lengths: a synchronous step waits for its longest
response with its batch nearly empty, while an asynchronous pipeline keeps batches full with
later steps' prompts. But a step cannot end before its own longest response, which a full batch
decodes more slowly; with staleness k, k + 1 steps overlap, so async-k is bounded by that
latency over k + 1. The table shows both effects as the tail and the step size vary.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from asyncflow import _native
from asyncflow.bench import costs as cost_model

MODES = ("colocated-sync", "async-1", "async-2")


def variants(w: cost_model.Workload) -> list[tuple[str, dict[str, float]]]:
    return [
        ("as configured", {}),
        ("half the prompts per step", {"prompts_per_step": w.prompts_per_step // 2}),
        ("twice the prompts per step", {"prompts_per_step": 2 * w.prompts_per_step}),
        ("responses cut at 8k", {"response_max_tokens": 8192}),
        ("responses cut at 16k", {"response_max_tokens": 16384}),
        ("responses cut at 32k", {"response_max_tokens": 32768}),
        ("narrower tail (sigma 0.8)", {"response_sigma": 0.8}),
        ("wider tail (sigma 1.2)", {"response_sigma": 1.2}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", metavar="FILE", help="cost model YAML (default paper-7b)")
    costs = cost_model.load(parser.parse_args().costs)
    print("| workload | colocated-sync samples/s | async-1 | async-2 |")
    print("|---|---:|---:|---:|")
    for label, change in variants(costs.workload):
        variant = replace(costs, workload=replace(costs.workload, **change))
        rates = [_native.simulate(variant.params(), m)["samples_per_s"] for m in MODES]
        base = rates[0]
        print(f"| {label} | {base:.1f} | {rates[1] / base:.2f}x | {rates[2] / base:.2f}x |")


if __name__ == "__main__":
    main()
