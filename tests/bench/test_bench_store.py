"""The store suite's baselines: the ``tcp/*`` cases' native echo sends back exactly the bytes it
was sent, round after round, and every peer is timed on exactly our work; the scale case's
claimers all get full batches (a short one fails it)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncflow.bench import peer_cases, scale_cases
from asyncflow.bench.echo import EchoPeer
from asyncflow.bench.records import Report
from asyncflow.bench.workload import Rounds, latency_samples, repeats


def test_every_round_comes_back_byte_for_byte() -> None:
    # Rows of an odd size, so rounds straddle the echo's reads; not a multiple of its chunk.
    block = np.random.default_rng(7).integers(0, 256, (3, 700_001), dtype=np.uint8)
    with EchoPeer() as echo:
        for rounds in (1, 6):
            back = np.zeros_like(block)
            assert echo.round_trips(block, rounds, back) > 0
            assert np.array_equal(back, block)


def test_a_back_buffer_of_another_size_is_refused() -> None:
    block = np.ones((4, 1024), dtype=np.uint8)
    with EchoPeer() as echo:
        with pytest.raises(ValueError, match="bytes"):
            echo.round_trips(block, 1, np.empty((4, 1000), dtype=np.uint8))
        back = np.zeros_like(block)
        echo.round_trips(block, 2, back)  # the connection is still usable
        assert np.array_equal(back, block)


def test_peers_are_timed_on_our_rounds_repeats_and_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timed: list[tuple[str, int, int]] = []
    sampled: list[tuple[str, int, int]] = []

    def peer(name: str) -> peer_cases.Setup:
        def setup(quick: bool) -> tuple[peer_cases.Timing, peer_cases.Latency]:
            def rounds(work: Rounds) -> float:
                timed.append((name, work.rounds, work.block.nbytes))
                return 1.0

            def latency(size: int, samples: int) -> tuple[float, float]:
                sampled.append((name, size, samples))
                return 1.0, 2.0

            return rounds, latency

        return setup

    monkeypatch.setattr(peer_cases, "PEERS", {"transferqueue": peer("tq"), "ray": peer("ray")})
    report = Report("store")
    for metric in ("throughput", "claim_p50", "claim_p99"):
        report.add("shm/64KiB", metric, 1.0, "x")
    peer_cases.run(report, {"64KiB": 64 << 10}, quick=False)

    ours = Rounds.of(64 << 10, quick=False)
    for name in ("tq", "ray"):
        assert [t for t in timed if t[0] == name] == [
            (name, ours.rounds, ours.block.nbytes)
        ] * repeats(quick=False)
        assert [s for s in sampled if s[0] == name] == [(name, 64 << 10, latency_samples(False))]
    metrics = {(r.case, r.metric): r.baseline_value for r in report.records}
    # Ray has no claim: its figure is named for what it is, a hand-off, beside our claim.
    assert ("ray/64KiB", "handoff_p50") in metrics and ("ray/64KiB", "claim_p50") not in metrics
    assert metrics[("transferqueue/64KiB", "claim_p99")] == 1.0


def test_the_scale_case_claims_full_batches_from_every_claimer_and_counts_each_put() -> None:
    got = scale_cases.measure(rows=4096, claims=20, puts=1, processes=2, threads=2)
    assert 0 < got["claim_p50"] <= got["claim_p99"]
    assert got["put_rows"] > 0
