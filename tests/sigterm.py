"""A command's SIGTERM handling, checked in a process of its own."""

from __future__ import annotations

import signal
import subprocess
import sys


def assert_sigterm_runs_cleanup(script: str) -> None:
    """Runs ``script``, which prints ``ready`` and then waits in a block whose cleanup prints
    ``cleaned up``; SIGTERM must stop it through that cleanup with exit status 143.

    The script waits in short sleeps, as the commands' own loops do. Python runs a signal's
    handler between bytecodes, so a signal that lands after the last check and before a long
    blocking call (a single ``time.sleep(600)``) interrupts nothing: the call runs to its end
    first. The test sends SIGTERM right after ``ready``, when that window is open, and on a loaded
    machine (another thread taking the GIL as the sleep releases it) runs hit it: 1 of 35 of the
    Ray test's script with one long sleep, and 1 of 300 of a plain script with a thread spinning
    beside it, on 2 vCPUs with three busy processes beside; 0 of 300 of the latter in short
    sleeps."""
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        assert p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
        assert p.stdout.read() == "cleaned up\n"
