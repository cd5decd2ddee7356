"""What the daemon exposes and leaves behind: its Unix socket is the owner's alone and goes
with it, shared memory never appears in a file system, connections beyond the cap are refused
with a reason, and nothing in the package deserialises executable objects."""

from __future__ import annotations

import ast
import stat
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


def test_connections_beyond_the_cap_are_refused_with_a_reason(daemons: Daemons) -> None:
    url = daemons("--max-connections", "2").url
    first, second = af.connect(url, transport="tcp"), af.connect(url, transport="tcp")
    with pytest.raises(af.ConnectionError, match="at most 2 connections"):
        af.connect(url, transport="tcp")
    del first
    second.put({"x": [1]})


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
