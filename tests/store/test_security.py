"""What the daemon exposes and leaves behind: its Unix socket is the owner's alone and goes
with it, shared memory never appears in a file system and is mapped read-only by readers, the
daemon a training job starts demands a token of its own, connections beyond the cap are refused
with a reason, and nothing in the package deserialises executable objects."""

from __future__ import annotations

import ast
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncflow as af

Daemons = Callable[..., Any]
PACKAGE = Path(af.__file__).parent


def test_the_shared_memory_socket_is_private_and_removed_at_stop(
    daemons: Daemons, tmp_path: Path
) -> None:
    socket_path = tmp_path / "store.sock"
    daemon = daemons("--shm-socket", str(socket_path))
    store = af.connect(daemon.url, transport="shm")
    store.put({"x": [np.arange(1000)]})
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert daemon.stop() == 0
    assert not socket_path.exists()


def test_shared_memory_segments_never_appear_in_a_file_system(daemons: Daemons) -> None:
    before = set(Path("/dev/shm").glob("*")) if Path("/dev/shm").exists() else set()
    store = af.connect(daemons().url, transport="shm")
    idx = store.put({"x": [np.arange(100_000)]})
    assert store.read(idx, "x")["x"][0][-1] == 99_999
    after = set(Path("/dev/shm").glob("*")) if Path("/dev/shm").exists() else set()
    assert not {p for p in after - before if "asyncflow" in p.name}


def mapping_permissions(addr: int) -> str:
    """The permissions (``r--s``, ``rw-s``, ...) of this process's mapping that holds ``addr``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(a, 16) for a in span.split("-"))
        if start <= addr < end:
            return perms
    raise AssertionError(f"no mapping holds {addr:#x}")


#: Reads row ``argv[2]`` of field ``adv`` over shared memory and writes its memory through the
#: raw pointer, as ``torch.from_numpy(view).mul_(100)`` does (torch only warns that the array is
#: read-only). No core file is left when the write faults.
WRITE_THROUGH_A_VIEW = """
import ctypes, resource, sys
import asyncflow as af
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
store = af.connect(sys.argv[1], transport="shm")
view = store.read([int(sys.argv[2])], "adv")["adv"][0]
ctypes.memset(view.ctypes.data, 0x42, view.nbytes)
print("written", flush=True)
"""


def test_a_write_through_a_shared_memory_view_cannot_change_what_others_read(
    daemons: Daemons,
) -> None:
    url = daemons().url
    store = af.connect(url, transport="shm")
    # 32 KiB, written into shared memory (a put of a few KiB travels in its request instead).
    idx = store.put({"adv": [np.ones(8192, dtype=np.float32)]})
    view = store.read(idx, "adv")["adv"][0]
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 100
    assert mapping_permissions(view.ctypes.data) == "r--s"
    command = [sys.executable, "-c", WRITE_THROUGH_A_VIEW, url, str(int(idx[0]))]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGSEGV, (child.returncode, child.stdout, child.stderr)
    assert "written" not in child.stdout
    for reader in (store, af.connect(url, transport="shm")):
        np.testing.assert_array_equal(reader.read(idx, "adv")["adv"][0], np.ones(8192))
    # Puts from this process still write shared memory (through a mapping of their own).
    again = store.put({"adv": [np.full(8192, 7, dtype=np.float32)] * 3})
    np.testing.assert_array_equal(store.read(again, "adv")["adv"][2], np.full(8192, 7))


def test_the_daemon_a_training_job_starts_demands_a_token_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The store's tests import the job's launcher (and so torch) only here.
    from asyncflow.config import Config  # noqa: PLC0415
    from asyncflow.launch.local import open_store, start_daemon  # noqa: PLC0415

    monkeypatch.delenv("ASYNCFLOW_TOKEN", raising=False)
    config = Config()
    config.trainer.dp_size = 2  # the trainer ranks, in processes of their own, need a daemon
    daemon = start_daemon(config)
    assert daemon is not None and daemon.token is not None and len(daemon.token) == 32
    try:
        # Even on loopback: without a token any local user could read and clear every row.
        for token in (None, "wrong"):
            with pytest.raises(af.AuthError):
                af.connect(daemon.url, token=token)
        # Not on its command line either, which every local user can read.
        assert daemon.token.encode() not in Path(f"/proc/{daemon.proc.pid}/cmdline").read_bytes()
        store = open_store(config, daemon)  # as the job and, with daemon.token, its ranks do
        idx = store.put({"x": [np.arange(3)]})
        assert len(af.connect(daemon.url, token=daemon.token).rows(idx)) == 1
    finally:
        assert daemon.stop() == 0


def test_connections_beyond_the_cap_are_refused_with_a_reason(daemons: Daemons) -> None:
    url = daemons("--max-connections", "2").url
    first, second = af.connect(url, transport="tcp"), af.connect(url, transport="tcp")
    with pytest.raises(af.ConnectionError, match="at most 2 connections"):
        af.connect(url, transport="tcp")
    del first  # closes its connection; the daemon frees its place once it sees the close
    second.put({"x": [1]})
    deadline = time.monotonic() + 30
    while True:
        try:
            third = af.connect(url, transport="tcp")
            break
        except af.ConnectionError as e:
            refused = str(e)
        assert "at most 2 connections" in refused
        assert time.monotonic() < deadline, "the closed connection's place was never freed"
        time.sleep(0.05)
    idx = third.put({"x": [2]})
    assert [int(v) for v in third.read(idx, "x")["x"]] == [2]


def test_a_local_client_takes_one_place_though_it_finds_the_unix_socket_over_tcp(
    daemons: Daemons,
) -> None:
    url = daemons("--max-connections", "2").url
    first = af.connect(url, transport="shm")
    # Its look over TCP must not hold the second place while it says hello on the Unix socket
    # (that was refused, and `auto` fell back to TCP without a word).
    second = af.connect(url)
    assert first.stats()["transport"] == second.stats()["transport"] == "shm"
    idx = first.put({"x": [4]})
    assert [int(v) for v in second.read(idx, "x")["x"]] == [4]
    for transport in ("shm", "auto"):
        with pytest.raises(af.ConnectionError, match="at most 2 connections"):
            af.connect(url, transport=transport)


def test_sockets_that_never_say_hello_cannot_take_the_places_of_clients(
    daemons: Daemons,
) -> None:
    daemon = daemons("--max-connections", "2")
    idle = [socket.create_connection(("127.0.0.1", daemon.port)) for _ in range(10)]
    try:
        first, second = (
            af.connect(daemon.url, transport="tcp"),
            af.connect(daemon.url, transport="tcp"),
        )
        idx = first.put({"x": [3]})
        assert [int(v) for v in second.read(idx, "x")["x"]] == [3]
    finally:
        for s in idle:
            s.close()


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_of_the_package_can_deserialise_code() -> None:
    unsafe = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(imported_modules(path) & unsafe)
        for path in PACKAGE.rglob("*.py")
        if imported_modules(path) & unsafe
    }
    assert offenders == {}
