"""The ``ipc`` transport: trainer and rollout engines share a GPU, and each version goes from
the trainer's GPU memory into the engines' by CUDA IPC, with no copy through the host.

The publisher packs each version into one flat buffer on its GPU (the same layout as
:mod:`asyncflow.weight_sync.broadcast`), and announces it in the store with that buffer's CUDA
IPC handle and the identity of the process that owns it. The weight-sync group (gloo: it only
carries a header and a barrier) tells receivers when to copy: each receiver maps the buffer
(once per buffer), copies it into a staging buffer on its own GPU, and swaps that in; the
publisher returns once every receiver has, and only then may it overwrite the buffer. So a
receiver never copies a buffer being rewritten, and an engine never loads half a version.

A handle whose owner is gone is refused before it is opened: the manifest names the owner's
pid, its start time and the machine's boot id, and a receiver checks them first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from asyncflow.store import Store
from asyncflow.weight_sync import WeightSyncError
from asyncflow.weight_sync.broadcast import BroadcastPublisher, BroadcastReceiver
from asyncflow.weight_sync.group import Group
from asyncflow.weight_sync.layout import Layout, pack

#: Announced fields: the buffer's CUDA IPC handle with what opening it takes (torch's CUDA IPC
#: reduction, as JSON: nothing read from the store is unpickled), and the owner's identity.
HANDLE = "ipc_handle"
OWNER = "ipc_owner"
#: The fields of torch's CUDA reduction that say where the buffer is and how to open it (after
#: the tensor's class, size, stride, offset, storage class and dtype, which are fixed here: the
#: buffer is always a flat uint8 tensor).
_SHARED = (
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def share(buffer: torch.Tensor) -> bytes:
    """The IPC handle of a flat uint8 CUDA ``buffer``, as JSON (bytes as hex)."""
    _, args = reduce_tensor(buffer)
    shared = dict(zip(_SHARED, args[6:], strict=True))
    encoded = {k: v.hex() if isinstance(v, bytes) else v for k, v in shared.items()}
    return json.dumps({"numel": buffer.numel(), **encoded}).encode()


def open_shared(handle: bytes) -> torch.Tensor:
    """Maps the buffer ``handle`` (from :func:`share`) into this process."""
    raw = json.loads(handle)
    fields = [
        bytes.fromhex(raw[k]) if k.endswith("handle") and raw[k] is not None else raw[k]
        for k in _SHARED
    ]
    numel = int(raw["numel"])
    return rebuild_cuda_tensor(  # type: ignore[no-any-return]
        torch.Tensor, (numel,), (1,), 0, torch.storage.TypedStorage, torch.uint8, *fields
    )


#: One "bucket": the whole version is copied at once.
WHOLE = 1 << 62


def process_identity(pid: int) -> dict[str, Any] | None:
    """What tells process ``pid`` apart from a later one given the same pid: its start time
    (clock ticks since boot) and the boot id. None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces, parentheses and any bytes: count from its
    # closing parenthesis.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"pid": pid, "start": int(fields[19]), "boot": boot}


def check_owner(owner: dict[str, Any], version: int) -> None:
    """Raises :class:`WeightSyncError` unless the process that announced ``owner`` still runs."""
    try:
        now = process_identity(int(owner["pid"]))
    except OSError as e:
        raise WeightSyncError(
            f"weights v{version}: refused the CUDA IPC handle of process {owner['pid']}: "
            f"cannot tell whether it still runs ({e})"
        ) from e
    if now != owner:
        raise WeightSyncError(
            f"weights v{version}: refused the CUDA IPC handle of process {owner['pid']}, which "
            "is gone (its memory may be reused); engines keep the version they have"
        )


class IpcPublisher(BroadcastPublisher):
    """Rank 0 of the group; the version's tensors may be on any device (they are packed into a
    buffer on ``device``; default: the GPU of the first tensor on one, else the current GPU)."""

    what = "the CUDA IPC copy"

    def __init__(
        self, store: Store, group: Group, device: torch.device | str | None = None
    ) -> None:
        super().__init__(store, group, WHOLE)
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type != "cuda":
            raise ValueError(f"the ipc transport shares CUDA memory, not {self.device}")
        self._buffer: torch.Tensor | None = None
        self._announced: dict[str, bytes] = {}
        self.owner = process_identity(os.getpid())

    def _prepare(self, layout: Layout, tensors: list[torch.Tensor]) -> dict[str, bytes]:
        if self.device is None:
            on_gpu = [t.device for t in tensors if t.device.type == "cuda"]
            self.device = on_gpu[0] if on_gpu else torch.device("cuda", torch.cuda.current_device())
        if self._buffer is None or self._buffer.numel() != layout.total:
            self._buffer = torch.empty(layout.total, dtype=torch.uint8, device=self.device)
            self._announced = {
                HANDLE: share(self._buffer),
                OWNER: json.dumps(self.owner).encode(),
            }
        pack(self._buffer, 0, layout.total, layout, tensors)
        torch.cuda.synchronize(self._buffer.device)  # the bytes are there before anyone is told
        return self._announced

    def _send(self, layout: Layout, tensors: list[torch.Tensor]) -> None:
        """Nothing goes over the group: the receivers copy before the barrier."""


class IpcReceiver(BroadcastReceiver):
    """A member of rank >= 1 holding engines on a GPU of this machine."""

    what = "CUDA IPC copy"

    def __init__(
        self,
        store: Store,
        group: Group,
        poll_interval: float = 0.05,
        device: torch.device | str = "cuda",
    ) -> None:
        self._mapped: tuple[bytes, torch.Tensor] | None = None
        super().__init__(store, group, poll_interval, device)

    def _fill(self, layout: Layout, buffer: torch.Tensor) -> None:
        version = layout.version
        check_owner(json.loads(self._announced_field(version, OWNER)), version)
        handle = self._announced_field(version, HANDLE)
        if self._mapped is None or self._mapped[0] != handle:
            self._mapped = None  # unmap the old buffer before mapping the new one
            self._mapped = (handle, open_shared(handle))
        source = self._mapped[1]
        if source.numel() != layout.total:
            raise WeightSyncError(
                f"weights v{version}: the shared buffer holds {source.numel()} bytes, the "
                f"layout {layout.total}"
            )
        buffer.copy_(source)
        torch.cuda.synchronize(buffer.device)  # copied before the barrier frees the publisher

    def close(self) -> None:
        super().close()
        self._mapped = None
