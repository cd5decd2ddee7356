"""The ``sched`` suite: how evenly a training step's rows are split over data-parallel ranks.

Cases ``<dist>/<rows>/<k>``: response lengths drawn from a lognormal, a bimodal (short answers
and long reasoning traces) and a Pareto distribution, 1024 or 4096 rows, k = 8, 32 or 64 parts.

- ``imbalance``: largest part cost ÷ mean part cost (1.0 is perfect) of the default partitioner,
  against round-robin (no balancing), greedy LPT and plain largest differencing (KK), each
  measured on the same lengths in the same run.
- ``imbalance_bound``: the best any split can do, ``max(largest row, total / k) ÷ mean``; a long
  row bigger than a mean part makes 1.0 unattainable.
- ``partition_time`` (µs): one call of ``asyncflow.scheduler.partition`` from Python, result
  lists included; best of several, against greedy LPT through the same call.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import numpy as np

from asyncflow.bench.records import Report
from asyncflow.scheduler import Method, partition

#: Longest response a rollout produces (tokens); draws beyond it are cut there.
MAX_LENGTH = 32_768
ROWS = (1024, 4096)
PARTS = (8, 32, 64)
BASELINES: tuple[Method, ...] = ("round_robin", "lpt", "kk")


def lognormal(rng: np.random.Generator, n: int) -> np.ndarray:
    """Median about 670 tokens with a long right tail."""
    return rng.lognormal(mean=6.5, sigma=1.0, size=n)


def bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    """70 % short answers around 500 tokens, 30 % reasoning traces around 8000."""
    long = rng.random(n) < 0.3
    return np.where(long, rng.normal(8000, 1500, n), rng.normal(500, 100, n))


def pareto(rng: np.random.Generator, n: int) -> np.ndarray:
    """Heavy tail: at least 200 tokens, tail index 1.5."""
    return 200 * (1 + rng.pareto(1.5, n))


DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "lognormal": lognormal,
    "bimodal": bimodal,
    "pareto": pareto,
}


def draw(dist: str, n: int) -> np.ndarray:
    # Seeded by the case, so every run measures the same lengths.
    rng = np.random.default_rng(zlib.crc32(f"{dist}/{n}".encode()))
    lengths: np.ndarray = np.clip(np.rint(DISTRIBUTIONS[dist](rng, n)), 1, MAX_LENGTH)
    return lengths.astype(np.uint64)


def imbalance(lengths: np.ndarray, parts: list[list[int]]) -> float:
    costs = lengths.astype(np.float64)
    loads = [costs[p].sum() for p in parts]
    return float(max(loads) / (costs.sum() / len(parts)))


def partition_time_us(repeats: int, lengths: np.ndarray, k: int, method: Method) -> float:
    """The fastest of ``repeats`` calls, in µs: the least disturbed by a busy machine."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        partition(lengths, k, method=method)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def measure(report: Report, case: str, lengths: np.ndarray, k: int, repeats: int) -> None:
    report.progress(f"{case}: balanced vs {', '.join(BASELINES)}")
    ours = imbalance(lengths, partition(lengths, k))
    for baseline in BASELINES:
        theirs = imbalance(lengths, partition(lengths, k, method=baseline))
        report.add(case, "imbalance", ours, "x", baseline, theirs)
    total, longest = float(lengths.sum()), float(lengths.max())
    report.add(case, "imbalance_bound", max(longest, total / k) / (total / k), "x")
    ours_us = partition_time_us(repeats, lengths, k, "balanced")
    lpt_us = partition_time_us(repeats, lengths, k, "lpt")
    report.add(case, "partition_time", ours_us, "us", "lpt", lpt_us)


def run(report: Report, quick: bool = False) -> None:
    repeats = 5 if quick else 50
    for dist in DISTRIBUTIONS:
        for rows in ROWS:
            lengths = draw(dist, rows)
            for k in PARTS:
                measure(report, f"{dist}/{rows}/{k}", lengths, k, repeats)
