"""Readers of what a finished run leaves in its directory, for the tests that check runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def busy_spans(run_dir: Path) -> dict[str, set[str]]:
    """The names of each role's busy spans in the run's trace (``generate v3`` -> ``generate``):
    what each worker did, not only that it ran (a role that only waited has none)."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    roles = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    busy: dict[str, set[str]] = {role: set() for role in roles.values()}
    for e in events:
        if e["ph"] == "X" and e["cat"] == "busy":
            busy[roles[e["tid"]]].add(e["name"].split(" v")[0])
    return busy


def ledger(run_dir: Path) -> list[dict[str, Any]]:
    """Which prompt groups each step trained, one record per step."""
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def trained_groups(run_dir: Path) -> list[int]:
    """Every prompt group the run trained, in order, with repeats kept."""
    return sorted(g for step in ledger(run_dir) for g in step["trained"])
