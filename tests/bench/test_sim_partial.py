"""The simulator's partial-rollout modes, as the ``partial_rollout`` bench and the pipeline suite
call them through the bindings."""

from __future__ import annotations

import pytest

from asyncflow import _native
from asyncflow.bench import costs as cost_model
from asyncflow.bench.emulation.modes import PARTIAL_MODES
from asyncflow.bench.pipeline_suite import quick_costs
from asyncflow.bench.split import with_best_split


def test_the_simulator_runs_each_partial_mode_within_the_staleness_bound() -> None:
    costs = with_best_split(quick_costs(cost_model.load()), "async-1", colocated=False)
    for name, mode in PARTIAL_MODES.items():
        assert mode.simulated_as == name
        out = _native.simulate(costs.params(), name, warmup_steps=2, steps=2)
        assert out["samples_per_s"] > 0
        assert out["rollout_devices"] == costs.rollout_devices
        assert 0 <= out["staleness_max"] <= mode.staleness
        assert out["busy"]["weight_load"] > 0  # versions load while sequences are in flight


def test_an_unknown_partial_mode_is_refused() -> None:
    params = quick_costs(cost_model.load()).params()
    for bad in ("async-1+pause", "colocated-sync+continue"):
        with pytest.raises(ValueError, match="mode"):
            _native.simulate(params, bad)
