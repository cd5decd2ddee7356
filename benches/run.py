"""Benchmark entry point: ``python benches/run.py SUITE --json PATH`` (same as ``asyncflow bench``).

Suites measure their figures and a baseline in the same run; results go to ``benches/RESULTS.md``.
"""

from __future__ import annotations

import sys

from asyncflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
