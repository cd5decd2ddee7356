"""The weight-sync process group: the trainer's rank 0 (rank 0 here too) and one member per
process holding rollout engines. It is a torch.distributed group of its own, apart from the
trainer's data-parallel group, so that it can span processes the trainer's group does not know:
gloo on CPUs, NCCL on GPUs. Rank 0 serves the rendezvous on ``address`` only, and members meeting
on loopback keep their sockets there."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import BroadcastOptions, PrefixStore  # type: ignore[attr-defined]

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


def default_backend(world_size: int) -> str:
    """NCCL when there is a GPU for each of ``world_size`` members, else gloo."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= world_size else "gloo"


class Group:
    """One member's end of the group."""

    def __init__(self, spec: GroupSpec, rank: int, label: str) -> None:
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
        rendezvous = Rendezvous(rank, spec.world_size, spec.port, spec.address)
        self._kv = _store(rendezvous, timedelta(seconds=spec.join_timeout))
        self._kv.set(f"{PREFIX}/label/{rank}", label)
        self.pg = self._process_group(
            PrefixStore(PREFIX, self._kv), timedelta(seconds=spec.timeout)
        )
        # Read now, while every member is alive (rank 0 serves the keys): errors name them later.
        #: Every member's label, by rank.
        self.labels = [self._kv.get(f"{PREFIX}/label/{r}").decode() for r in range(spec.world_size)]

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
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()
