"""The algorithms side by side on the built-in task: ``python benches/algorithms.py OUT_DIR``
runs the default job (2-digit addition, the default model and RL settings, hf engines) cut to the
held-out test's size (a warm start of 450 steps, then 4 RL steps, 200 held-out problems) for
seeds 0-2 with each algorithm below, and prints a markdown table of held-out accuracy before and
after RL and of RL wall-clock (mean and range over the seeds); with a second argument it also
draws them into that PNG. Runs already in OUT_DIR are read, not run again.

The settings are fixed here before any run, from the papers' published values (DAPO: clip_high
0.28, token-mean loss; GSPO: sequence ratios; REINFORCE++: batch-normalised advantages), never
tuned on these results. Each seed's warm start is the same for every algorithm.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SEEDS = (0, 1, 2)
DASH = "\u2013"
COMMON = [
    "data.eval_size=200",
    "warm_start.steps=450",
    "trainer.max_steps=4",
    "rollout.engine=hf",
    "trainer.engine=hf",
    "run.progress=false",
    "run.checkpoint_every=100",
    "run.eval_every=100",
]
ALGORITHMS = {
    "GRPO (PPO-clip)": [],
    "DAPO": [
        "algorithm.filter_groups=true",
        "algorithm.clip_high=0.28",
        "algorithm.loss_aggregation=token-mean",
        "algorithm.overlong=filter",
    ],
    "GSPO": ["algorithm.policy_loss=gspo"],
    "REINFORCE++": ["algorithm.advantage=reinforce++"],
}


def run(out: Path, name: str, seed: int, overrides: list[str]) -> dict[str, float]:
    run_dir = out / f"{name.split()[0].lower()}-seed{seed}"
    summary_file = run_dir / "summary.json"
    if not summary_file.exists():
        cli = str(Path(sys.executable).parent / "asyncflow")
        command = [cli, "train", "--run-dir", str(run_dir), *COMMON, f"run.seed={seed}", *overrides]
        subprocess.run(command, check=True, capture_output=True)
    summary = json.loads(summary_file.read_text())
    return {
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "rl_seconds": summary["phase_seconds"].get("rl", float("nan")),
    }


def cell(values: list[float], digits: int) -> str:
    mean = statistics.mean(values)
    return f"{mean:.{digits}f} ({min(values):.{digits}f}{DASH}{max(values):.{digits}f})"


def plot(out: Path, png: Path) -> None:
    """Held-out accuracy after RL, each seed a dot and the mean a bar, per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, secs) = plt.subplots(1, 2, figsize=(9, 3.5))
    for i, name in enumerate(ALGORITHMS):
        results = json.loads((out / f"{name.split()[0].lower()}.json").read_text())
        for axis, key in [(acc, "after"), (secs, "rl_seconds")]:
            values = [r[key] for r in results]
            axis.bar(i, statistics.mean(values), color="lightsteelblue")
            axis.plot([i] * len(values), values, "o", color="black", markersize=4)
        acc.plot([i - 0.4, i + 0.4], [statistics.mean(r["before"] for r in results)] * 2, "r--")
    for axis, title in [(acc, "held-out accuracy after 4 RL steps"), (secs, "RL seconds")]:
        axis.set_xticks(range(len(ALGORITHMS)), [n.split()[0] for n in ALGORITHMS])
        axis.set_title(title)
    acc.set_ylim(0, 1)
    fig.suptitle("seeds 0-2 (dots), mean (bar), accuracy before RL (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, overrides in ALGORITHMS.items():
        results = [run(out, name, seed, overrides) for seed in SEEDS]
        (out / f"{name.split()[0].lower()}.json").write_text(json.dumps(results, indent=1))
        rows.append(
            f"| {name} | {cell([r['before'] for r in results], 3)} | "
            f"{cell([r['after'] for r in results], 3)} | "
            f"{cell([r['rl_seconds'] for r in results], 1)} |"
        )
        print(rows[-1], flush=True)
    print("| algorithm | held-out accuracy before RL | after 4 RL steps | RL seconds |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    print(f"finished {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    if len(sys.argv) > 2:
        plot(out, Path(sys.argv[2]))


if __name__ == "__main__":
    main()
