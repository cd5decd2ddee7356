"""Daemons to break: a standalone daemon or a controller with three storage daemons, each a
child process on a loopback port, each optionally with a data directory, any of which can be
killed (SIGKILL), frozen (SIGSTOP) and started again on the same port and directory. Every
daemon of a deployment demands one random token, as the daemons a training job starts do."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import TracebackType
from typing import Literal

from asyncflow.daemon import TOKEN_ENV, DaemonProcess, new_token

Kind = Literal["standalone", "cluster"]
STORAGE_DAEMONS = 3


class Deployment:
    """``kind`` daemons; with ``data_root``, each keeps its store in a directory under it.
    ``flags`` go to every daemon (e.g. ``--lease-timeout 1``). They demand ``token``; while the
    deployment runs, ``$ASYNCFLOW_TOKEN`` holds it, so the clients of this process and of the
    processes it starts present it without being told."""

    def __init__(self, kind: Kind, data_root: Path | None = None, *flags: str) -> None:
        self.token = new_token()
        self._token_before = os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = self.token
        self.kind = kind
        self.data_root = data_root
        self.flags = list(flags)
        self.members: dict[str, DaemonProcess] = {}
        self._member_flags: dict[str, list[str]] = {}
        try:
            if kind == "standalone":
                self._start("standalone", [])
            else:
                for k in range(STORAGE_DAEMONS):
                    self._start(f"storage-{k}", ["--role", "storage"])
                addresses = ",".join(
                    self.members[f"storage-{k}"].url.removeprefix("tcp://")
                    for k in range(STORAGE_DAEMONS)
                )
                self._start("controller", ["--role", "controller", "--storage", addresses])
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, role_flags: list[str], listen: str = "127.0.0.1:0") -> None:
        flags = [*role_flags, *self.flags]
        if self.data_root is not None:
            flags += ["--data-dir", str(self.data_root / name)]
        self._member_flags[name] = flags
        self.members[name] = DaemonProcess("--listen", listen, *flags, token=self.token)

    @property
    def url(self) -> str:
        """Where clients connect: the standalone daemon, or the controller."""
        return self.members["standalone" if self.kind == "standalone" else "controller"].url

    @property
    def front(self) -> str:
        return "standalone" if self.kind == "standalone" else "controller"

    def kill(self, name: str) -> None:
        """SIGKILL: the daemon dies mid-whatever, flushing nothing."""
        self.members[name].kill()

    def freeze(self, name: str) -> None:
        os.kill(self.members[name].proc.pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        os.kill(self.members[name].proc.pid, signal.SIGCONT)

    def restart(self, name: str) -> None:
        """Starts a killed daemon again, on its port and data directory."""
        old = self.members[name]
        if old.proc.poll() is None:
            old.kill()
        self.members[name] = DaemonProcess(
            "--listen", f"127.0.0.1:{old.port}", *self._member_flags[name], token=self.token
        )

    def pids(self) -> dict[str, int]:
        return {name: d.proc.pid for name, d in self.members.items()}

    def stop(self) -> list[int]:
        """Stops every live daemon with SIGTERM; returns their exit codes."""
        codes = []
        for name in ("controller", "standalone", *(f"storage-{k}" for k in range(3))):
            daemon = self.members.get(name)
            if daemon is not None and not daemon.killed:
                codes.append(daemon.stop())
        if os.environ.get(TOKEN_ENV) == self.token:
            if self._token_before is None:
                del os.environ[TOKEN_ENV]
            else:
                os.environ[TOKEN_ENV] = self._token_before
        return codes

    def __enter__(self) -> Deployment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
