"""Runs workers as threads of this process (they share the embedded store, and torch releases
the GIL in its kernels). The run ends when the trainer finishes, when any worker fails (the error
names it), or on Ctrl-C; every other worker then stops at its next poll."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from asyncflow.workers.base import Worker


class WorkerError(RuntimeError):
    """A worker raised; the message names it."""


def run_threads(
    workers: Sequence[Worker],
    stop: threading.Event,
    finisher: Worker,
    tick: Callable[[], None] = lambda: None,
    join_timeout: float = 120.0,
) -> None:
    """Runs every worker in its own thread until ``finisher`` returns."""
    errors: list[tuple[str, BaseException]] = []

    def body(worker: Worker) -> None:
        try:
            worker.run()
        except BaseException as e:
            errors.append((worker.role, e))
        finally:
            if worker is finisher or errors:
                stop.set()

    threads = [threading.Thread(target=body, args=(w,), name=w.role, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        while not stop.wait(0.2):
            tick()
    except KeyboardInterrupt:
        stop.set()
        raise
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=join_timeout)
        tick()
    stuck = [t.name for t in threads if t.is_alive()]
    if errors:
        role, error = errors[0]
        raise WorkerError(f"the {role} worker failed: {type(error).__name__}: {error}") from error
    if stuck:
        raise WorkerError(f"workers did not stop within {join_timeout:.0f}s: {', '.join(stuck)}")
