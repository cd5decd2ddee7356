"""Benchmark records: one JSON schema for every suite, a markdown table for people."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Record:
    suite: str
    case: str
    metric: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline_value in (None, 0):
            return None
        return self.value / self.baseline_value

    def as_json(self) -> dict[str, object]:
        return asdict(self) | {"ratio": self.ratio}


def commit() -> str:
    """The code measured: ``git describe --always --dirty`` of the package's checkout (a dirty
    tree says so), or ``unknown`` outside one."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine() -> str:
    """Cores, memory and the load average now: timings on a shared machine need all three."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return (
        f"{os.cpu_count()} cores, {pages / 2**30:.0f} GiB, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; load average {load}"
    )


@dataclass
class Report:
    suite: str
    records: list[Record] = field(default_factory=list)
    #: Lines printed above the table: settings, machine, anything a reader needs.
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def add(
        self,
        case: str,
        metric: str,
        value: float,
        unit: str,
        baseline: str | None = None,
        baseline_value: float | None = None,
    ) -> Record:
        record = Record(self.suite, case, metric, value, unit, baseline, baseline_value)
        self.records.append(record)
        ratio = f"  ({record.ratio:.2f}x {baseline})" if record.ratio is not None else ""
        self.progress(f"{case:<22} {metric:<14} {value:>12.4g} {unit}{ratio}")
        return record

    def note(self, line: str) -> None:
        self.notes.append(line)
        self.progress(line)

    def progress(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{self.suite} {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)

    def markdown(self) -> str:
        lines = [f"- {n}" for n in self.notes] + ([""] if self.notes else [])
        lines += [
            "| case | metric | value | unit | baseline | baseline value | ratio |",
            "|---|---|---:|---|---|---:|---:|",
        ]
        for r in self.records:
            base = "" if r.baseline_value is None else f"{r.baseline_value:.4g}"
            ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
            lines.append(
                f"| {r.case} | {r.metric} | {r.value:.4g} | {r.unit} | {r.baseline or ''} "
                f"| {base} | {ratio} |"
            )
        return "\n".join(lines)

    def write_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.as_json() for r in self.records], indent=1) + "\n")
