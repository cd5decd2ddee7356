"""The store as a daemon: ``connect`` to one, or ``serve`` one from this process.

``asyncflow.connect("tcp://HOST:PORT")`` returns a :class:`~asyncflow.Store` with exactly the
embedded store's methods. On the daemon's machine, payloads move through shared memory and reads
are zero-copy views of the daemon's memory; elsewhere they travel over TCP. A controller address
(``asyncflow-store --role controller``) gives a store sharded over its storage daemons.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

from asyncflow import _native
from asyncflow.store import Store

#: Environment variable holding the token when ``connect`` is given none.
TOKEN_ENV = "ASYNCFLOW_TOKEN"
#: Set by a parent that wants the daemon to end with it (see :class:`DaemonProcess`): its PID.
PARENT_ENV = "ASYNCFLOW_EXIT_WITH_PARENT"
PR_SET_PDEATHSIG = 1


def connect(
    url: str,
    token: str | None = None,
    transport: Literal["auto", "tcp", "shm", "shm-socket"] = "auto",
    *,
    request_timeout: float = 60.0,
    reconnect_timeout: float = 30.0,
) -> Store:
    """Connects to the store daemon at ``url`` (``"tcp://HOST:PORT"``).

    Args:
        url: the daemon's address; for a sharded store, its controller's.
        token: the daemon's token; defaults to ``$ASYNCFLOW_TOKEN``. A wrong one raises
            :class:`~asyncflow.AuthError`.
        transport: ``"auto"`` uses shared memory when the daemon is on this machine and TCP
            otherwise; ``"tcp"`` or ``"shm"`` insist on one. On shared memory, requests and
            replies travel in rings in shared memory too; ``"shm-socket"`` keeps them on the
            daemon's Unix socket (the path before rings, kept to compare against).
            ``store.stats()["transport"]`` says which is in use.
        request_timeout: seconds a request waits for its reply beyond its own ``timeout``; a
            daemon that answers nothing (not even the pings sent while requests wait) for this
            long fails them with :class:`~asyncflow.TimeoutError` or
            :class:`~asyncflow.ConnectionError`.
        reconnect_timeout: when the connection breaks (the daemon restarted), later calls
            connect again, backing off, for up to this many seconds before raising
            :class:`~asyncflow.ConnectionError`. Reads and claims that were waiting when it broke
            are sent again; a put, ack or other change raises, saying it may or may not have
            been applied.

    Raises :class:`~asyncflow.ConnectionError` if the daemon cannot be reached now.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    native = _native.Store.connect(
        url,
        token=token,
        transport=transport,
        request_timeout=request_timeout,
        reconnect_timeout=reconnect_timeout,
    )
    return Store._over(native)


def new_token() -> str:
    """A random token for a daemon a job starts for itself (128 bits, hex)."""
    return secrets.token_hex(16)


def end_with_parent(parent: int) -> bool:
    """Asks the kernel to send this process SIGTERM when its parent (``parent``, a PID) ends,
    however it ends (Linux; elsewhere nothing is asked). False if the parent had already ended.
    The kernel's notice follows the thread that started this process, so that thread must
    outlive it."""
    if sys.platform != "linux":
        return True
    import ctypes  # noqa: PLC0415 - only for processes that end with their parent

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == parent  # else it ended before the request was made


def serve(args: Sequence[str] = (), program: str = "asyncflow store serve") -> int:
    """Runs the daemon (the ``asyncflow-store`` binary's code) with these command-line flags until
    SIGTERM or SIGINT; returns its exit code. Usage and errors name ``program``, the command
    that ran it.

    With ``$ASYNCFLOW_EXIT_WITH_PARENT`` set to its parent's PID, the kernel sends it SIGTERM
    (a clean stop) when that parent ends, however it ends: a job killed outright leaves no
    daemon behind."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None and not end_with_parent(int(parent)):
        return 1
    # The daemon stops in order on SIGINT itself; Python's own handler, also run, would then
    # raise KeyboardInterrupt as serve returns (exit -2 and a traceback instead of 0).
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        return _native.serve(list(args), program)
    finally:
        signal.signal(signal.SIGINT, previous)


class DaemonProcess:
    """A daemon in a child process (``asyncflow store serve``), listening on a free loopback
    port unless ``flags`` say otherwise. ``url`` is where it listens; ``stop()`` sends SIGTERM,
    as an operator would, and returns the exit code (0 when it stopped cleanly).

    ``prefix`` runs it under another command (e.g. ``ip netns exec NAME``). ``token`` is the
    token the daemon demands; it reaches the daemon in its environment (``$ASYNCFLOW_TOKEN``),
    never on its command line, which every local user can read. Without one the daemon demands
    ``$ASYNCFLOW_TOKEN`` if this process has it set, else nothing: then any local user can
    connect to it, even on loopback, and read or clear every row. ``exit_with_parent`` ends it
    when the thread that starts it ends (see :func:`serve`): for a job's own daemon, started
    from its main thread. Used by the training job, tests and benchmarks; also a context
    manager.
    """

    def __init__(
        self,
        *flags: str,
        startup_timeout: float = 60.0,
        prefix: Sequence[str] = (),
        token: str | None = None,
        exit_with_parent: bool = False,
    ) -> None:
        command = [*prefix, sys.executable, "-m", "asyncflow.cli", "store", "serve"]
        defaults = [
            *(["--listen", "127.0.0.1:0"] if "--listen" not in flags else []),
            *(["--log-level", "warn"] if "--log-level" not in flags else []),
        ]
        env = dict(os.environ)
        if token is not None:
            env[TOKEN_ENV] = token
        if exit_with_parent:
            env[PARENT_ENV] = str(os.getpid())
        #: The token it demands (None: none), for :meth:`connect`.
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        # A job's own daemon is kept out of the job's process group: a Ctrl-C in the terminal
        # stops the job, whose cleanup then stops the daemon; stopped at once with the job, it
        # left the job's workers retrying a dead store for minutes.
        self.proc = subprocess.Popen(
            [*command, *defaults, *flags],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=exit_with_parent,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], startup_timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("listening on "):
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            raise RuntimeError(f"the store daemon did not start (flags {flags}): {line!r}")
        #: ``tcp://HOST:PORT``
        self.url = line.split()[-1]
        self._killed = False

    def connect(self, **options: Any) -> Store:
        """:func:`connect` to it with its token; ``options`` as :func:`connect` takes them."""
        return connect(self.url, token=self.token, **options)

    @property
    def port(self) -> int:
        """The TCP port it listens on (to start it again at the same address)."""
        return int(self.url.rsplit(":", 1)[1])

    @property
    def killed(self) -> bool:
        """Whether :meth:`kill` ended it."""
        return self._killed

    def kill(self) -> int:
        """Ends it with SIGKILL, as a crash would: nothing is flushed, nothing cleaned up."""
        self._killed = True
        self.proc.kill()
        code = self.proc.wait()
        self._close_pipe()
        return code

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._close_pipe()

    def _close_pipe(self) -> None:
        """Closes our end of its stdout once it has ended (it printed only its address)."""
        if self.proc.stdout is not None and self.proc.poll() is not None:
            self.proc.stdout.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
