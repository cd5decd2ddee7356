"""The store as a daemon: ``connect`` to one, or ``serve`` one from this process.

``asyncflow.connect("tcp://HOST:PORT")`` returns a :class:`~asyncflow.Store` with exactly the
embedded store's methods. On the daemon's machine, payloads move through shared memory and reads
are zero-copy views of the daemon's memory; elsewhere they travel over TCP. A controller address
(``asyncflow-store --role controller``) gives a store sharded over its storage daemons.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Literal

from asyncflow import _native
from asyncflow.store import Store

#: Environment variable holding the token when ``connect`` is given none.
TOKEN_ENV = "ASYNCFLOW_TOKEN"


def connect(
    url: str,
    token: str | None = None,
    transport: Literal["auto", "tcp", "shm"] = "auto",
) -> Store:
    """Connects to the store daemon at ``url`` (``"tcp://HOST:PORT"``).

    Args:
        url: the daemon's address; for a sharded store, its controller's.
        token: the daemon's token; defaults to ``$ASYNCFLOW_TOKEN``. A wrong one raises
            :class:`~asyncflow.AuthError`.
        transport: ``"auto"`` uses shared memory when the daemon is on this machine and TCP
            otherwise; ``"tcp"`` or ``"shm"`` insist on one. ``store.stats()["transport"]`` says
            which is in use.

    Raises :class:`~asyncflow.ConnectionError` if the daemon cannot be reached.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return Store._over(_native.RemoteStore(url, token=token, transport=transport))


def serve(args: Sequence[str] = ()) -> int:
    """Runs the daemon (the ``asyncflow-store`` binary's code) with these command-line flags until
    SIGTERM or SIGINT; returns its exit code."""
    return _native.serve(list(args))


class DaemonProcess:
    """A daemon in a child process (``asyncflow store serve``), listening on a free loopback
    port unless ``flags`` say otherwise. ``url`` is where it listens; ``stop()`` sends SIGTERM,
    as an operator would, and returns the exit code (0 when it stopped cleanly).

    ``prefix`` runs it under another command (e.g. ``ip netns exec NAME``). Used by tests and
    benchmarks; also a context manager.
    """

    def __init__(
        self, *flags: str, startup_timeout: float = 60.0, prefix: Sequence[str] = ()
    ) -> None:
        command = [*prefix, sys.executable, "-m", "asyncflow.cli", "store", "serve"]
        defaults = [
            *(["--listen", "127.0.0.1:0"] if "--listen" not in flags else []),
            *(["--log-level", "warn"] if "--log-level" not in flags else []),
        ]
        self.proc = subprocess.Popen(
            [*command, *defaults, *flags], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], startup_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("listening on "):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the store daemon did not start (flags {flags}): {line!r}")
        #: ``tcp://HOST:PORT``
        self.url = line.split()[-1]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
