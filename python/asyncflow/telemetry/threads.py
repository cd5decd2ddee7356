"""How often this process's threads have gone to sleep, from Linux's ``/proc``: what a wake-up
costs is what profiles and tests of idle workers count."""

from __future__ import annotations

import threading
from pathlib import Path

#: The name the client's link watcher threads carry in ``/proc`` (``asyncflow-client``, cut to
#: the kernel's 15 characters).
WATCHER = "asyncflow-clien"


def _voluntary(status: str) -> int:
    line = next(line for line in status.splitlines() if line.startswith("voluntary_ctxt"))
    return int(line.split()[1])


def voluntary_switches() -> int:
    """How many times the calling thread has given up its core to wait, so far."""
    return _voluntary(Path(f"/proc/self/task/{threading.get_native_id()}/status").read_text())


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
