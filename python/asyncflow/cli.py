"""The ``asyncflow`` command line: ``train``, ``bench``, ``reliability``, ``store serve``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflow.bench import SUITES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncflow", description="Asynchronous streaming RL post-training."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train", help="run RL post-training (no arguments: the embedded default)"
    )
    train.add_argument("--config", metavar="FILE", type=_path, help="YAML config (see examples/)")
    train.add_argument("--run-dir", metavar="DIR", type=_path, help="write the run here")
    train.add_argument("--launcher", choices=["local", "ray"], help="where workers run")
    train.add_argument("--resume", metavar="DIR", type=_path, help="continue the run in DIR")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=3")

    bench = sub.add_parser(
        "bench", help="run a benchmark suite; write its JSON records, table (.md) and figure (.png)"
    )
    bench.add_argument("suite", choices=sorted(SUITES), help="which suite to run")
    bench.add_argument("--json", metavar="PATH", type=_path, help="write the records here as JSON")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    bench.add_argument(
        "--costs", metavar="FILE", type=_path, help="cost model YAML of the pipeline and sim suites"
    )
    bench.add_argument(
        "--cases",
        metavar="NAMES",
        help="e2e only: comma-separated parts to run, of staleness, peers, partial, tools "
        "(default: all but tools)",
    )
    bench.add_argument(
        "--seeds",
        metavar="SEEDS",
        help="e2e only: comma-separated seeds to run, of 0, 1, 2 (default: all); each seed's "
        "runs are compared with baselines of the same seed, so seeds may run apart",
    )
    bench.add_argument(
        "--task",
        choices=["tools"],
        help="e2e only: run the multi-turn tools job's cases (the same as --cases tools)",
    )
    rel = sub.add_parser(
        "reliability",
        help="inject faults many times, soak, and write the report (docs/reliability.md)",
    )
    rel.add_argument("--out", type=_path, default=Path("docs/reliability.md"), help="report path")
    rel.add_argument("--trials", type=int, default=20, help="trials of each fault")
    rel.add_argument("--soak-seconds", type=float, default=60.0, help="length of each soak")
    rel.add_argument("--fuzz-log", type=_path, help="output of the cargo fuzz run to report")
    rel.add_argument("--examples", type=int, default=500, help="hypothesis examples per test")
    rel.add_argument(
        "--render-only", action="store_true", help="rewrite the report from the kept results"
    )
    store = sub.add_parser("store", help="the store daemon")
    store_sub = store.add_subparsers(dest="store_command", required=True)
    serve = store_sub.add_parser(
        "serve",
        help="run the store daemon (same code and flags as asyncflow-store)",
        add_help=False,
    )
    serve.add_argument("flags", nargs=argparse.REMAINDER, help="asyncflow-store flags (--help)")
    data = sub.add_parser("data", help="make built-in datasets").add_subparsers(
        dest="data_command", required=True
    )
    make = data.add_parser("make", help="write a generated dataset as parquet")
    make.add_argument("dataset", choices=["gsm-synthetic"], help="which dataset")
    make.add_argument("--out", type=_path, required=True, help="directory for the parquet files")
    make.add_argument("--train", type=_count, default=4000, help="training problems")
    make.add_argument("--test", type=_count, default=200, help="held-out problems")
    make.add_argument("--seed", type=int, default=0, help="generator seed")
    return parser


def _path(text: str) -> Path:
    """A file or directory given on the command line; a leading ``~`` is the user's home even
    where the shell left it (``--run-dir=~/x``, or quoted)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        user = text.partition("/")[0]
        raise argparse.ArgumentTypeError(f"no home directory for {user}") from None


