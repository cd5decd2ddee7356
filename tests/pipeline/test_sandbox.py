"""The sandbox's limits, each exercised by code that breaks it: CPU time, memory, wall-clock
(the whole process group killed), output size, processes and the network. Limits are small so
that the file runs in seconds."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncflow.agents import sandbox
from asyncflow.agents.sandbox import SandboxLimits, SandboxResult, run_python

LIMITS = SandboxLimits(
    cpu_seconds=1, memory_bytes=256 * 2**20, wall_seconds=3.0, output_bytes=1000, processes=4
)


def sandboxed(code: str, limits: SandboxLimits = LIMITS) -> SandboxResult:
    return asyncio.run(run_python(code, limits))


def test_code_runs_and_its_output_comes_back() -> None:
    result = sandboxed("print(6 * 7)")
    assert result.ok and result.output == "42\n"


def test_an_exception_is_a_failed_run_with_its_traceback() -> None:
    result = sandboxed("raise ValueError('boom')")
    assert result.exit_code == 1
    assert "ValueError: boom" in result.output
    assert "_sandbox_child" not in result.output  # the launcher's frames are left out


def test_a_busy_loop_is_stopped_by_the_cpu_limit() -> None:
    result = sandboxed("while True: pass")
    assert result.exit_code < 0 and not result.timed_out  # a signal (SIGXCPU or SIGKILL)


def test_unbounded_allocation_fails_with_memory_error() -> None:
    result = sandboxed("a = []\nwhile True: a.append(bytearray(10**7))")
    assert result.exit_code == 1 and "MemoryError" in result.output


def test_a_hang_is_killed_at_the_wall_clock_limit_with_its_children() -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    open('child.pid', 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=1.5, processes=4)
    result = sandboxed(code, limits)
    assert result.timed_out and result.exit_code == -9
    assert result.seconds < 1.5 + 5  # killed, not waited for (generous: a loaded machine)


def test_output_beyond_the_budget_is_dropped_and_counted() -> None:
    result = sandboxed("import sys\nfor _ in range(100): sys.stdout.write('x' * 100000)")
    assert len(result.output) == LIMITS.output_bytes
    assert result.dropped_bytes == 100 * 100000 - LIMITS.output_bytes
    assert result.exit_code == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the process cap applies as root (child as nobody)")
def test_what_the_code_printed_before_a_kill_at_a_limit_is_kept() -> None:
    hang = sandboxed("print('before', flush=False)\nimport time\ntime.sleep(60)")
    assert hang.timed_out and hang.output == "before\n"
    spin = sandboxed("print('before', flush=False)\nwhile True: pass")
    assert spin.exit_code < 0 and spin.output == "before\n"


def test_code_that_kills_itself_is_reported_killed_without_the_launchers_traceback() -> None:
    result = sandboxed("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.exit_code == -9 and result.output == "", result.output


def test_system_v_shared_memory_the_code_makes_goes_with_the_sandbox() -> None:
    def segments() -> int:
        return len(Path("/proc/sysvipc/shm").read_text().splitlines())

    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None)\n"
        "print(libc.shmget(0, 1 << 20, 0o1000 | 0o600) >= 0)\n"  # IPC_PRIVATE, IPC_CREAT
    )
    before = segments()
    result = sandboxed(code)
    assert result.ok and result.output == "True\n", result.output
    assert segments() == before


SHARED_MEMORY_AND_FILES = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
segments = 0  # System V shared memory, 64 MiB a segment: no address space counts it
while segments < 64 and libc.shmget(0, 64 << 20, 0o1600) >= 0:
    segments += 1
files = []  # memfds, each up to the largest file
try:
    while len(files) < 1000:
        files.append(os.memfd_create("m"))
except OSError:
    pass
print(segments, len(files))
"""


def test_memory_that_no_address_space_counts_is_capped_too() -> None:
    result = sandboxed(SHARED_MEMORY_AND_FILES)  # 256 MiB of memory
    segments, files = map(int, result.output.split())
    assert 0 < files < 256  # the descriptors the code may hold open
    if result.processes_isolated and os.geteuid() == 0:  # in an IPC namespace of its own
        assert segments == 4  # 256 MiB of shared memory in all


#: Forks until a fork fails, then prints how many it made (its children sleep).
FORK_WITHOUT_BOUND = (
    "import os, time\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(30)\n"
    "        n += 1\n"
    "except OSError:\n"
    "    print('forks', n)\n"
)


