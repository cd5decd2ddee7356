"""The run's summary figure: accuracy and reward over training steps, and how busy each task was."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_summary_png(
    path: Path,
    history: list[dict[str, Any]],
    evals: list[tuple[int, float]],
    busy: dict[str, float],
) -> None:
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    steps = [r["step"] for r in history]
    curve.plot(steps, [r["reward_mean"] for r in history], label="train reward", alpha=0.6)
    if evals:
        curve.plot(*zip(*evals, strict=True), "o-", label="held-out accuracy (greedy)")
    curve.set_xlabel("training step")
    curve.set_ylim(0, 1.02)
    curve.grid(alpha=0.3)
    curve.legend(loc="lower right")
    curve.set_title("learning curve")
    roles = list(busy)
    bars.barh(roles, [busy[r] for r in roles], color="tab:green")
    bars.set_xlim(0, 1)
    bars.set_xlabel("busy fraction of the RL phase")
    bars.set_title("per-task utilisation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
