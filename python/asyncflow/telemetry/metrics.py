"""Per-step metrics: one JSON line per step in ``metrics.jsonl``, mirrored to TensorBoard."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, run_dir: Path, keep_until: int | None = None) -> None:
        """``keep_until``: a resumed run keeps the records of steps up to this one (the rest
        belong to the timeline after its checkpoint, which is redone)."""
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if keep_until is not None and self.path.exists():
            records = [json.loads(line) for line in self.path.read_text().splitlines()]
            self.history = [r for r in records if r.get("step", 0) <= keep_until]
        self._file = self.path.open("w")
        for record in self.history:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._lock = threading.Lock()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb: Any = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional at run time
            self._tb = None

    def log(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.history.append(record)
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()
            if self._tb is not None:
                step = int(record.get("step", len(self.history)))
                for key, value in _flatten(record).items():
                    if key != "step":
                        self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        with self._lock:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _flatten(value, name + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out
