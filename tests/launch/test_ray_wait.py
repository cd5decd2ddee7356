"""What the Ray launcher asks of a cluster against what it has, and waits that say what they wait
for: without a cluster (Ray's wait is replaced by one that never finishes, the clock by a
counter)."""

from __future__ import annotations

from typing import Any

import pytest

from asyncflow.launch import ray_wait
from asyncflow.launch.ray_wait import PlacementError, check_fits, cpus_to_start, total

DEFAULT = {  # the default job's placement: one rank, one engine, reward and advantage
    "trainer": [{"CPU": 1.0}],
    "rollout": [{"CPU": 1.0}],
    "workers": [{"CPU": 1.0}, {"CPU": 1.0}],
}


def test_a_ray_instance_started_for_the_run_has_the_cpus_its_placement_reserves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_wait.os, "cpu_count", lambda: 2)
    demand = total([b for bundles in DEFAULT.values() for b in bundles])
    assert demand == {"CPU": 4.0}
    assert cpus_to_start(demand) == 4, "a 2-core machine still holds the default job"
    check_fits(DEFAULT, [{"CPU": float(cpus_to_start(demand))}])
    assert cpus_to_start({"CPU": 0.75}) == 2, "never fewer than the machine has"
    assert cpus_to_start({"CPU": 4.5}) == 5


def test_a_placement_larger_than_the_cluster_in_all_fails_naming_demand_and_capacity() -> None:
    with pytest.raises(PlacementError) as raised:
        check_fits(DEFAULT, [{"CPU": 2.0, "memory": 1e9}])
    message = str(raised.value)
    assert "needs {CPU: 4} in all" in message
    assert "the cluster has {CPU: 2, memory: 1e+09} in all" in message
    assert "trainer {CPU: 1}" in message and "workers {CPU: 2}" in message


def test_a_bundle_no_node_can_hold_fails_naming_it_and_the_nodes() -> None:
    groups = {**DEFAULT, "trainer": [{"CPU": 1.0, "GPU": 1.0}]}
    with pytest.raises(PlacementError, match=r"trainer placement group's bundle \{CPU: 1, GPU: 1"):
        check_fits(groups, [{"CPU": 8.0}, {"CPU": 8.0}])
    # Enough in all but on no single node: a bundle is placed whole.
    with pytest.raises(PlacementError, match=r"fits on no node .*\{CPU: 2\}, \{CPU: 2\}"):
        check_fits({"trainer": [{"CPU": 3.0}]}, [{"CPU": 2.0}, {"CPU": 2.0}])
    check_fits({"trainer": [{"CPU": 2.0}] * 2}, [{"CPU": 2.0}, {"CPU": 2.0}])


class NeverReady:
    """Ray's wait and get for references that never become ready; a clock each wait moves on."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait(self, refs: list[Any], num_returns: int, timeout: float) -> tuple[list, list]:
        self.now += timeout
        return [], refs


def test_a_long_wait_says_what_it_waits_for_every_few_seconds_then_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ray = NeverReady()
    monkeypatch.setattr(ray_wait.ray, "wait", ray.wait)
    said: list[str] = []
    with pytest.raises(TimeoutError, match=r"waited 20s \(ray.start_timeout\) for room; free: 0"):
        ray_wait.wait(["ref"], "room", 20.0, said.append, lambda: "free: 0", clock=ray.clock)
    assert said == [f"waiting {s}s for room (free: 0)" for s in (5, 10, 15)]


def test_a_wait_that_ends_says_nothing_and_returns_the_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_wait.ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    monkeypatch.setattr(ray_wait.ray, "get", lambda refs: [r * 2 for r in refs])
    said: list[str] = []
    assert ray_wait.wait([1, 2], "answers", 1.0, said.append) == [2, 4]
    assert said == []
