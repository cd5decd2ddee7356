"""The benchmark harness behind ``asyncflow bench SUITE``.

Benchmarks are not tests: each suite measures its figures and a baseline in the same run and
reports ``ratio = value / baseline_value``. Records follow one JSON schema (see ``records.py``);
beside the JSON go a markdown table (``.md``) and a figure (``.png``).
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from asyncflow.bench.plots import write_png
from asyncflow.bench.records import Report, commit, machine

#: Suite name -> module exposing ``run(report, quick)``.
SUITES = {
    "store": "asyncflow.bench.store_suite",
    "sched": "asyncflow.bench.sched_suite",
    "pipeline": "asyncflow.bench.pipeline_suite",
    "sim": "asyncflow.bench.sim_suite",
    "e2e": "asyncflow.bench.e2e_suite",
    "weights": "asyncflow.bench.weights_suite",
}
#: Suites that read a cost model (``costs_path``; default ``costs/paper-7b.yaml``).
COSTED = ("pipeline", "sim")


class ArgumentError(ValueError):
    """A suite asked for with options it does not take; nothing has run."""


def check_arguments(
    name: str,
    json_path: str | Path | None,
    costs: str | None,
    cases: tuple[str, ...] | None,
    seeds: tuple[int, ...] | None,
) -> None:
    """Refuses options that ``name`` does not take or cannot use, before it runs."""
    if costs is not None and name not in COSTED:
        raise ArgumentError(f"suite {name!r} reads no cost model; --costs is for {COSTED}")
    if costs is not None and not Path(costs).is_file():
        raise ArgumentError(f"--costs {costs}: no such file")
    if (cases is not None or seeds is not None) and name != "e2e":
        raise ArgumentError(
            f"suite {name!r} has no parts to choose; --cases and --seeds are for e2e"
        )
    if json_path is not None and Path(json_path).suffix in (".md", ".png"):
        raise ArgumentError(
            f"--json {json_path}: the table (.md) and figure (.png) are written beside the JSON "
            "records, under the same name; give the records a name of their own (.json)"
        )


def run_suite(
    name: str,
    json_path: str | Path | None = None,
    quick: bool = False,
    costs: str | None = None,
    cases: tuple[str, ...] | None = None,
    seeds: tuple[int, ...] | None = None,
) -> int:
    """Runs one suite, prints its table, and writes its records to ``json_path`` (with the
    table and figure beside it). ``cases`` and ``seeds``: the parts and seeds of the ``e2e``
    suite to run."""
    check_arguments(name, json_path, costs, cases, seeds)
    module = importlib.import_module(SUITES[name])
    report = Report(name)
    report.note(f"{time.strftime('%Y-%m-%d %H:%M')}, commit {commit()}, {machine()}")
    options: dict[str, object] = {"costs_path": costs} if costs else {}
    if cases is not None:
        options["cases"] = cases
    if seeds is not None:
        options["seeds"] = seeds
    module.run(report, quick=quick, **options)
    report.note(f"finished after {time.monotonic() - report.started:.0f}s; {machine()}")
    print(report.markdown())
    if json_path:
        path = Path(json_path)
        report.write_json(path)
        path.with_suffix(".md").write_text(report.markdown() + "\n")
        write_png(report, path.with_suffix(".png"))
        print(f"wrote {len(report.records)} records to {path}, with its .md table and .png figure")
    return 0
