"""A command's SIGTERM handling, checked in a process of its own."""

from __future__ import annotations

import signal
import subprocess
import sys


def assert_sigterm_runs_cleanup(script: str) -> None:
    """Runs ``script``, which prints ``ready`` and then waits in a block whose cleanup prints
    ``cleaned up``; SIGTERM must stop it through that cleanup with exit status 143."""
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None
        assert p.stdout.readline() == "ready\n"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 143
        assert p.stdout.read() == "cleaned up\n"
