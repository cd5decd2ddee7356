# Stubs of the compiled module; CI checks them: `python -m mypy.stubtest asyncflow._native`.
from collections.abc import Callable
from typing import Any, final

import numpy as np
import numpy.typing as npt

from asyncflow.options import ClaimOptions, PutOptions

__all__ = [
    "DEFAULT_LINEAR_WEIGHT",
    "DEFAULT_TIMEOUT",
    "ChunkOwner",
    "ClaimedCells",
    "EchoClient",
    "Router",
    "Store",
    "__version__",
    "claim_defaults",
    "costs",
    "echo_serve",
    "micro_batches",
    "partition",
    "serve",
    "simulate",
]

__version__: str
DEFAULT_LINEAR_WEIGHT: float
DEFAULT_TIMEOUT: float

@final
class ChunkOwner:
    def __len__(self) -> int: ...

@final
class ClaimedCells:
    def read(self, fields: list[str]) -> dict[str, list[Any]] | None: ...

@final
class Store:
    def __new__(
        cls, shards: int = 8, memory_limit: int | None = None, lease_timeout: float = 30.0
    ) -> Store: ...
    @staticmethod
    def connect(
        url: str,
        *,
        token: str | None = None,
        transport: str = "auto",
        request_timeout: float = 60.0,
        reconnect_timeout: float = 30.0,
    ) -> Store: ...
    def register_task(self, name: str, partitions: list[str] | None = None) -> None: ...
    def put(
        self,
        fields: list[tuple[str, Any, str | None, npt.NDArray[np.uint64] | None]],
        options: PutOptions | None = None,
        ack: int | None = None,
    ) -> npt.NDArray[np.uint64]: ...
    def claim(
        self, task: str, fields: list[str], batch_size: int, options: ClaimOptions | None = None
    ) -> tuple[
        int | None,
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.int64],
        float | None,
        ClaimedCells | None,
    ]: ...
    def ack(self, lease: int, indexes: npt.NDArray[np.uint64] | None = None) -> None: ...
    def release(self, lease: int, indexes: npt.NDArray[np.uint64] | None = None) -> None: ...
    def renew(self, lease: int, timeout: float | None = None) -> float: ...
    def read(self, indexes: npt.NDArray[np.uint64], fields: list[str]) -> dict[str, list[Any]]: ...
    def rows(
        self, indexes: npt.NDArray[np.uint64] | None = None, *, partition: str | None = None
    ) -> tuple[
        npt.NDArray[np.uint64],
        list[str],
        npt.NDArray[np.int64],
        npt.NDArray[np.uint64],
        list[list[tuple[str, str]]],
    ]: ...
    def ready_fields(self, indexes: npt.NDArray[np.uint64]) -> list[list[str]]: ...
    def clear(self, partition: str) -> int: ...
    def delete(self, indexes: npt.NDArray[np.uint64]) -> None: ...
    def schema(self, field: str) -> tuple[str, list[int] | None]: ...
    def stats(self) -> dict[str, Any]: ...

def claim_defaults() -> dict[str, Any]: ...
def costs(
    lengths: npt.NDArray[np.uint64], cost: str = "tokens", linear_weight: float | None = None
) -> npt.NDArray[np.float64]: ...
def partition(
    lengths: npt.NDArray[np.uint64],
    k: int,
    cost: str = "tokens",
    linear_weight: float | None = None,
    groups: npt.NDArray[np.int64] | None = None,
    equal_count: bool = False,
    method: str = "balanced",
) -> list[list[int]]: ...
def micro_batches(
    lengths: npt.NDArray[np.uint64],
    max_tokens: int,
    cost: str = "tokens",
    linear_weight: float | None = None,
    min_count: int = 1,
) -> list[list[int]]: ...

@final
class EchoClient:
    def __new__(cls, port: int) -> EchoClient: ...
    def round_trips(
        self, block: npt.NDArray[np.uint8], rounds: int, back: npt.NDArray[np.uint8]
    ) -> float: ...
    def close(self) -> None: ...

@final
class Router:
    def __new__(cls, heartbeat_timeout: float) -> Router: ...
    def add_engine(self, name: str, now: float) -> None: ...
    def report(self, engine: str, tokens: int, requests: int, now: float) -> None: ...
    def route(self, work: int, tokens: int, requests: int, now: float) -> str | None: ...
    def complete(self, work: int) -> str: ...
    def expire(self, now: float) -> list[tuple[int, str, str | None]]: ...
    def engines(self) -> list[tuple[str, int, int, bool, int]]: ...
    def assigned_to(self, work: int) -> str | None: ...

def serve(args: list[str], program: str = ...) -> int: ...
def echo_serve(on_listening: Callable[[int], object]) -> None: ...
def simulate(
    costs: dict[str, float],
    mode: str,
    devices: int | None = None,
    warmup_steps: int = 4,
    steps: int = 8,
) -> dict[str, Any]: ...
