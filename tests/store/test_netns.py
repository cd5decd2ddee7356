"""Sharding across hosts, emulated with network namespaces this test creates: a controller and
three storage daemons each in a namespace of its own, joined by a bridge, and a client in a fifth
namespace that reaches them over TCP only (addresses exist inside these namespaces alone).
Skipped where namespaces cannot be made (not root, or no `ip`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from asyncflow.daemon import DaemonProcess

SUBNET = "10.231.7"
TOKEN = "netns-test-token"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_work() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    probe = f"afprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
        ip("netns", "del", probe)
        return True
    except (subprocess.CalledProcessError, OSError):
        return False


pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(not namespaces_work(), reason="cannot create network namespaces"),
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[str]]:
    """Five namespaces on one bridge; host ``k`` has address ``SUBNET.(k+1)``; host 0 holds the
    bridge."""
    names = [f"af{os.getpid()}h{k}" for k in range(5)]
    try:
        for name in names:
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        hub = names[0]
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        ip("-n", hub, "link", "set", "br0", "up")
        for k, name in enumerate(names[1:], start=1):
            ip(
                "-n",
                hub,
                "link",
                "add",
                f"v{k}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                name,
            )
            ip("-n", hub, "link", "set", f"v{k}", "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


CLIENT = """
import numpy as np, asyncflow as af
store = af.connect("tcp://{controller}", token="{token}")
store.register_task("t")
rows = [np.full(k + 1, k, np.int64) for k in range(12)]
store.put({{"ids": rows}})
s = store.stats()
assert s["storage_daemons"] == 3 and s["transport"] == "tcp", s
with store.claim("t", "ids", 12, timeout=10) as batch:
    got = batch.read()["ids"]
assert all((a == b).all() for a, b in zip(rows, got)), got
print("ok", s["payload_rows"])
"""


def test_a_store_sharded_over_storage_daemons_on_other_hosts(hosts: list[str]) -> None:
    def on(host: int) -> list[str]:
        return ["ip", "netns", "exec", hosts[host]]

    def serve(host: int, *flags: str) -> DaemonProcess:
        # Namespaces share this kernel and its files; --no-shm makes each daemon behave as if it
        # were on another machine, so every byte crosses the bridge over TCP.
        address = f"{SUBNET}.{host + 1}:7379"
        flags = ("--listen", address, "--token", TOKEN, "--no-shm", *flags)
        return DaemonProcess(*flags, prefix=on(host))

    storage = [serve(k, "--role", "storage") for k in (2, 3, 4)]
    addresses = ",".join(d.url.removeprefix("tcp://") for d in storage)
    controller = serve(1, "--role", "controller", "--storage", addresses)
    try:
        script = CLIENT.format(controller=controller.url.removeprefix("tcp://"), token=TOKEN)
        done = subprocess.run(
            [*on(0), sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["ok", "12"]
    finally:
        codes = [d.stop() for d in [controller, *storage]]
    assert codes == [0, 0, 0, 0]
