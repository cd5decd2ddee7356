"""The sandbox's limits, each exercised by code that breaks it: CPU time, memory, wall-clock
(the whole process group killed), output size, processes and the network. Limits are small so
that the file runs in seconds."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

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
def test_forking_without_bound_hits_the_process_cap() -> None:
    code = (
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
    result = sandboxed(code)
    assert result.ok, result.output
    assert int(result.output.split()[1]) < LIMITS.processes


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
