"""How Python values become store columns.

A field's value in a put is either one array whose first axis indexes rows (each row then holds
``value[i]``: a scalar for 1-D arrays, an array otherwise), or a list with one value per row —
arrays of differing first dimension (ragged, stored unpadded), Python numbers, or ``bytes``/``str``
(stored as bytes), or a :class:`Ragged`: a ragged column as one array and its rows' lengths, the
cheap way to put many ragged rows (no array per row). Torch tensors are accepted wherever arrays
are; bfloat16 is kept as bfloat16.

Non-contiguous or non-native-byte-order arrays are copied into contiguous ones here (one extra
copy); object and string arrays are rejected with :class:`SchemaError`. The store itself then
copies each field once into its own memory.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncflow.errors import BadRequestError, SchemaError

#: What ``Store.put`` hands the native module per field: name, value, explicit dtype, and the
#: rows' lengths of a :class:`Ragged` value.
NativeField = tuple[str, Any, str | None, np.ndarray | None]

_SCALARS = (bool, int, float, np.generic)


@dataclass(frozen=True)
class Ragged:
    """A ragged column in one piece: ``values``' first axis runs through every row's cells in
    turn, ``lengths[i]`` of them for row ``i`` (the lengths add up to ``len(values)``). It puts
    the same rows as the list ``[values[0:lengths[0]], values[lengths[0]:...], ...]``, without an
    array per row: token ids of many responses, say, concatenated once.

    ``values`` is an array or tensor with at least one axis (its further axes are each cell's
    trailing shape); ``lengths`` non-negative integers, one per row."""

    values: Any
    lengths: Any


def to_native(data: Mapping[str, Any]) -> list[NativeField]:
    """Normalises a put's ``{field: value}`` mapping for the native module."""
    if not isinstance(data, Mapping):
        raise BadRequestError(
            f"put takes a mapping of field name to values, not {type(data).__name__}"
        )
    if not data:
        raise BadRequestError("a put needs at least one field")
    return [
        _ragged(name, value) if isinstance(value, Ragged) else (name, *_column(name, value), None)
        for name, value in data.items()
    ]


def _ragged(name: str, value: Ragged) -> NativeField:
    values, dtype = _array(name, value.values)
    lengths = uint64_array(value.lengths, f"field {name!r}: the row lengths")
    return name, values, dtype, lengths


def _asarray(value: Any, error: type[Exception], what: str) -> np.ndarray:
    """``np.asarray``, with NumPy's refusals (ragged nesting, unconvertible values) raised as
    ``error`` about ``what``."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise error(f"{what}: {e}") from e


def uint64_array(values: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
    """A 1-D sequence of non-negative integers (row indexes, token counts) as a contiguous uint64
    array, or ``BadRequestError`` naming ``what``."""
    arr = _asarray(values, BadRequestError, what)
    if arr.size and arr.ndim == 1 and arr.dtype.kind in "fO" and not isinstance(values, np.ndarray):
        # NumPy makes floats of a list mixing uint64 (``batch.indexes``) with Python ints.
        try:
            ints = [operator.index(v) for v in values]
        except TypeError:
            raise BadRequestError(f"{what} must be a 1-D sequence of integers") from None
        if min(ints) < 0:
            raise BadRequestError(f"{what} cannot be negative")
        if max(ints) >= 1 << 64:
            raise BadRequestError(f"{what}: {max(ints)} is beyond a row index's 64 bits")
        return np.array(ints, dtype=np.uint64)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "ui"):
        raise BadRequestError(f"{what} must be a 1-D sequence of integers")
    if not arr.size:
        return np.empty(0, np.uint64)  # an empty list is float64 to NumPy; any empty dtype goes
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise BadRequestError(f"{what} cannot be negative")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _from_tensor(value: Any) -> tuple[np.ndarray, str | None]:
    import torch  # noqa: PLC0415 - store clients without tensors never pay torch's import

    t = value.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bf16"
    return t.numpy(), None


def _array(name: str, value: Any) -> tuple[np.ndarray, str | None]:
    """A tensor, an array or anything NumPy reads as one, as a storable array and its explicit
    dtype."""
    if _is_tensor(value):
        return _from_tensor(value)
    return _from_array(name, _asarray(value, SchemaError, f"field {name!r}")), None


def _from_array(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind in "OUSVMm":
        raise SchemaError(
            f"field {name!r}: {arr.dtype} arrays cannot be stored "
            "(use numeric arrays, or a list of bytes/str)"
        )
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    # Not np.ascontiguousarray: it turns 0-d arrays (scalar cells) into 1-d ones.
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _as_bytes(name: str, row: int, value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise SchemaError(f"field {name!r}: row {row} is {type(value).__name__}, row 0 is bytes/str")


def _column(name: str, value: Any) -> tuple[Any, str | None]:
    if _is_tensor(value):
        arr, dtype = _from_tensor(value)
        return arr, dtype
    if isinstance(value, np.ndarray):
        return _from_array(name, value), None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) == 0:
            raise BadRequestError(f"field {name!r} has no rows")
        first = value[0]
        if isinstance(first, (bytes, bytearray, memoryview, str)):
            return [_as_bytes(name, k, v) for k, v in enumerate(value)], None
        if isinstance(first, _SCALARS):
            return _array(name, value)
        return _cells(name, value)
    raise SchemaError(
        f"field {name!r}: expected an array, a tensor or a list with one value per row, "
        f"got {type(value).__name__}"
    )


def _cells(name: str, value: Sequence[Any]) -> tuple[list[np.ndarray], str | None]:
    cells: list[np.ndarray] = []
    dtypes: set[str | None] = set()
    for v in value:
        arr, dtype = _array(name, v)
        cells.append(arr)
        dtypes.add(dtype)
    if len(dtypes) > 1:
        raise SchemaError(f"field {name!r}: rows mix bfloat16 and other dtypes")
    return cells, dtypes.pop()


def pad(values: Sequence[np.ndarray], pad_value: float | np.generic) -> np.ndarray:
    """Stacks per-row arrays into one array, padding the first dimension with ``pad_value``."""
    if not values:
        return np.empty((0,))
    first = values[0]
    if first.ndim == 0:
        return np.array(values)
    longest = max(v.shape[0] for v in values)
    out = np.full((len(values), longest, *first.shape[1:]), pad_value, dtype=first.dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out
