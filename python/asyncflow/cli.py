"""The ``asyncflow`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from asyncflow.bench import SUITES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark suite and write its JSON records")
    bench.add_argument("suite", choices=sorted(SUITES), help="which suite to run")
    bench.add_argument("--json", metavar="PATH", help="write the records here as JSON")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from asyncflow.bench import run_suite

        return run_suite(args.suite, json_path=args.json, quick=args.quick)
    return 2


if __name__ == "__main__":
    sys.exit(main())
