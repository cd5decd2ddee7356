"""How the asynchronous modes' gain over ``colocated-sync`` depends on the cost model's
assumptions, simulated on its cluster: ``python benches/sensitivity.py [--costs FILE]`` prints a
markdown table (a few minutes).

Each row changes one thing: the workload (prompts per step, the response cap, the lognormal's
median and spread, which no paper publishes) or a cost labelled an assumption in the cost model
(decode at half the datasheet's bandwidth, the colocated switch). Every separated mode runs at
its own best split (:mod:`asyncflow.bench.split`), re-found for each row and seed; each figure
is the mean over the workload seeds ``SEEDS``, with the smallest and largest ratio beside it.
The last column is async-1 on separated-sync's best split instead of its own.

The gain comes from the long tail of response lengths: a synchronous step waits for its longest
response with its batch nearly empty, while an asynchronous pipeline keeps batches full with
later steps' prompts. But a step cannot end before its own longest response, which a full batch
decodes more slowly; with staleness k, k + 1 steps overlap, so async-k is bounded by that
latency over k + 1.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from statistics import mean
from typing import Any

from asyncflow import _native
from asyncflow.bench import costs as cost_model
from asyncflow.bench.split import best_split, simulated_rate

SEEDS = (0, 1, 2)
SEPARATED = ("separated-sync", "async-1", "async-2")
ON_SEPARATED_SPLIT = "async-1 on separated-sync's split"


def variants(c: cost_model.CostModel) -> list[tuple[str, cost_model.CostModel]]:
    w, r, k = c.workload, c.rollout, c.colocated

    def work(**change: Any) -> cost_model.CostModel:
        return replace(c, workload=replace(w, **change))

    return [
        ("as configured", c),
        ("half the prompts per step", work(prompts_per_step=w.prompts_per_step // 2)),
        ("twice the prompts per step", work(prompts_per_step=2 * w.prompts_per_step)),
        ("responses cut at 8k", work(response_max_tokens=8192)),
        ("responses cut at 16k", work(response_max_tokens=16384)),
        ("responses cut at 32k", work(response_max_tokens=32768)),
        ("median response 1000", work(response_median_tokens=1000)),
        ("median response 3000", work(response_median_tokens=3000)),
        ("narrower tail (sigma 0.8)", work(response_sigma=0.8)),
        ("wider tail (sigma 1.2)", work(response_sigma=1.2)),
        (
            "decode at half the datasheet bandwidth",
            replace(
                c,
                rollout=replace(
                    r,
                    decode_step_s=2 * r.decode_step_s,
                    decode_per_sequence_s=2 * r.decode_per_sequence_s,
                ),
            ),
        ),
        (
            "no colocated switch cost",
            replace(c, colocated=replace(k, to_train_s=0, to_generate_s=0)),
        ),
        (
            "colocated switch twice as long",
            replace(
                c,
                colocated=replace(
                    k, to_train_s=2 * k.to_train_s, to_generate_s=2 * k.to_generate_s
                ),
            ),
        ),
    ]


def ratios(costs: cost_model.CostModel) -> dict[str, float]:
    """samples/s of colocated-sync, and each separated mode's ratio to it, at one seed."""
    base = float(_native.simulate(costs.params(), "colocated-sync")["samples_per_s"])
    out = {"colocated-sync": base}
    splits = {m: best_split(costs, m) for m in SEPARATED}
    for m in SEPARATED:
        out[m] = simulated_rate(costs, m, splits[m]) / base
        out[f"{m} split"] = splits[m]
    out[ON_SEPARATED_SPLIT] = simulated_rate(costs, "async-1", splits["separated-sync"]) / base
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", metavar="FILE", help="cost model YAML (default paper-7b)")
    costs = cost_model.load(parser.parse_args().costs)
    print(
        "| variant | colocated-sync samples/s | separated-sync | async-1 (min-max) | async-2 "
        "| splits (sep-sync / async-1 / async-2) | async-1 on sep-sync's split |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for label, variant in variants(costs):
        runs = [ratios(replace(variant, workload=replace(variant.workload, seed=s))) for s in SEEDS]

        def avg(key: str, runs: list[dict[str, float]] = runs) -> float:
            return mean(r[key] for r in runs)

        a1 = [r["async-1"] for r in runs]
        split = " / ".join(
            "-".join(str(s) for s in sorted({int(r[f"{m} split"]) for r in runs}))
            for m in SEPARATED
        )
        print(
            f"| {label} | {avg('colocated-sync'):.2f} | {avg('separated-sync'):.2f}x "
            f"| {mean(a1):.2f}x ({min(a1):.2f}-{max(a1):.2f}) | {avg('async-2'):.2f}x "
            f"| {split} | {avg(ON_SEPARATED_SPLIT):.2f}x |"
        )


if __name__ == "__main__":
    main()
