"""Runs untrusted Python in a child process with limits: CPU seconds and address space
(``setrlimit``), a wall-clock timeout after which the child's whole process group is killed,
output truncated to a byte budget, no network (a fresh, empty network namespace), PID and mount
namespaces of its own (it sees and can signal only its own processes, and none outlives the run;
every file outside its working directory is read-only to it), a cap on its processes, and, when
we run as root, a user id of its own.

The limits are applied by a small launcher (:mod:`asyncflow.agents._sandbox_child`) that the child
runs before the code, not by a ``preexec_fn``: forking a threaded process and running Python
between ``fork`` and ``exec`` can deadlock. Limitations, stated plainly: without root the process
cap needs a user namespace and Linux 5.14 (before, it would count all of the user's processes,
so it is not set) and the code keeps the caller's user (it can read the caller's files; it can
write them only where no mount namespace could be made), and nothing hides files from reading
beyond (as root) the unprivileged user's permissions.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("_sandbox_child.py")
HEADER = re.compile(
    rb"sandbox:net=(?P<net>[01]),pid=(?P<pid>[01]),fs=(?P<fs>[01]),disk=(?P<disk>[01])"
)
#: Seconds between looks at whether the child has exited.
POLL = 0.005


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    memory_bytes: int = 512 * 1024 * 1024
    wall_seconds: float = 10.0
    #: Bytes of output (stdout and stderr together) kept; the rest is counted and dropped.
    output_bytes: int = 16 * 1024
    #: Processes the child may have at once, itself included (without root: where a user
    #: namespace was made, from Linux 5.14).
    processes: int = 8
    #: Largest file the child may write.
    file_bytes: int = 1024 * 1024
    #: Bytes of files in its working directory, all together (applied when running as root).
    disk_bytes: int = 64 * 1024 * 1024


@dataclass
class SandboxResult:
    output: str
    #: The exit status; negative: killed by that signal.
    exit_code: int
    timed_out: bool
    #: Bytes of output dropped beyond ``output_bytes``.
    dropped_bytes: int
    seconds: float
    #: Whether the network namespace was made (else the child had the host's network).
    network_isolated: bool
    #: Whether the code ran in PID and mount namespaces of its own (it saw and could signal only
    #: its own processes, and everything it started was killed with it).
    processes_isolated: bool
    #: Whether every file outside its working directory was read-only to the code.
    files_isolated: bool
    #: Whether its working directory held at most ``disk_bytes`` of files.
    disk_limited: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class _Capture:
    """Reads a stream to its end, keeping the first ``limit`` bytes; the rest is drained (a
    child blocked on a full pipe would otherwise hang until the timeout) and counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.kept)
            self.kept += chunk[:room]
            self.dropped += max(0, len(chunk) - room)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


#: Sandboxed processes at once per event loop: a few hundred trajectories calling a tool in the
#: same instant would otherwise start a few hundred interpreters together.
MAX_CONCURRENT = 8
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


#: The timeouts over the call under way: the agent loop's over the environment's turn and the
#: ``tools`` environment's over the one call (see :func:`held_in_queue`). The wait for a slot is
#: not the tool's time, so each is held while it lasts and then moved on by as long. Else a burst
#: of calls would read as tools that did not answer (or as an environment that did not), the
#: model paying for it.
_deadlines: contextvars.ContextVar[tuple[asyncio.Timeout, ...]] = contextvars.ContextVar(
    "deadlines", default=()
)


