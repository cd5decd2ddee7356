"""PNG figures of a suite's records: a figure made for the suites whose story is one picture
(``pipeline``, ``sim``, ``e2e``), and every ratio against its baseline for the others."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.bench.records import Record, Report


def _record(records: list[Record], case: str, metric: str, baseline: str | None = None) -> Record:
    return next(
        r
        for r in records
        if r.case == case and r.metric == metric and baseline in (None, r.baseline)
    )


def _value(records: list[Record], case: str, metric: str) -> float:
    return _record(records, case, metric).value


def _baseline(records: list[Record], case: str, metric: str, baseline: str) -> float:
    return _record(records, case, metric, baseline).baseline_value or 0.0


def _cases(records: list[Record]) -> list[str]:
    return list(dict.fromkeys(r.case for r in records))


def pipeline(report: Report, plt: Any) -> Any:
    """Throughput of each mode against its ideal bound, and where its devices' time went."""
    rs, cases = report.records, _cases(report.records)
    fig, (rate, busy) = plt.subplots(1, 2, figsize=(11, 4))
    measured = [_value(rs, c, "samples_per_s") for c in cases]
    ideal = [_baseline(rs, c, "samples_per_s", "ideal") for c in cases]
    xs = range(len(cases))
    rate.bar(xs, ideal, color="lightgrey", label="ideal (bottleneck always busy)")
    rate.bar(xs, measured, color="tab:blue", label="measured")
    base = measured[0]
    for x, m in zip(xs, measured, strict=True):
        rate.text(x, m, f"{m / base:.2f}x", ha="center", va="bottom")
    rate.set_xticks(list(xs), cases, rotation=20)
    rate.set_ylabel("trained samples / s (modelled)")
    rate.set_title("throughput (emulated accelerators), ratio to colocated-sync")
    rate.legend(loc="upper left", fontsize=8)
    pools = {
        "generation": ("rollout", "weight_load"),
        "training": ("trainer", "reference", "publish"),
    }
    roles = [*pools["generation"], *pools["training"], "switch"]
    colors = {role: plt.cm.tab10.colors[i] for i, role in enumerate(roles)}
    for x, case in enumerate(cases):
        colocated = _value(rs, case, "busy_switch") > 0
        bars = (
            [(x, (*pools["generation"], *pools["training"], "switch"))]
            if colocated
            else [
                (x - 0.2, pools["generation"]),
                (x + 0.2, pools["training"]),
            ]
        )
        for at, stack in bars:
            bottom = 0.0
            for role in stack:
                share = _value(rs, case, f"busy_{role}")
                busy.bar(at, share, width=0.38, bottom=bottom, color=colors[role])
                bottom += share
    for role, color in colors.items():
        busy.bar(0, 0, color=color, label=role)
    busy.set_xticks(list(xs), cases, rotation=20)
    busy.set_ylim(0, 1.3)
    busy.set_ylabel("busy share of the pool's device time")
    busy.set_title("pools: generation (left), training (right)")
    busy.legend(fontsize=7, ncol=3, loc="upper center")
    return fig


def sim(report: Report, plt: Any) -> Any:
    """Scaling efficiency from 32 devices up, asynchronous and colocated synchronous."""
    rs, cases = report.records, _cases(report.records)
    devices = [int(c) for c in cases]
    fig, (eff, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for metric, label in [
        ("scaling_efficiency", "async-1"),
        ("scaling_efficiency_sync", "colocated-sync"),
    ]:
        eff.plot(devices, [_value(rs, c, metric) for c in cases], "o-", label=label)
    eff.set_xscale("log", base=2)
    eff.set_ylim(0, 1.1)
    eff.axhline(0.9, color="grey", linestyle=":", label="0.9")
    eff.set_xlabel("devices")
    eff.set_title("simulated scaling efficiency (no stragglers, no shared links)")
    eff.legend()
    rate.plot(devices, [_value(rs, c, "samples_per_s") for c in cases], "o-", label="async-1")
    sync = [_baseline(rs, c, "samples_per_s", "colocated-sync") for c in cases]
    rate.plot(devices, sync, "o-", label="colocated-sync")
    rate.set_xscale("log", base=2)
    rate.set_yscale("log")
    rate.set_xlabel("devices")
    rate.set_title("trained samples / s (simulated)")
    rate.legend()
    return fig


def e2e(report: Report, plt: Any) -> Any:
    """RL seconds (to the target accuracy per staleness; the whole run per peer) and final
    accuracy per case."""
    rs, cases = report.records, _cases(report.records)
    fig, (ttt, acc) = plt.subplots(1, 2, figsize=(10, 4))
    seconds = [
        _value(rs, c, "time_to_target_s" if c.startswith("staleness-") else "rl_seconds")
        for c in cases
    ]
    ttt.bar(cases, seconds, color="tab:blue")
    ttt.set_ylabel("seconds of RL (evaluation excluded)")
    ttt.set_title("to the target (staleness-k); all steps (peers)")
    means = [_value(rs, c, "final_accuracy") for c in cases]
    low = [m - _value(rs, c, "final_accuracy_min") for c, m in zip(cases, means, strict=True)]
    high = [_value(rs, c, "final_accuracy_max") - m for c, m in zip(cases, means, strict=True)]
    acc.bar(cases, means, yerr=[low, high], capsize=6, color="tab:green")
    acc.set_ylim(0, 1)
    acc.set_title("final held-out accuracy (mean, min-max over seeds)")
    return fig


def ratios(report: Report, plt: Any) -> Any:
    """Every ratio against a baseline, one bar each, on a log scale."""
    with_base = [r for r in report.records if r.ratio is not None]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.18 * len(with_base))))
    labels = [f"{r.case} {r.metric} vs {r.baseline}" for r in with_base]
    ax.barh(labels, [r.ratio for r in with_base], color="tab:blue")
    ax.set_xscale("log")
    ax.axvline(1, color="grey")
    ax.tick_params(axis="y", labelsize=6)
    ax.invert_yaxis()
    ax.set_title(f"{report.suite}: value / baseline")
    return fig


FIGURES: dict[str, Callable[[Report, Any], Any]] = {"pipeline": pipeline, "sim": sim, "e2e": e2e}


def write_png(report: Report, path: Path) -> None:
    import matplotlib as mpl

    mpl.use("Agg")
    import matplotlib.pyplot as plt

    fig = FIGURES.get(report.suite, ratios)(report, plt)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
