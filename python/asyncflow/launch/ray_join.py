"""Joining Ray: the cluster at a given address, or a Ray instance started on this machine for
the run, whose node address is loopback, so that Ray's servers and the run's (store daemons,
trainer rendezvous), which listen on the node's address, are reachable from this machine only.

On Linux, Ray replaces a loopback node address (and the host of a loopback cluster address) by
the machine's network address, so that other machines could join; it does not on macOS and
Windows, where it supports one machine only. A local instance is started, and a cluster on
loopback joined, with Ray in that one-machine mode for the call.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray._private import ray_constants

from asyncflow.engines.process_group import is_loopback

#: The node address of a Ray instance started here.
LOOPBACK = "127.0.0.1"


def join(address: str | None, **options: Any) -> None:
    """Connects this process to the Ray cluster at ``address`` (``host:port``) or, without one,
    starts a Ray instance of its own on loopback (never joining one another process started);
    ``options`` go to ``ray.init``. This process's SIGTERM handler is kept: Ray's core worker
    replaces it with one that aborts the process (no cleanup, exit by SIGABRT)."""
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if address is None:
            with _one_machine():
                ray.init(address="local", _node_ip_address=LOOPBACK, **options)
        elif is_loopback(_host(address)):
            with _one_machine():
                ray.init(address=address, **options)
        else:
            ray.init(address=address, **options)
    finally:
        if on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)


def _host(address: str) -> str:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return host.removeprefix("[").removesuffix("]")


@contextmanager
def _one_machine() -> Iterator[None]:
    """Ray's one-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), read when Ray works out
    this node's address; the variable itself is read once, when Ray is imported."""
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