@contextlib.contextmanager
def held_in_queue(timeout: asyncio.Timeout) -> Iterator[None]:
    """Within the block, ``timeout`` stops running while a sandboxed call waits for a slot."""
    token = _deadlines.set((*_deadlines.get(), timeout))
    try:
        yield
    finally:
        _deadlines.reset(token)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs ``code`` under ``limits``; never raises for anything the code does. The wall-clock
    limit counts from the start of the process, not from the wait for a slot."""
    loop = asyncio.get_running_loop()
    slots = _slots.setdefault(loop, asyncio.Semaphore(MAX_CONCURRENT))
    async with _held(_deadlines.get(), loop):
        await slots.acquire()
    try:
        return await _run(code, limits)
    finally:
        slots.release()


#: Each timeout held by calls waiting for a slot: how many wait, its deadline when the first
#: began to, and when that was (loop time).
_holding: dict[asyncio.Timeout, tuple[int, float, float]] = {}


@contextlib.asynccontextmanager
async def _held(
    timeouts: tuple[asyncio.Timeout, ...], loop: asyncio.AbstractEventLoop
) -> AsyncIterator[None]:
    """``timeouts`` (those with a deadline still ahead) do not run inside the block, nor while
    any other call under the same timeout waits in such a block: an environment turn whose
    calls queue one behind another is held until the last of them has a slot."""
    mine = []
    for timeout in timeouts:
        held = _holding.get(timeout)
        if held is not None:
            _holding[timeout] = (held[0] + 1, held[1], held[2])
        elif (
            timeout.expired()
            or (deadline := timeout.when()) is None
            or not _rescheduled(timeout, None)
        ):
            continue
        else:
            _holding[timeout] = (1, deadline, loop.time())
        mine.append(timeout)
    try:
        yield
    finally:
        for timeout in mine:
            waiting, when, began = _holding.pop(timeout)
            if waiting > 1:
                _holding[timeout] = (waiting - 1, when, began)
            else:
                _rescheduled(timeout, when + loop.time() - began)


def _rescheduled(timeout: asyncio.Timeout, when: float | None) -> bool:
    """``timeout.reschedule(when)``; False if its block has ended meanwhile (a task that the
    block started outlived it), which leaves it nothing to hold."""
    try:
        timeout.reschedule(when)
    except RuntimeError:
        return False
    return True


def _remove(workdir: str) -> None:
    """Deletes a sandbox's working directory. Without root the code ran as the caller's own
    user and may have left directories that cannot be listed or entered (mode 000), which stop
    ``rmtree``: then every directory in it (real ones, never what a link points to) is opened to
    its owner and the deletion tried again."""
    shutil.rmtree(workdir, ignore_errors=True)
    if not os.path.lexists(workdir):
        return
    stack = [workdir]
    while stack:
        directory = stack.pop()
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o700)  # noqa: PTH101 (paths from scandir, as strings)
            with os.scandir(directory) as entries:
                stack.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
    shutil.rmtree(workdir, ignore_errors=True)


async def _start(workdir: str, settings: dict[str, int]) -> asyncio.subprocess.Process:
    """The sandbox's launcher, in ``workdir``, with its limits."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        str(CHILD),
        json.dumps(settings),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=workdir,
        env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
        start_new_session=True,  # its own process group, killed as a whole
    )


async def _run(code: str, limits: SandboxLimits) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="asyncflow-sandbox-")
    Path(workdir).chmod(0o777)  # the child may run under an unprivileged user id
    settings = {
        "cpu": limits.cpu_seconds,
        "memory": limits.memory_bytes,
        "processes": limits.processes,
        "file": limits.file_bytes,
        "disk": limits.disk_bytes,
    }
    started = time.monotonic()
    try:
        proc = await _start(workdir, settings)
    except BaseException:  # cancelled (a timeout, the run's stop) while it started
        _remove(workdir)
        raise
    assert proc.stdin is not None and proc.stdout is not None
    timed_out = False
    try:
        proc.stdin.write(code.encode())
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await proc.stdin.drain()
        proc.stdin.close()
        capture = _Capture(limits.output_bytes + 64)
        reading = asyncio.ensure_future(capture.read(proc.stdout))
        # Polled, not ``proc.wait()``: that also waits for the pipes, which children of the
        # code may hold open after it has exited.
        deadline = started + limits.wall_seconds
        while proc.returncode is None and not timed_out:
            await asyncio.sleep(POLL)
            timed_out = time.monotonic() >= deadline
        _kill_group(proc.pid)  # on a timeout, and any children left behind either way
        # A descendant that left the group may hold the pipe open: stop reading soon after.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(reading), 1.0)
        reading.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 1.0)
        raw, dropped = bytes(capture.kept), capture.dropped
    finally:
        if proc.returncode is None:  # cancelled, or the pipe broke
            _kill_group(proc.pid)
        _remove(workdir)
    # The launcher's first line says which namespaces it made.
    header, _, body = raw.partition(b"\n")
    made = HEADER.fullmatch(header)
    if made is None:
        body = raw  # it failed before writing it
    dropped += max(0, len(body) - limits.output_bytes)
    return SandboxResult(
        body[: limits.output_bytes].decode(errors="replace"),
        int(proc.returncode if proc.returncode is not None else -9),
        timed_out,
        dropped,
        time.monotonic() - started,
        bool(made and made["net"] == b"1"),
        bool(made and made["pid"] == b"1"),
        bool(made and made["fs"] == b"1"),
        bool(made and made["disk"] == b"1"),
    )