def test_forking_without_bound_hits_the_process_cap() -> None:
    result = sandboxed(FORK_WITHOUT_BOUND)
    assert result.ok, result.output
    assert int(result.output.split()[1]) < LIMITS.processes


def test_a_unix_socket_of_the_hosts_takes_no_connection_from_the_code() -> None:
    """One anybody may connect to, in a directory the code can see (pytest's own are its
    user's alone): a file-system socket is outside the network namespace, and read-only mounts
    do not stop connect(2)."""
    seen = Path(tempfile.mkdtemp(dir="/tmp"))
    seen.chmod(0o755)
    path = seen / "service.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        path.chmod(0o666)
        server.listen()
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.socket(socket.AF_UNIX).connect({str(path)!r})\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "a, b = socket.socketpair()\n"  # a pair of its own is no way out: still allowed
            "a.send(b'x')\n"
            "print(b.recv(1))\n"
        )
        result = sandboxed(code)
    shutil.rmtree(seen)
    assert result.ok and result.output == "refused 13\nb'x'\n", result.output


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 machine code")
def test_no_way_around_the_unix_socket_refusal() -> None:
    """Neither i386's system calls (``int 0x80``, which a filter reading x86-64 numbers would let
    through) nor io_uring, whose requests make sockets without socket(2)."""
    code = (
        "import ctypes, struct\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "word, size, long = ctypes.c_int, ctypes.c_size_t, ctypes.c_long\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, size, word, word, word, long]\n"
        "page = libc.mmap(None, 4096, 7, 0x22, -1, 0)\n"  # read, write, exec; private, anonymous
        # push rbx; eax = 359 (i386 socket); ebx = AF_UNIX; ecx = SOCK_STREAM; edx = 0;
        # int 0x80; pop rbx; ret
        "op = bytes([0x53, 0xB8]) + struct.pack('<I', 359) + bytes([0xBB, 1, 0, 0, 0])\n"
        "op += bytes([0xB9, 1, 0, 0, 0, 0xBA, 0, 0, 0, 0, 0xCD, 0x80, 0x5B, 0xC3])\n"
        "ctypes.memmove(page, op, len(op))\n"
        "print('i386', ctypes.CFUNCTYPE(ctypes.c_int)(page)())\n"
        "params = ctypes.create_string_buffer(120)\n"
        "print('io_uring', libc.syscall(425, 8, params), ctypes.get_errno())\n"
    )
    result = sandboxed(code)
    assert result.ok and result.output == "i386 -13\nio_uring -1 13\n", result.output


@pytest.mark.skipif(os.geteuid() != 0, reason="only as root does each sandbox get a user id")
def test_as_root_the_working_directory_is_the_codes_user_id_alone() -> None:
    """Sandboxes running at once cannot read one another's files."""
    result = sandboxed(
        "import os\nst = os.stat('.')\nprint(oct(st.st_mode & 0o777), st.st_uid == os.getuid())"
    )
    assert result.ok and result.output == "0o700 True\n", result.output


@pytest.mark.skipif(os.geteuid() != 0, reason="the working directory is a tmpfs as root")
def test_files_the_code_writes_are_capped_all_together() -> None:
    """However many files: each under the file-size limit, they filled the host's disk."""
    code = (
        "n = 0\n"
        "try:\n"
        "    while n < 100:\n"
        "        open(f'f{n}', 'wb').write(b'x' * 500_000)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(n, e.errno)\n"
    )
    result = sandboxed(code, dataclasses.replace(LIMITS, disk_bytes=2 * 2**20))
    assert result.disk_limited
    assert result.ok and result.output == f"4 {errno.ENOSPC}\n", result.output


