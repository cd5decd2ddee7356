"""Benchmark entry point: ``python benches/run.py SUITE --json PATH`` (same as ``asyncflow bench``;
``make bench`` runs every suite into ``bench-out/``).

Suites (``store``, ``sched``, ``pipeline``, ``sim``, ``e2e``) measure their figures and a baseline
in the same run and write JSON records, a markdown table and a PNG figure; the latest full results
are in ``benches/RESULTS.md``.
"""

from __future__ import annotations

import sys

from asyncflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
