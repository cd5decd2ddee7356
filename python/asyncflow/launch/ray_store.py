"""The store across a Ray cluster: one storage daemon per node holds the payloads written there
and read there (over shared memory), and one controller, on the driver's node, holds metadata,
readiness and leases. Each daemon is a child process of a small actor pinned to its node, and
listens on the node's address (loopback on a Ray instance started on this machine); every daemon
demands the run's token, since on a cluster that address is the node's network address.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncflow.config import Config
from asyncflow.daemon import TOKEN_ENV, DaemonProcess
from asyncflow.launch.ray_wait import Say, wait
from asyncflow.units import parse_size


class DaemonActor:
    """Runs one store daemon on this actor's node (wrapped by ``ray.remote`` below)."""

    def __init__(self, token: str, *flags: str) -> None:
        os.environ[TOKEN_ENV] = token  # the daemon reads it (not on its visible command line)
        host = ray.util.get_node_ip_address()
        self.daemon = DaemonProcess("--listen", f"{host}:0", *flags)

    def url(self) -> str:
        return self.daemon.url

    def stop(self) -> int:
        return self.daemon.stop()


@dataclass
class PlacedStore:
    """The controller's URL, the nodes holding payloads, and the actors to stop at the end."""

    url: str
    nodes: int
    actors: list[Any]

    def stop(self) -> None:
        """Stops every daemon (controller first, so that no client writes to a stopped node)."""
        for actor in self.actors:
            with contextlib.suppress(Exception):  # one already gone needs no stopping
                ray.get(actor.stop.remote(), timeout=30)
            ray.kill(actor)


def place_store(config: Config, token: str, say: Say | None = None) -> PlacedStore:
    """Starts a storage daemon on every alive node and a controller on this one."""
    s = config.store
    remote = ray.remote(DaemonActor)
    timeout = config.ray.start_timeout
    limit = parse_size(s.memory_limit)
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    here = ray.get_runtime_context().get_node_id()

    def on(node: str, *flags: str) -> Any:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        return remote.options(num_cpus=0, max_restarts=0, scheduling_strategy=strategy).remote(
            token, *flags, "--log-level", "warn"
        )

    storage = [
        on(
            node,
            "--role",
            "storage",
            "--shards",
            str(s.shards),
            *(["--memory-limit", str(limit)] if limit is not None else []),
        )
        for node in nodes
    ]
    urls = wait([a.url.remote() for a in storage], "the storage daemons to start", timeout, say)
    addresses = ",".join(u.removeprefix("tcp://") for u in urls)
    controller = on(
        here,
        "--role",
        "controller",
        "--storage",
        addresses,
        "--lease-timeout",
        str(s.lease_timeout),
    )
    (url,) = wait([controller.url.remote()], "the store controller to start", timeout, say)
    return PlacedStore(url, len(nodes), [controller, *storage])