def test_there_is_no_network() -> None:
    result = sandboxed(
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(2)\n"
        "try:\n"
        "    s.connect(('192.0.2.1', 80))\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    if not result.network_isolated:
        pytest.skip("no network namespace can be made here (documented limitation)")
    assert result.output.startswith("refused")


def isolated_processes(result: SandboxResult) -> SandboxResult:
    if not result.processes_isolated:
        pytest.skip("no PID namespace can be made here (documented limitation)")
    return result


def test_the_code_sees_and_signals_only_its_own_processes() -> None:
    result = isolated_processes(
        sandboxed(
            "import os\n"
            f"try:\n    os.kill({os.getpid()}, 0)\n    print('the caller is visible')\n"
            "except ProcessLookupError:\n    print('no such process')\n"
            "print(os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
    )
    assert result.ok, result.output
    # The caller is not there to signal; its parent is the sandbox's init, and /proc holds the
    # two of them only.
    assert result.output == "no such process\n1 [1, 2]\n"


def test_a_process_that_leaves_the_group_ends_with_the_sandbox() -> None:
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"  # a sleep no one else runs
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        "time.sleep(0.5)\n"
    )
    isolated_processes(sandboxed(code))

    def running() -> bool:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    # The kill is done when the run returns; a zombie reaped late is the most that may linger.
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()


def test_the_code_cannot_unmount_its_proc_to_see_the_host_processes() -> None:
    result = isolated_processes(
        sandboxed(
            "import ctypes, os\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.umount2(b'/proc', 2), ctypes.get_errno())\n"  # 2: MNT_DETACH
            "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
        )
    )
    assert result.ok, result.output
    refused, processes = result.output.splitlines()
    assert refused.split()[0] == "-1"  # EPERM: no capability over its own mounts
    assert processes == "2"


def write_probe(path: Path) -> str:
    """Code that tries to write ``path``; prints the error number it got, or ``wrote``."""
    return (
        "import os\n"
        f"try:\n    open({str(path)!r}, 'w').write('x')\n    print('wrote')\n"
        "except OSError as e:\n    print(e.errno)\n"
    )


def test_only_the_working_directory_is_writable() -> None:
    with tempfile.TemporaryDirectory(prefix="asyncflow-sandbox-test-") as where:
        Path(where).chmod(0o777)  # writable by whatever user the code runs as
        outside = Path(where) / "planted"
        result = sandboxed(
            write_probe(outside)
            + "open('mine', 'w').write('kept')\n"
            + "print(open('mine').read(), os.environ['TMPDIR'] == os.getcwd())\n"
            + "open('/dev/null', 'w').write('x')\n"
        )
        if not result.files_isolated:
            pytest.skip("no mount namespace can be made here (documented limitation)")
        assert result.ok, result.output
        assert result.output == f"{errno.EROFS}\nkept True\n"
        assert not outside.exists()


UNPRIVILEGED = 4321  # a user id no file here belongs to
SYSTEM_PYTHON = Path("/usr/bin/python3")  # readable by any user, unlike an interpreter in /root
#: Tests that run the sandbox as ``UNPRIVILEGED`` (see :func:`run_unprivileged`).
AS_ANOTHER_USER = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not SYSTEM_PYTHON.exists(),
    reason="runs the sandbox as another user: needs root, setpriv and a system Python",
)
#: Without root, the process cap holds only where each user namespace counts apart.
CAP_IN_USER_NAMESPACES = pytest.mark.skipif(
    tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14),
    reason="without root the cap needs Linux 5.14 (user namespaces count apart)",
)


@AS_ANOTHER_USER
def test_without_root_the_code_gets_no_capability_and_cannot_see_its_caller() -> None:
    # The sandbox's two modules use the standard library only: copied where that user can read
    # (pytest's own temporary directories are the owner's only).
    with tempfile.TemporaryDirectory(prefix="asyncflow-sandbox-test-") as where:
        Path(where).chmod(0o755)
        check_unprivileged(Path(where))


def check_unprivileged(tmp_path: Path) -> None:
    owned = tmp_path / "owned"  # the caller's own files: writable to the caller, not the code
    owned.mkdir()
    os.chown(owned, UNPRIVILEGED, UNPRIVILEGED)
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.umount2(b'/proc', 2))\n"  # 2: MNT_DETACH
        f"try:\n    os.kill({os.getpid()}, 0)\nexcept ProcessLookupError:\n    print('gone')\n"
        "print(os.getuid() == 0, len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
    ) + write_probe(owned / "planted")
    output, exit_code = run_unprivileged(tmp_path, code)
    assert exit_code == 0, output
    assert output == f"-1\ngone\nFalse 2\n{errno.EROFS}\n"
    assert not (owned / "planted").exists()


