"""The ``sched`` benchmark suite runs and reports in the shared record schema."""

from __future__ import annotations

import json
from pathlib import Path

from asyncflow.bench import run_suite


def test_the_sched_suite_writes_every_case_with_its_baselines(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    assert run_suite("sched", json_path=str(out), quick=True) == 0
    records = json.loads(out.read_text())
    keys = {"suite", "case", "metric", "value", "unit", "baseline", "baseline_value", "ratio"}
    assert all(set(r) == keys and r["suite"] == "sched" for r in records)
    cases = {r["case"] for r in records}
    assert len(cases) == 3 * 2 * 3 and "pareto/4096/64" in cases
    for case in cases:
        mine = {(r["metric"], r["baseline"]): r for r in records if r["case"] == case}
        bound = mine["imbalance_bound", None]["value"]
        for baseline in ("round_robin", "lpt", "kk"):
            record = mine["imbalance", baseline]
            assert bound * (1 - 1e-9) <= record["value"]
            assert record["ratio"] == record["value"] / record["baseline_value"]
        assert mine["imbalance", "lpt"]["ratio"] <= 1.0, "never worse than LPT"
        assert mine["partition_time", "lpt"]["unit"] == "us"
