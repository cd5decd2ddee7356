"""The algorithms side by side on a built-in task:
``python benches/algorithms.py OUT_DIR [PNG] [--only=KEY,...] [--task=addition|tools]`` runs
the default job (2-digit addition, the default model and RL settings, hf engines) cut to the
held-out test's size (a warm start of 450 steps, then 4 RL steps, 200 held-out problems) for
seeds 0-2 with each algorithm below, and prints a markdown table of held-out accuracy before and
after RL and of RL wall-clock less the evaluation at the last step, which the trainer waits for
inside RL (mean and range over the seeds that finished); with PNG it also draws them into that
file. Runs already in OUT_DIR are read, not run again; ``--only`` runs just those algorithms
(key: the first word of a name, lower case), and the table shows every algorithm with results
in OUT_DIR. A run that fails prints its error, is counted as failed in the table (its full
output stays in ``OUT_DIR/<key>-seed<S>.log``), and makes the script exit non-zero.

The settings are fixed here before any run, from the papers' published values (DAPO: clip_high
0.28, token-mean loss; GSPO: sequence ratios; REINFORCE++: batch-normalised advantages; PPO: GAE
with gamma 1 and lambda 0.95 and a value clip of 0.2, from Ziegler et al. 2019, arXiv 1909.08593,
``lm-human-preferences/train_policy.py``), never tuned on these results. Each seed's warm start
is the same for every algorithm.

``--task=tools`` runs the multi-turn tool-use job instead (``examples/tools.yaml``: 3- and
4-digit products through the calculator tool, its sandboxed process and lognormal latency,
staleness 1), with hf engines, cut to 10 RL steps; its warm start (600 steps) is made once per
seed by the seed's first run and copied into the others. The step count was fixed before any
run: the first evaluation point of that job's measured runs (docs/agents.md).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncflow.bench.e2e_suite import SHARED, copy_warm_start, read_run, rl_seconds

SEEDS = (0, 1, 2)
DASH = "\u2013"
ENGINES_AND_QUIET = [
    "rollout.engine=hf",
    "trainer.engine=hf",
    "run.progress=false",
    "run.checkpoint_every=100",
    "run.eval_every=100",
]
#: Per task: the arguments of every run, and its RL steps.
TASKS: dict[str, tuple[list[str], int]] = {
    "addition": (["data.eval_size=200", "warm_start.steps=450", *ENGINES_AND_QUIET], 4),
    "tools": (
        [
            "--config",
            str(Path(__file__).parents[1] / "examples" / "tools.yaml"),
            *ENGINES_AND_QUIET,
        ],
        10,
    ),
}
ALGORITHMS = {
    "GRPO (PPO-clip)": [],
    "DAPO": [
        "algorithm.filter_groups=true",
        "algorithm.clip_high=0.28",
        "algorithm.loss_aggregation=token-mean",
        "algorithm.overlong=filter",
    ],
    "RLOO": ["algorithm.advantage=rloo"],
    "GSPO": ["algorithm.policy_loss=gspo"],
    "REINFORCE++": ["algorithm.advantage=reinforce++"],
    "PPO (GAE, critic)": ["algorithm.advantage=gae"],
}
#: Lines of a failed run's output shown with its error.
TAIL = 30


def key(name: str) -> str:
    return name.split(maxsplit=1)[0].lower()


def run(
    out: Path, task: str, name: str, seed: int, overrides: list[str]
) -> dict[str, float] | None:
    """One seed of one algorithm: its figures, or None (its error printed) if it failed."""
    run_dir = out / f"{key(name)}-seed{seed}"
    summary_file = run_dir / "summary.json"
    if not summary_file.exists():
        shutil.rmtree(run_dir, ignore_errors=True)  # what a failed earlier try left
        if task == "tools":
            reuse_warm_start(out, seed, run_dir)
        cli = str(Path(sys.executable).parent / "asyncflow")
        common, steps = TASKS[task]
        command = [
            cli,
            "train",
            "--run-dir",
            str(run_dir),
            *common,
            f"trainer.max_steps={steps}",
            f"run.seed={seed}",
            *overrides,
        ]
        log = out / f"{key(name)}-seed{seed}.log"
        with log.open("w") as f:
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
        if done.returncode != 0 or not summary_file.exists():
            tail = log.read_text(errors="replace").splitlines()[-TAIL:]
            print(
                f"FAILED: {name} seed {seed} (exit {done.returncode}); last lines of {log}:",
                *tail,
                sep="\n",
                file=sys.stderr,
                flush=True,
            )
            return None
    summary, history = read_run(run_dir)
    return {
        "seed": seed,
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        # Less the evaluation at the last step, which the trainer waits for inside RL.
        "rl_seconds": rl_seconds(summary, history),
    }


def reuse_warm_start(out: Path, seed: int, run_dir: Path) -> None:
    """Copies the seed's warm-started model from a run of it that has one, if any."""
    first = next(
        (
            other
            for other in sorted(out.glob(f"*-seed{seed}"))
            if other != run_dir and all((other / name).is_dir() for name in SHARED)
        ),
        None,
    )
    copy_warm_start(first, run_dir)


