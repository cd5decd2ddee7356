"""The weight-sync process group: the trainer's rank 0 (rank 0 here too) and one member per
process holding rollout engines. It is a torch.distributed group of its own, apart from the
trainer's data-parallel group, so that it can span processes the trainer's group does not know:
gloo on CPUs, NCCL on GPUs. One member (rank 0 unless the spec says) serves the rendezvous on
``address`` only, and members meeting on loopback keep their sockets there."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]
    BroadcastOptions,
    PrefixStore,
    TCPStore,
)

from asyncflow.engines.process_group import Rendezvous, _store, is_loopback

#: Key prefix of the group's keys in its rendezvous store.
PREFIX = "weight-sync"


@dataclass(frozen=True)
class GroupSpec:
    """Where the members meet and how long any collective may take."""

    port: int
    #: The publisher and every receiving process.
    world_size: int
    address: str = "127.0.0.1"
    #: Seconds any collective may take (a member died or stalled past it).
    timeout: float = 120.0
    #: Seconds the members wait for each other to join (engines start at their own pace).
    join_timeout: float = 600.0
    #: ``gloo`` or ``nccl``; None picks NCCL when this machine has a GPU for every member (NCCL
    #: refuses two members on one GPU), else gloo.
    backend: str | None = None
    #: The member that serves the rendezvous (the others connect to it): best the one that
    #: joins first, as a member that connects before the server listens retries with back-off.
    server: int = 0


def default_backend(world_size: int) -> str:
    """NCCL when there is a GPU for each of ``world_size`` members, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= world_size else "gloo"


class Group:
    """One member's end of the group."""

    def __init__(
        self, spec: GroupSpec, rank: int, label: str, listener: socket.socket | None = None
    ) -> None:
        """``listener``: for the member serving the rendezvous, a socket already listening on
        ``spec.port``, which the group takes over (else it opens one there)."""
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} is outside a group of {spec.world_size}")
        self.spec, self.rank, self.label = spec, rank, label
        self.backend = spec.backend or default_backend(spec.world_size)
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                f"{label}: the weight-sync group's backend is nccl, and CUDA is absent"
            )
        self.device = (
            torch.device("cuda", rank % torch.cuda.device_count())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self._kv = self._rendezvous(listener)
        self._kv.set(f"{PREFIX}/label/{rank}", label)
        self.pg = self._process_group(
            PrefixStore(PREFIX, self._kv), timedelta(seconds=spec.timeout)
        )
        # Read now, while every member is alive (the server keeps the keys): errors name them
        # later.
        #: Every member's label, by rank.
        self.labels = [self._kv.get(f"{PREFIX}/label/{r}").decode() for r in range(spec.world_size)]

    def _rendezvous(self, listener: socket.socket | None) -> Any:
        spec, timeout = self.spec, timedelta(seconds=self.spec.join_timeout)
        if self.rank != spec.server:
            return TCPStore(spec.address, spec.port, spec.world_size, False, timeout)
        if listener is None:  # (``_store`` serves for its rank 0)
            return _store(Rendezvous(0, spec.world_size, spec.port, spec.address), timeout)
        # The store owns the socket from here on, and closes it.
        return TCPStore(
            spec.address,
            spec.port,
            spec.world_size,
            True,
            timeout,
            master_listen_fd=listener.detach(),
        )

    def _process_group(self, store: Any, timeout: timedelta) -> Any:
        size = self.spec.world_size
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(store, self.rank, size, options)
        gloo = dist.ProcessGroupGloo
        options = gloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        if is_loopback(self.spec.address):
            options._devices = [gloo.create_device(interface="lo")]
        else:
            options._devices = [gloo.create_default_device()]
        return gloo(store, self.rank, size, options)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Starts broadcasting ``tensor`` from rank 0; returns the work to ``wait()`` on."""
        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = timedelta(seconds=self.spec.timeout)
        return self.pg.broadcast([tensor], options)

    def barrier(self) -> None:
        self.pg.barrier().wait()

    def close(self) -> None:
        """Ends the process group and lets go of the rendezvous store (the serving member's
        port is free again); a second call does nothing."""
        pg, self.pg, self._kv = self.pg, None, None  # the group holds the store: both go
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
