"""Worker timelines: every worker marks its spans as busy (computing) or waiting (for input,
weights or room), which gives per-task utilisation and a Chrome-trace/Perfetto timeline."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["busy", "wait"]


@dataclass(frozen=True)
class Span:
    role: str
    kind: Kind
    name: str
    start: float
    end: float


class Tracer:
    def __init__(self) -> None:
        self.origin = time.monotonic()
        #: The same moment on the wall clock, to line up tracers of other processes or machines.
        self.wall_origin = time.time()
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        """Seconds since the tracer started."""
        return time.monotonic() - self.origin

    @contextmanager
    def span(self, role: str, kind: Kind, name: str) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.record(role, kind, name, start, self.now())

    def record(self, role: str, kind: Kind, name: str, start: float, end: float) -> None:
        """A span whose times are known (seconds on this tracer's timeline)."""
        with self._lock:
            self._spans.append(Span(role, kind, name, start, end))

    def add(self, spans: list[Span], wall_origin: float) -> None:
        """Takes in another tracer's spans (``wall_origin`` is that tracer's), on this timeline."""
        shift = wall_origin - self.wall_origin
        with self._lock:
            self._spans += [
                Span(s.role, s.kind, s.name, s.start + shift, s.end + shift) for s in spans
            ]

    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def busy_fraction(self, since: float = 0.0, until: float | None = None) -> dict[str, float]:
        """Per role: time busy in ``[since, until]`` divided by the window's length."""
        until = self.now() if until is None else until
        window = max(until - since, 1e-9)
        busy: dict[str, float] = {}
        for s in self.spans():
            busy.setdefault(s.role, 0.0)
            if s.kind == "busy":
                overlap = min(s.end, until) - max(s.start, since)
                busy[s.role] += max(0.0, overlap)
        return {role: min(1.0, t / window) for role, t in sorted(busy.items())}

    def write_chrome_trace(self, path: Path) -> None:
        """Writes the spans as a Chrome trace (open in chrome://tracing or ui.perfetto.dev)."""
        spans = self.spans()
        roles = sorted({s.role for s in spans})
        tid = {role: i for i, role in enumerate(roles)}
        events: list[dict[str, object]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid[r], "args": {"name": r}}
            for r in roles
        ]
        events.extend(
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "ts": round(s.start * 1e6, 1),
                "dur": round((s.end - s.start) * 1e6, 1),
                "pid": 0,
                "tid": tid[s.role],
                "cname": "good" if s.kind == "busy" else "grey",
            }
            for s in spans
        )
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
