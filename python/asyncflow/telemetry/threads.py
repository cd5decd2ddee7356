"""How often this process's threads have gone to sleep, from Linux's ``/proc``: what a wake-up
costs is what profiles and tests of idle workers count."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: The name the client's link watcher threads carry in ``/proc`` (``asyncflow-client``, cut to
#: the kernel's 15 characters).
WATCHER = "asyncflow-clien"


def _voluntary(status: str) -> int:
    line = next(line for line in status.splitlines() if line.startswith("voluntary_ctxt"))
    return int(line.split()[1])


def voluntary_switches() -> int:
    """How many times the calling thread has given up its core to wait, so far."""
    return switches_of(str(threading.get_native_id()))


def switches_of(tid: str) -> int:
    """How many times this process's thread ``tid`` (its native id) has given up its core to
    wait, so far."""
    return _voluntary(Path(f"/proc/self/task/{tid}/status").read_text())


def asleep(tid: str) -> bool:
    """Whether this process's thread ``tid`` waits (state S in ``/proc``)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "S"


def settled(tid: str, quiet: float = 0.1) -> bool:
    """Whether this process's thread ``tid`` waits and is not woken for ``quiet`` seconds: a
    thread waiting for the GIL wakes every 5 ms, so one that passes waits for something else."""
    if not asleep(tid):
        return False
    seen = switches_of(tid)
    time.sleep(quiet)
    return asleep(tid) and switches_of(tid) == seen


def switches_by_thread(name: str) -> dict[str, int]:
    """The voluntary context switches so far of each thread of this process called ``name``
    (as ``/proc`` shows it), by thread id; a thread that ends while they are read is left out."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != name:
                continue
            found[task.name] = _voluntary((task / "status").read_text())
        except FileNotFoundError:
            continue
    return found


def new_thread(name: str, known: Collection[str], timeout: float = 30.0) -> str:
    """The id of the one thread called ``name`` not among ``known`` (ids from
    :func:`switches_by_thread`), waiting for it up to ``timeout`` seconds: a thread names itself
    once it runs, which may be after whatever started it has returned."""
    deadline = time.monotonic() + timeout
    while not (new := set(switches_by_thread(name)) - set(known)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new thread called {name!r} after {timeout:.0f}s")
        time.sleep(0.01)
    (tid,) = new
    return tid


def switches_in_a_thread(body: Callable[[], T], timeout: float = 60.0) -> tuple[T, int]:
    """Runs ``body`` in a thread of its own, not the main one (as a worker's runs), and returns
    what it returned with how many times that thread gave up its core meanwhile. What it raises
    is raised here; a body still running after ``timeout`` seconds is an error."""
    out: list[tuple[T, int]] = []
    failed: list[BaseException] = []

    def run() -> None:
        before = voluntary_switches()
        try:
            result = body()
        except BaseException as e:
            failed.append(e)
            return
        out.append((result, voluntary_switches() - before))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the body still ran after {timeout:.0f}s")
    if failed:
        raise failed[0]
    return out[0]
