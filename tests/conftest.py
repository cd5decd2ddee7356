"""Shared fixtures. The store suites run against every backend through `make_store`."""

from __future__ import annotations

import os

# As the CLI does: one OpenMP thread per worker, set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import asyncflow as af

BACKENDS = ["embedded"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_store(backend: str) -> Iterator[Callable[..., af.Store]]:
    """Builds stores of the parametrised backend with the given settings."""

    def make(**settings: Any) -> af.Store:
        if backend == "embedded":
            return af.Store(**settings)
        raise AssertionError(f"unknown backend {backend}")

    yield make


@pytest.fixture
def store(make_store: Callable[..., af.Store]) -> af.Store:
    return make_store(shards=4, memory_limit="256MiB", lease_timeout=30.0)
