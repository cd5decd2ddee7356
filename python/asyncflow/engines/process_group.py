"""DeepSpeed's process group: which accelerator and backend (CPU with gloo when there is no GPU,
CUDA with NCCL when there is), the rendezvous environment, and a timeout on every collective so
that a rank whose peer died fails instead of waiting for ever.

The group must exist before vLLM is created in the same process: vLLM creates a one-process group
of its own when there is none, and DeepSpeed would then silently run as a world of one.

Rank 0 serves the rendezvous on ``master_addr`` only (torch's own store would listen on every
address of the machine), and ranks meeting on loopback keep their collectives' sockets there too.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one trainer meet."""

    rank: int
    world_size: int
    master_port: int
    master_addr: str = "127.0.0.1"
    #: Rank 0's socket, already listening on ``master_port`` (see :func:`listening`), which its
    #: store takes over; None: rank 0 binds the port when it joins.
    listener: socket.socket | None = field(default=None, compare=False, repr=False)

    def environ(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def listening(host: str = "127.0.0.1") -> tuple[socket.socket, int]:
    """A socket listening on a port of ``host`` the system picks, and the port. Held from the
    choice of the port until a rendezvous store takes it over, so that no other process can bind
    the port in between (as one could when a port found free is closed, to be bound again)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    return listener, int(listener.getsockname()[1])


def group_of_one() -> Rendezvous:
    """The rendezvous of a group of one, on a loopback port this process listens on."""
    listener, port = listening()
    return Rendezvous(rank=0, world_size=1, master_port=port, listener=listener)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _store(rendezvous: Rendezvous, timeout: timedelta) -> Any:
    """The rendezvous's key-value store: rank 0 serves it on ``master_addr`` alone, through a
    socket bound here and handed over, and the other ranks connect to it."""
    r = rendezvous
    if r.rank != 0:
        return TCPStore(r.master_addr, r.master_port, r.world_size, False, timeout)
    family = socket.AF_INET6 if ":" in r.master_addr else socket.AF_INET
    listener = r.listener or socket.create_server((r.master_addr, r.master_port), family=family)
    # The store owns the socket from here on, and closes it.
    return TCPStore(
        r.master_addr,
        r.master_port,
        r.world_size,
        True,
        timeout,
        master_listen_fd=listener.detach(),
    )


def on_gpu() -> bool:
    return bool(torch.cuda.is_available())


def gpu_count() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if on_gpu() else 0


def prepare_environment() -> None:
    """Settings DeepSpeed reads when it is imported."""
    if "DS_ACCELERATOR" not in os.environ and not on_gpu():
        os.environ["DS_ACCELERATOR"] = "cpu"
    # DeepSpeed builds its ops with ninja, which the environment installs beside this Python;
    # a process started without the environment's bin/ on PATH would not find it.
    if shutil.which("ninja") is None:
        bin_dir = str(Path(sys.executable).parent)
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _skip_inference_comm_op() -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce when the group is created (about
    80 s the first time, and it needs a C++ compiler). Only tensor-parallel inference uses it;
    training collectives go through gloo. Marking it incompatible skips the build."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def join_group(rendezvous: Rendezvous, timeout: float) -> str:
    """Creates the default process group with torch alone: rank 0 serves the rendezvous on its
    address, and ranks meeting on loopback keep their collectives' sockets there. Returns the
    backend (nccl on GPUs, gloo on CPUs)."""
    os.environ.update(rendezvous.environ())
    backend = "nccl" if on_gpu() else "gloo"
    if is_loopback(rendezvous.master_addr) and sys.platform == "linux":
        # Left alone, both pick the address of the machine's name or first interface.
        os.environ.setdefault(f"{backend.upper()}_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        store=_store(rendezvous, timedelta(seconds=timeout)),
        rank=rendezvous.rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=timeout),
    )
    return backend


def init_process_group(rendezvous: Rendezvous | None, timeout: float) -> None:
    """Joins (or, alone, creates) the default process group. Without ``rendezvous`` an existing
    group is reused, else a group of one is made on a free port."""
    prepare_environment()  # before DeepSpeed is imported: it reads these then
    import deepspeed

    if rendezvous is None:
        if dist.is_initialized():
            # deepspeed.init_distributed adopts the existing group.
            deepspeed.init_distributed(dist_backend=dist.get_backend())
            return
        rendezvous = group_of_one()
    # DeepSpeed keeps the world group it first saw; one destroyed since would be used again.
    deepspeed.utils.groups._WORLD_GROUP = None
    _skip_inference_comm_op()
    # DeepSpeed adopts the group made here, on the store made here.
    backend = join_group(rendezvous, timeout)
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout))
    if on_gpu():
        from deepspeed.accelerator import get_accelerator

        get_accelerator().set_device(rendezvous.rank % max(1, get_accelerator().device_count()))