def run_unprivileged(
    tmp_path: Path,
    code: str,
    limits: SandboxLimits | None = None,
    prefix: Sequence[str] = (),
    must_succeed: bool = False,
) -> tuple[str, int]:
    """The sandbox run by an unprivileged user (``UNPRIVILEGED``) from a copy of its two modules
    in ``tmp_path``, under ``prefix`` (a command that runs the rest): the code's output and exit
    status. Skips where no user namespace can be made (a documented limitation); with
    ``must_succeed`` the code's run must have exited 0 first (a launcher that failed wrote no
    header, and would read as a run without namespaces)."""
    package = tmp_path / "asyncflow" / "agents"
    package.mkdir(parents=True)
    (tmp_path / "asyncflow" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for module in (sandbox.__file__, sandbox.CHILD):
        shutil.copy(module, package)
    settings = dataclasses.asdict(limits or SandboxLimits())
    driver = (
        "import asyncio, json\n"
        "from asyncflow.agents.sandbox import SandboxLimits, run_python\n"
        f"r = asyncio.run(run_python({code!r}, SandboxLimits(**{settings!r})))\n"
        "print(json.dumps([r.output, r.exit_code, r.processes_isolated]))\n"
    )
    done = subprocess.run(
        [*prefix, "setpriv", f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}",
         "--clear-groups", str(SYSTEM_PYTHON), "-c", driver],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    output, exit_code, isolated = json.loads(done.stdout)
    if must_succeed:
        assert exit_code == 0, output
    if not isolated:
        pytest.skip("no user namespace can be made here (documented limitation)")
    return output, exit_code


@AS_ANOTHER_USER
@CAP_IN_USER_NAMESPACES
def test_without_root_forking_without_bound_hits_the_process_cap() -> None:
    """The cap counts the sandbox's own processes only: the same user has as many as the cap
    running outside it meanwhile."""
    user = [f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups"]
    sleeper = ["setpriv", *user, "sh", "-c", "echo ready; exec sleep 60"]
    outside = [subprocess.Popen(sleeper, stdout=subprocess.PIPE) for _ in range(LIMITS.processes)]
    try:
        for p in outside:  # each runs as that user once it says so
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        with tempfile.TemporaryDirectory(prefix="asyncflow-sandbox-test-") as where:
            Path(where).chmod(0o755)
            output, exit_code = run_unprivileged(Path(where), FORK_WITHOUT_BOUND, LIMITS)
    finally:
        for p in outside:
            p.kill()
            p.wait()
            p.stdout.close()  # type: ignore[union-attr]
    assert exit_code == 0, output
    assert output == f"forks {LIMITS.processes - 1}\n"


@AS_ANOTHER_USER
@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs prlimit")
@CAP_IN_USER_NAMESPACES
def test_a_hard_process_limit_below_the_cap_lowers_the_cap_and_fails_nothing() -> None:
    """The user's hard limit on processes (9) is below what the sandbox asks for (its default
    8 processes, and the launcher's 2): which an unprivileged process may not raise. The code
    still runs, and forks until the lower limit stops it."""
    with tempfile.TemporaryDirectory(prefix="asyncflow-sandbox-test-") as where:
        Path(where).chmod(0o755)
        output, exit_code = run_unprivileged(
            Path(where),
            FORK_WITHOUT_BOUND,
            prefix=["prlimit", "--nproc=9:9"],
            must_succeed=True,
        )
    assert exit_code == 0, output
    assert output.startswith("forks ") and 0 < int(output.split()[1]) < 9 - 3, output


def test_a_run_cancelled_while_its_process_starts_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = asyncio.Event()

    async def slow_start(workdir: str, settings: dict[str, int]) -> asyncio.subprocess.Process:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("never started")

    async def cancel_while_starting() -> None:
        run = asyncio.ensure_future(run_python("print(1)", LIMITS))
        await started.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sandbox, "_start", slow_start)
    asyncio.run(cancel_while_starting())
    assert list(tmp_path.iterdir()) == []


def test_a_working_directory_its_code_locked_is_still_removed() -> None:
    """Without root the code runs as the caller's user and may leave directories nobody can
    list or enter; as root, the check runs in a child that gives root up first (root passes
    every permission)."""
    base = tempfile.mkdtemp()
    os.chmod(base, 0o777)  # noqa: PTH101
    workdir = os.path.join(base, "work")  # noqa: PTH118

    def lock_and_remove() -> bool:
        os.makedirs(os.path.join(workdir, "a", "b", "c"))  # noqa: PTH103, PTH118
        Path(workdir, "a", "b", "c", "file").write_text("x")
        os.symlink(base, os.path.join(workdir, "a", "to-base"))  # noqa: PTH118, PTH211
        for locked in ("a/b/c", "a/b", "a"):
            os.chmod(os.path.join(workdir, locked), 0)  # noqa: PTH101, PTH118
        sandbox._remove(workdir)
        # Gone, and what the link pointed to was left as it was.
        return not os.path.lexists(workdir) and stat.S_IMODE(Path(base).stat().st_mode) == 0o777

    try:
        if os.geteuid() != 0:
            assert lock_and_remove()
            return
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            ok = False
            try:
                os.setgid(65534)
                os.setuid(65534)
                ok = lock_and_remove()
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
