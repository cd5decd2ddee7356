"""The benchmark harness behind ``asyncflow bench SUITE``.

Benchmarks are not tests: each suite measures its figures and a baseline in the same run and
reports ``ratio = value / baseline_value``. Records follow one JSON schema (see ``records.py``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from asyncflow.bench.records import Report

#: Suite name -> module exposing ``run(report, quick)``.
SUITES = {"store": "asyncflow.bench.store_suite", "sched": "asyncflow.bench.sched_suite"}


def run_suite(name: str, json_path: str | None = None, quick: bool = False) -> int:
    """Runs one suite, prints its table, and writes its records to ``json_path``."""
    module = importlib.import_module(SUITES[name])
    report = Report(name)
    module.run(report, quick=quick)
    print(report.markdown())
    if json_path:
        report.write_json(Path(json_path))
        print(f"wrote {len(report.records)} records to {json_path}")
    return 0
