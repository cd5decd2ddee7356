"""The ``sched`` benchmark suite runs and reports in the shared record schema, and its imbalance
figures agree with a greedy LPT and a lower bound computed here, independently of the scheduler."""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import numpy as np
import pytest

from asyncflow.bench import run_suite
from asyncflow.bench.sched_suite import draw
from asyncflow.scheduler import partition


def greedy_lpt_imbalance(lengths: np.ndarray, k: int) -> float:
    """Largest part ÷ mean part when each row, longest first, goes to the least-loaded part.
    (Ties do not matter: parts of equal load are interchangeable, and so are rows of equal
    length.)"""
    loads = [0.0] * k
    for length in sorted(lengths.astype(np.float64), reverse=True):
        heapq.heapreplace(loads, loads[0] + length)
    return max(loads) / (float(lengths.sum()) / k)


def lower_bound(lengths: np.ndarray, k: int) -> float:
    """No split does better than the longest row alone, or than equal parts."""
    mean = float(lengths.sum()) / k
    return max(float(lengths.max()), mean) / mean


def imbalance_of(lengths: np.ndarray, parts: list[list[int]]) -> float:
    assert sorted(i for p in parts for i in p) == list(range(len(lengths))), "a partition"
    loads = [float(lengths[p].sum()) for p in parts]
    return max(loads) / (float(lengths.sum()) / len(parts))


def test_the_sched_suite_writes_every_case_with_its_baselines(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    assert run_suite("sched", json_path=str(out), quick=True) == 0
    records = json.loads(out.read_text())
    keys = {"suite", "case", "metric", "value", "unit", "baseline", "baseline_value", "ratio"}
    assert all(set(r) == keys and r["suite"] == "sched" for r in records)
    cases = {r["case"] for r in records}
    assert len(cases) == 3 * 2 * 3 and "pareto/4096/64" in cases
    beaten = []
    for case in sorted(cases):
        mine = {(r["metric"], r["baseline"]): r for r in records if r["case"] == case}
        dist, rows, parts = case.split("/")
        k = int(parts)
        lengths = draw(dist, int(rows))
        bound, lpt = lower_bound(lengths, k), greedy_lpt_imbalance(lengths, k)
        assert mine["imbalance_bound", None]["value"] == pytest.approx(bound, rel=1e-12)
        assert mine["imbalance", "lpt"]["baseline_value"] == pytest.approx(lpt, rel=1e-12), case
        for baseline in ("round_robin", "lpt", "kk"):
            record = mine["imbalance", baseline]
            assert record["ratio"] == record["value"] / record["baseline_value"]
        ours = mine["imbalance", "lpt"]["value"]
        assert bound * (1 - 1e-12) <= ours <= lpt * (1 + 1e-12), f"{case}: worse than LPT"
        if lpt > bound * (1 + 1e-6):
            beaten.append(ours < lpt * (1 - 1e-9))
        assert mine["partition_time", "lpt"]["unit"] == "us"
    # Greedy LPT leaves room on these long-tailed lengths, and the default partitioner takes it.
    assert len(beaten) >= 15, "cases where LPT misses the bound"
    assert sum(beaten) >= len(beaten) - 2, "cases where the default split is strictly better"


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_the_default_split_is_optimal_where_lpt_is_provably_not(k: int) -> None:
    # Graham's instance: two rows each of 2k-1 down to k+1, and three of k. LPT's largest part
    # is 4k-1; three rows to a part make every part 3k.
    lengths = np.array([*(n for n in range(2 * k - 1, k, -1) for _ in range(2)), k, k, k])
    assert greedy_lpt_imbalance(lengths, k) == pytest.approx((4 * k - 1) / (3 * k))
    assert lower_bound(lengths, k) == 1.0
    assert imbalance_of(lengths, partition(lengths, k)) == 1.0