def cell(values: list[float], digits: int) -> str:
    if not values:
        return "n/a"
    mean = statistics.mean(values)
    return f"{mean:.{digits}f} ({min(values):.{digits}f}{DASH}{max(values):.{digits}f})"


def plot(out: Path, png: Path, steps: int) -> None:
    """Held-out accuracy after RL, each seed a dot and the mean a bar, per algorithm."""
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, secs) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [n for n in ALGORITHMS if finished(out, n)]
    for i, name in enumerate(names):
        results = finished(out, name)
        for axis, figure in [(acc, "after"), (secs, "rl_seconds")]:
            values = [r[figure] for r in results]
            axis.bar(i, statistics.mean(values), color="lightsteelblue")
            axis.plot([i] * len(values), values, "o", color="black", markersize=4)
        acc.plot([i - 0.4, i + 0.4], [statistics.mean(r["before"] for r in results)] * 2, "r--")
    for axis, title in [(acc, f"held-out accuracy after {steps} RL steps"), (secs, "RL seconds")]:
        axis.set_xticks(range(len(names)), [n.split()[0] for n in names], fontsize=8, rotation=20)
        axis.set_title(title)
    acc.set_ylim(0, 1)
    fig.suptitle("seeds 0-2 (dots), mean (bar), accuracy before RL (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def finished(out: Path, name: str) -> list[dict[str, Any]]:
    """The seeds of ``name`` that finished, as recorded by the last run of it."""
    path = out / f"{key(name)}.json"
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text()) if r.get("after") is not None]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    options = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    wanted = set(options["only"].split(",")) if "only" in options else {key(n) for n in ALGORITHMS}
    task = options.get("task", "addition")
    if task not in TASKS or len(args) not in (1, 2):
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR [PNG] [--only=KEY,...] [--task={'|'.join(TASKS)}]")
    steps = TASKS[task][1]
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    recorded_task = out / "task"
    if recorded_task.exists() and recorded_task.read_text() != task:
        sys.exit(f"{out} holds runs of the {recorded_task.read_text()!r} task, not {task!r}")
    recorded_task.write_text(task)
    failed = 0
    for name, overrides in ALGORITHMS.items():
        if key(name) not in wanted:
            continue
        results = [run(out, task, name, seed, overrides) for seed in SEEDS]
        failed += sum(r is None for r in results)
        recorded: list[dict[str, Any]] = [
            r if r is not None else {"seed": s, "after": None}
            for s, r in zip(SEEDS, results, strict=True)
        ]
        (out / f"{key(name)}.json").write_text(json.dumps(recorded, indent=1))
    rows = []
    for name in ALGORITHMS:
        path = out / f"{key(name)}.json"
        if not path.exists():
            continue
        done = finished(out, name)
        rows.append(
            f"| {name} | {len(done)}/{len(json.loads(path.read_text()))} | "
            f"{cell([r['before'] for r in done], 3)} | "
            f"{cell([r['after'] for r in done], 3)} | "
            f"{cell([r['rl_seconds'] for r in done], 1)} |"
        )
    print(
        f"| algorithm | seeds finished | accuracy before RL | after {steps} RL steps | RL seconds |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"finished {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    if len(args) > 1:
        plot(out, Path(args[1]), steps)
    if failed:
        sys.exit(f"{failed} run(s) failed; see the errors above")


if __name__ == "__main__":
    main()