def _count(text: str) -> int:
    """A number of problems: at least one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _check_not_overwritten(args: argparse.Namespace, config: Any) -> None:
    """Refuses ``--config`` when it is the ``config.yaml`` a new run writes in ``--run-dir`` and
    holds more than those settings (comments, a file of one's own): it would be replaced."""
    from asyncflow.errors import ConfigError

    if args.config is None or args.run_dir is None or args.resume is not None:
        return
    given, written = Path(args.config), args.run_dir / "config.yaml"
    same = written.exists() and given.resolve() == written.resolve()
    if same and given.read_text() != config.to_yaml():
        raise ConfigError(
            f"--config {given} is the file the run writes its settings to in --run-dir "
            f"{args.run_dir}, and would be replaced: keep it elsewhere"
        )


def _train(args: argparse.Namespace) -> int:
    from asyncflow import config as cfg
    from asyncflow.errors import ConfigError
    from asyncflow.train import train

    overrides = list(args.overrides)
    if args.launcher:
        overrides.append(f"launcher={args.launcher}")
    try:
        if args.resume is not None:
            saved = args.resume / "config.yaml"
            if not saved.is_file():
                raise ConfigError(
                    f"--resume {args.resume}: no config.yaml there; is it a run directory?"
                )
            config = cfg.load(args.config or saved, overrides)
        else:
            config = cfg.load(args.config, overrides)
        _check_not_overwritten(args, config)
    except (ConfigError, OSError, UnicodeError) as e:
        print(f"asyncflow train: invalid configuration: {e}", file=sys.stderr)
        return 2
    _stop_on_sigterm()
    try:
        summary = train(config, run_dir=args.run_dir, resume=args.resume)
    except ConfigError as e:
        print(f"asyncflow train: invalid configuration: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncflow train: interrupted (the run's processes were stopped)", file=sys.stderr)
        return 130
    print(f"summary written to {summary['run_dir']}/summary.json")
    return 0


def _stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a scheduler ending the job) stops the run as Ctrl-C does: its cleanup
    runs (the store daemon and engines it started are stopped, the trace written), then it exits
    with status 143. Without this the process died at once and left its children running."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


#: The thread settings of the command's own processes: one thread each (see below).
ONE_THREAD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _one_thread_per_worker() -> None:
    """Each worker (rollout, trainer, ...) computes on its own core. Several OpenMP threads per
    kernel oversubscribe small machines badly (measured 7x slower on 2 cores), and vLLM's CPU
    worker ignores later changes, so this is set before torch is imported."""
    for var in ONE_THREAD:
        os.environ.setdefault(var, "1")


def main(argv: Sequence[str] | None = None) -> int:
    _one_thread_per_worker()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["store", "serve"]:
        # The daemon parses its own flags (the very parser of the asyncflow-store binary).
        from asyncflow.daemon import serve

        return serve(argv[2:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse takes a command's positionals in one run: key=value overrides after an
        # option (asyncflow train a=1 --run-dir D b=2) are left over, and are overrides too.
        if args.command != "train" or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.command == "train":
        return _train(args)
    if args.command == "bench":
        from asyncflow.bench import ArgumentError, run_suite
        from asyncflow.daemon import TOKEN_ENV, new_token

        cases = tuple(args.cases.split(",")) if args.cases else None
        if args.task == "tools":
            if cases is not None and cases != ("tools",):
                parser.error("--task tools runs the tools cases; leave out --cases")
            cases = ("tools",)
        seeds = None
        if args.seeds:
            try:
                seeds = tuple(dict.fromkeys(int(x) for x in args.seeds.split(",")))
            except ValueError:
                parser.error(f"--seeds takes comma-separated seeds, not {args.seeds!r}")
        # The daemons a suite starts, and the client processes it starts, take the token from
        # here: on loopback without one, any local user could read and clear their rows.
        os.environ.setdefault(TOKEN_ENV, new_token())
        _stop_on_sigterm()  # a suite's daemons and worker processes are stopped with it
        try:
            return run_suite(
                args.suite,
                json_path=args.json,
                quick=args.quick,
                costs=None if args.costs is None else str(args.costs),
                cases=cases,
                seeds=seeds,
            )
        except ArgumentError as e:  # raised before the suite runs anything
            parser.error(str(e))
    if args.command == "data":
        from asyncflow.tasks import gsm_synthetic

        for path in gsm_synthetic.write(args.out, args.train, args.test, args.seed):
            print(f"wrote {path}")
        return 0
    if args.command == "reliability":
        from asyncflow.reliability.report import run

        return run(
            args.out,
            args.trials,
            args.soak_seconds,
            args.fuzz_log,
            args.examples,
            render_only=args.render_only,
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
