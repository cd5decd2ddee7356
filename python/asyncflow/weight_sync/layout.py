"""The byte layout of one policy version: every tensor's name, dtype, shape and place in one flat
byte buffer, cut into fixed-size buckets for the wire. Sender and receivers agree on it through
the store (it is small), so the wire carries nothing but the bytes themselves."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

#: Each tensor starts at a multiple of this many bytes, so a view of the flat buffer can be
#: reinterpreted as any dtype.
ALIGN = 64
#: Tensors of at least this many bytes are sent straight from their own memory, alone; smaller
#: ones are packed together (one collective per tensor would cost more than the copy).
DIRECT_BYTES = 1 << 20

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    version: int
    tensors: tuple[TensorSpec, ...]
    #: Bytes of the flat buffer (the last tensor's end, aligned).
    total: int
    bucket_size: int

    @staticmethod
    def of(version: int, weights: Iterable[tuple[str, torch.Tensor]], bucket_size: int) -> Layout:
        specs, offset = [], 0
        for name, tensor in weights:
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise TypeError(f"weight {name!r} has dtype {tensor.dtype}, which cannot be sent")
            nbytes = tensor.numel() * tensor.element_size()
            specs.append(TensorSpec(name, dtype, tuple(tensor.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        if bucket_size <= 0:
            raise ValueError(f"bucket size must be positive, not {bucket_size}")
        return Layout(version, tuple(specs), offset, bucket_size)

    def segments(self) -> list[tuple[int, int, int | None]]:
        """The byte ranges sent one collective each, in order: ``(start, end, tensor)``, none
        longer than a bucket. A tensor of at least ``DIRECT_BYTES`` has segments of its own
        (``tensor`` is its index: they can be sent from its memory); each run of smaller
        tensors between them is cut into packed segments (``tensor`` None), which tensors may
        straddle. The gaps between runs (alignment padding) are not sent."""
        out: list[tuple[int, int, int | None]] = []

        def cut(lo: int, hi: int, tensor: int | None) -> None:
            out.extend(
                (start, min(start + self.bucket_size, hi), tensor)
                for start in range(lo, hi, self.bucket_size)
            )

        run: tuple[int, int] | None = None
        for i, spec in enumerate(self.tensors):
            if spec.nbytes >= DIRECT_BYTES:
                if run is not None:
                    cut(*run, None)
                    run = None
                cut(spec.offset, spec.offset + spec.nbytes, i)
            else:
                run = (spec.offset if run is None else run[0], spec.offset + spec.nbytes)
        if run is not None:
            cut(*run, None)
        return out

    def views(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors as views of ``buffer`` (flat ``uint8`` of ``total`` bytes); no copy."""
        if buffer.dtype != torch.uint8 or buffer.numel() != self.total:
            raise ValueError(f"a v{self.version} buffer is {self.total} bytes of uint8")
        return [
            (
                s.name,
                buffer[s.offset : s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape),
            )
            for s in self.tensors
        ]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "total": self.total,
                "bucket_size": self.bucket_size,
                "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self],
            }
        )

    @staticmethod
    def from_json(text: str | bytes) -> Layout:
        raw = json.loads(text)
        specs = tuple(
            TensorSpec(name, dtype, tuple(shape), offset, nbytes)
            for name, dtype, shape, offset, nbytes in raw["tensors"]
        )
        return Layout(int(raw["version"]), specs, int(raw["total"]), int(raw["bucket_size"]))

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes on the CPU (a copy only if it is elsewhere or
    not contiguous)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def pack(
    bucket: torch.Tensor,
    start: int,
    end: int,
    layout: Layout,
    tensors: list[torch.Tensor],
) -> torch.Tensor:
    """Copies the bytes ``[start, end)`` of the flat version into ``bucket``; returns the filled
    part of it. Tensors may straddle bucket ends; the alignment gaps are left as they are."""
    out = bucket[: end - start]
    on_cpu = out.device.type == "cpu"
    for spec, tensor in zip(layout.tensors, tensors, strict=True):
        lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
        if lo >= hi:
            continue
        src = as_bytes(tensor)[lo - spec.offset : hi - spec.offset]
        dst = out[lo - start : hi - start]
        if on_cpu and src.device.type == "cpu":
            # A plain memcpy: torch's copy_ of bytes runs at about half its speed here.
            np.copyto(dst.numpy(), src.numpy())
        else:
            dst.copy_(src)
    return out
