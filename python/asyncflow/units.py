"""Human-friendly sizes: ``"4GiB"``, ``"512MB"``, ``1_000_000``."""

from __future__ import annotations

import re

from asyncflow.errors import BadRequestError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(size: int | str | None) -> int | None:
    """Bytes in ``size`` (an int, or a string like ``"4GiB"``); ``None`` stays ``None``."""
    if size is None:
        return None
    if isinstance(size, bool):
        raise BadRequestError(f"not a size: {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise BadRequestError(f"a size cannot be negative: {size}")
        return size
    # A number as YAML spells integers: 4_000_000_000, 0x4000000.
    plain = re.sub(r"(?<=[0-9a-fA-F])_(?=[0-9a-fA-F])", "", size.strip())
    if re.fullmatch(r"0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+", plain):
        return int(plain, 0)
    m = _SIZE.match(plain)
    if not m or m.group(2).lower() not in _UNITS:
        raise BadRequestError(f"not a size: {size!r} (try e.g. '4GiB', '512MB', 1048576)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"
