"""The rule that places the separated modes (each at the split the simulator finds fastest) and
the cost model's promise that every parameter says where it comes from."""

from __future__ import annotations

import re
from dataclasses import replace

from asyncflow.bench import costs as cost_model
from asyncflow.bench.pipeline_suite import quick_costs
from asyncflow.bench.split import best_split, simulated_rate, with_best_split


def test_a_separated_mode_runs_at_the_split_the_simulator_finds_fastest() -> None:
    costs = quick_costs(cost_model.load())
    rates = {r: simulated_rate(costs, "async-1", r) for r in range(1, costs.devices)}
    chosen = best_split(costs, "async-1")
    assert rates[chosen] == max(rates.values())
    assert chosen == min(r for r, rate in rates.items() if rate == rates[chosen])
    placed = with_best_split(costs, "async-1", colocated=False)
    assert placed.rollout_devices == chosen and placed.split() == (
        chosen,
        costs.devices - chosen,
    )


def test_a_split_named_in_the_cost_model_is_kept_and_colocated_modes_have_none() -> None:
    costs = quick_costs(cost_model.load())
    assert best_split(replace(costs, rollout_devices=3), "async-1") == 3
    assert with_best_split(costs, "colocated-sync", colocated=True) is costs


def test_every_cost_model_parameter_names_its_source_or_says_it_is_assumed() -> None:
    lines = cost_model.DEFAULT.read_text().splitlines()
    parameter = re.compile(r"^\s*[a-z_]+:\s*[0-9.]+\s*(#.*)?$")
    unsourced = []
    for i, line in enumerate(lines):
        if not parameter.match(line) or "#" in line:
            continue
        # A comment block covers the run of uncommented parameters right below it.
        j = i - 1
        while j >= 0 and parameter.match(lines[j]) and "#" not in lines[j]:
            j -= 1
        if j < 0 or not lines[j].strip().startswith("#"):
            unsourced.append(line.strip())
    assert not unsourced, f"parameters without a source or ASSUMPTION comment: {unsourced}"
