"""Terminal output of long work: a live progress bar on a terminal (rich), plain lines in logs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

Advance = Callable[[int, str], None]
Tick = Callable[[int, list[dict[str, Any]]], None]


class Reporter:
    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.enabled = enabled
        self._last_line = 0.0

    def line(self, message: str) -> None:
        if self.enabled:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {message}", highlight=False)

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )

    def _throttled(self, message: str, force: bool) -> None:
        if force or time.monotonic() - self._last_line > 5.0:
            self._last_line = time.monotonic()
            self.line(message)

    @contextmanager
    def task(self, name: str, total: int) -> Iterator[Advance]:
        if self.live:
            with self._progress() as bar:
                handle = bar.add_task(name, total=total, info="")
                yield lambda done, info: bar.update(handle, completed=done, info=info)
            return
        yield lambda done, info: self._throttled(f"{name}: {done}/{total} {info}", done == total)

    @contextmanager
    def steps(self, total: int, start: int) -> Iterator[Tick]:
        def info(history: list[dict[str, Any]]) -> str:
            if not history:
                return "waiting for the first step"
            last = history[-1]
            evals = [r["eval_accuracy"] for r in history if "eval_accuracy" in r]
            text = f"reward {last['reward_mean']:.2f}  tokens/s {last['tokens_per_s']:.0f}"
            return text + (f"  held-out {evals[-1]:.3f}" if evals else "")

        if self.live:
            with self._progress() as bar:
                handle = bar.add_task("RL steps", total=total, completed=start, info="")
                yield lambda done, history: bar.update(handle, completed=done, info=info(history))
            return
        seen = [start]

        def tick(done: int, history: list[dict[str, Any]]) -> None:
            if done != seen[0]:
                seen[0] = done
                self._throttled(f"RL step {done}/{total}: {info(history)}", done == total)

        yield tick

    def summary(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        table = Table(title="asyncflow train", show_header=False)
        for key in [
            "accuracy_before",
            "accuracy_after",
            "accuracy_gain",
            "pass_at_8_before",
            "pass_at_8_after",
            "logprob_max_abs_diff",
            "wall_seconds",
        ]:
            value = summary.get(key)
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        table.add_row(
            "engines",
            f"rollout={summary['engines']['rollout']} trainer={summary['engines']['trainer']}",
        )
        table.add_row("run_dir", summary["run_dir"])
        self.console.print(table)
