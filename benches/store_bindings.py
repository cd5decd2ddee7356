"""The ``store`` suite's cases that go through the Python bindings (``inproc``, ``tcp``, ``shm``:
throughput, claim latency, field-ready updates), at the suite's full settings, without its
persistence and peer cases: ``python benches/store_bindings.py OUT.json`` (about 20 s on 2 CPU
cores). Used to compare two builds of the bindings run by turns: point ``PYTHONPATH`` at each
build's ``python/`` directory (with its own compiled ``_native`` module) and alternate the runs.
Writes the records as JSON and a markdown table beside them (``OUT.md``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncflow.bench import daemon_cases, store_suite
from asyncflow.bench.records import Report, machine
from asyncflow.bench.workload import resident_claim_latencies

CLAIM_SAMPLES = 5000


def main(out: Path) -> None:
    report = Report("store")
    report.note(machine())
    for label, size in store_suite.SIZES.items():
        store_suite.throughput(report, label, size, quick=False)
    base50, base99 = resident_claim_latencies(1 << 10, CLAIM_SAMPLES)
    p50, p99 = resident_claim_latencies(1_000_000, CLAIM_SAMPLES)
    report.add("inproc/1KiB", "claim_p50", p50, "us", "1K-resident", base50)
    report.add("inproc/1KiB", "claim_p99", p99, "us", "1K-resident", base99)
    ours, baseline = store_suite.ready_updates(quick=False)
    report.add("inproc/1KiB", "ready_updates", ours, "1/s", "python-set-index", baseline)
    daemon_cases.run(report, store_suite.SIZES, quick=False)
    report.write_json(out)
    out.with_suffix(".md").write_text(report.markdown() + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
