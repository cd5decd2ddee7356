"""Per-step metrics: one JSON line per step in ``metrics.jsonl``, mirrored to the experiment
trackers of ``run.loggers`` (TensorBoard by default)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflow.telemetry.loggers import Trackers


def rewrite(path: Path, lines: Sequence[str]) -> None:
    """Replaces ``path`` with ``lines`` whole: written beside it, synced, then renamed over it,
    so that a process killed meanwhile leaves the old file, never a cut or empty one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.writelines(line + "\n" for line in lines)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        keep_until: int | None = None,
        loggers: Sequence[str] = ("tensorboard",),
        config: dict[str, Any] | None = None,
    ) -> None:
        """``keep_until``: a resumed run keeps the records of steps up to this one (the rest
        belong to the timeline after its checkpoint, which is redone). ``loggers``: the
        experiment trackers, started with ``config``; they stay open after :meth:`close` until
        :meth:`finish` hands them the summary figure."""
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if keep_until is not None and self.path.exists():
            records = [json.loads(line) for line in self.path.read_text().splitlines()]
            self.history = [r for r in records if r.get("step", 0) <= keep_until]
        rewrite(self.path, [json.dumps(r, sort_keys=True) for r in self.history])
        self._file = self.path.open("a")
        self._lock = threading.Lock()
        self.trackers = Trackers(loggers, run_dir, config or {}, keep_until)

    def log(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.history.append(record)
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
            self.trackers.step({"step": len(self.history)} | record)

    def close(self) -> None:
        """Closes ``metrics.jsonl`` (the trackers stay open for :meth:`finish`)."""
        with self._lock:
            self._file.close()

    def finish(self, figure: Path | None = None) -> None:
        """Hands the trackers the summary figure (if any) and closes them."""
        with self._lock:
            if figure is not None:
                self.trackers.figure(figure)
            self.trackers.close()
