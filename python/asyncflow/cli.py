"""The ``asyncflow`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark suite and write its JSON records")
    bench.add_argument("suite", choices=["store"], help="which suite to run")
    bench.add_argument("--json", metavar="PATH", help="write the records here as JSON")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    store = sub.add_parser("store", help="the store daemon")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    serve = store_sub.add_parser(
        "serve",
        help="run the store daemon (same code and flags as asyncflow-store)",
        add_help=False,
    )
    serve.add_argument("flags", nargs=argparse.REMAINDER, help="asyncflow-store flags (--help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["store", "serve"]:
        # The daemon parses its own flags (the very parser of the asyncflow-store binary).
        from asyncflow.daemon import serve

        return serve(argv[2:])
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from asyncflow.bench import run_suite

        return run_suite(args.suite, json_path=args.json, quick=args.quick)
    return 2


if __name__ == "__main__":
    sys.exit(main())
