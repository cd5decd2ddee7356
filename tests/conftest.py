"""Shared fixtures. The store suites run against every backend through `make_store`:
`embedded` (in this process) and `daemon` (a daemon subprocess on a free loopback port, reached
through shared memory since it runs on this machine)."""

from __future__ import annotations

import os

# As the CLI does: one OpenMP thread per worker, set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# As asyncflow.launch does: Ray workers use this environment, set before ray is imported.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ipaddress
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import asyncflow as af
from asyncflow.daemon import DaemonProcess

BACKENDS = ["embedded", "daemon"]

#: The data path each backend reports in ``stats()["transport"]``.
TRANSPORTS = {"embedded": "inproc", "daemon": "shm"}


def daemon_flags(
    shards: int = 8, memory_limit: int | str | None = None, lease_timeout: float = 30.0
) -> list[str]:
    """Daemon flags for the embedded store's settings."""
    flags = ["--shards", str(shards), "--lease-timeout", str(lease_timeout)]
    limit = af.parse_size(memory_limit)
    return flags if limit is None else [*flags, "--memory-limit", str(limit)]


@pytest.fixture
def daemons() -> Iterator[Callable[..., DaemonProcess]]:
    """Starts daemons with the given flags; each is stopped, and must exit 0, at teardown."""
    started: list[DaemonProcess] = []

    def start(*flags: str) -> DaemonProcess:
        started.append(DaemonProcess(*flags))
        return started[-1]

    yield start
    codes = [d.stop() for d in started if not d.killed]
    assert codes == [0] * len(codes), "every daemon stops cleanly on SIGTERM"


@pytest.fixture
def sharded_store(daemons: Callable[..., DaemonProcess]) -> Callable[..., af.Store]:
    """Connects to a controller over ``count`` storage daemons, each started with ``flags``."""

    def start(count: int, *flags: str) -> af.Store:
        storage = [daemons("--role", "storage", *flags) for _ in range(count)]
        addresses = ",".join(d.url.removeprefix("tcp://") for d in storage)
        return af.connect(daemons("--role", "controller", "--storage", addresses).url)

    return start


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def transport(backend: str) -> str:
    """What ``stats()["transport"]`` says on this backend."""
    return TRANSPORTS[backend]


@pytest.fixture
def make_store(backend: str, daemons: Callable[..., DaemonProcess]) -> Callable[..., af.Store]:
    """Builds stores of the parametrised backend with the given settings."""

    def make(**settings: Any) -> af.Store:
        if backend == "embedded":
            return af.Store(**settings)
        if backend == "daemon":
            return af.connect(daemons(*daemon_flags(**settings)).url)
        raise AssertionError(f"unknown backend {backend}")

    return make


@pytest.fixture
def store(make_store: Callable[..., af.Store]) -> af.Store:
    return make_store(shards=4, memory_limit="256MiB", lease_timeout=30.0)


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also written as an IPv4-mapped IPv6 address (a dual-stack socket)."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


def non_loopback_listeners() -> list[str]:
    """Every TCP socket that this process or any process it started (and they started) listens
    on at an address other than loopback, as ``pid name address port``."""
    import psutil

    me = psutil.Process()
    found = []
    for process in [me, *me.children(recursive=True)]:
        try:
            sockets = process.net_connections(kind="inet")
            name = process.name()
        except psutil.NoSuchProcess:  # ended meanwhile: it listens on nothing
            continue
        found += [
            f"{process.pid} {name} {s.laddr.ip} {s.laddr.port}"
            for s in sockets
            if s.status == psutil.CONN_LISTEN and not is_loopback(s.laddr.ip)
        ]
    return found


@pytest.fixture
def listeners_off_loopback() -> Callable[[], list[str]]:
    """Lists the sockets listening off loopback in this process's tree (tests listen on
    loopback only)."""
    return non_loopback_listeners
