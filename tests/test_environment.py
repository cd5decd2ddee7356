"""The environment the set-up builds: every heavy dependency comes with its bytecode. Where Python
may not write its cache (``PYTHONDONTWRITEBYTECODE``, as on these machines), a module without it
is compiled from source by every process that imports it: 17 s of a one-step job here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "deepspeed", "vllm", "torch._inductor.compile_fx")


@pytest.mark.parametrize("name", HEAVY)
def test_the_heavy_dependencies_are_installed_with_their_bytecode(name: str) -> None:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None
    cached = Path(importlib.util.cache_from_source(spec.origin))
    assert cached.is_file(), f"no bytecode for {name} at {cached}: run `make setup`"
    # Valid as Python checks it (PEP 552): timestamp-based, naming its source's mtime and size.
    header = cached.read_bytes()[:16]
    assert header[:4] == importlib.util.MAGIC_NUMBER
    flags, mtime, size = (int.from_bytes(header[i : i + 4], "little") for i in (4, 8, 12))
    source = Path(spec.origin).stat()
    assert flags == 0 and (mtime, size) == (int(source.st_mtime) & 0xFFFFFFFF, source.st_size)
