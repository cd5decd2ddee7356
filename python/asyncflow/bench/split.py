"""How many devices generate in a separated placement: the rule the ``pipeline``, ``sim`` and
sensitivity runs apply, so that no split is picked by hand after seeing results.

Each separated mode runs at its own best split: the simulator (``asyncflow._native.simulate``)
runs the mode on the cost model at every split from 1 to ``devices - 1`` generating devices, and
the fastest wins (the fewest generating devices on a tie). A cost model that names
``rollout_devices`` keeps it.
"""

from __future__ import annotations

from dataclasses import replace

from asyncflow import _native
from asyncflow.bench.costs import CostModel

#: Steps the search simulates per split: the suites' warm-up and measured steps.
WARMUP_STEPS = 4
STEPS = 8


def simulated_rate(costs: CostModel, mode: str, rollout_devices: int) -> float:
    """Samples/s the simulator finds for ``mode`` with ``rollout_devices`` generating."""
    params = replace(costs, rollout_devices=rollout_devices).params()
    outcome = _native.simulate(params, mode, warmup_steps=WARMUP_STEPS, steps=STEPS)
    return float(outcome["samples_per_s"])


def best_split(costs: CostModel, mode: str) -> int:
    """Generating devices for ``mode`` under the rule above."""
    if costs.rollout_devices is not None:
        return costs.rollout_devices
    rates = {r: simulated_rate(costs, mode, r) for r in range(1, costs.devices)}
    return max(rates, key=lambda r: (rates[r], -r))


def with_best_split(costs: CostModel, mode: str, colocated: bool) -> CostModel:
    """The cost model with ``mode``'s split made explicit (unchanged for a colocated mode)."""
    if colocated:
        return costs
    return replace(costs, rollout_devices=best_split(costs, mode))
