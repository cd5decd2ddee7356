# Stubs of the compiled module; CI checks them: `python -m mypy.stubtest asyncflow._native`.
from typing import Any, final

import numpy as np
import numpy.typing as npt

__all__ = ["ChunkOwner", "RemoteStore", "Store", "__version__", "serve"]

__version__: str

@final
class ChunkOwner:
    def __len__(self) -> int: ...

# Stub-only: both backends have exactly these methods (the Python ``Store`` wraps either), but
# share no base class at run time.
class _Backend:
    def register_task(self, name: str) -> None: ...
    def put(
        self,
        fields: list[tuple[str, Any, str | None]],
        *,
        partition: str | None = None,
        indexes: npt.NDArray[np.uint64] | None = None,
        groups: npt.NDArray[np.int64] | None = None,
        group_size: int | None = None,
        versions: npt.NDArray[np.uint64] | None = None,
        tags: list[list[tuple[str, str]]] | None = None,
        timeout: float | None = None,
    ) -> npt.NDArray[np.uint64]: ...
    def claim(
        self,
        task: str,
        fields: list[str],
        batch_size: int,
        *,
        timeout: float | None = None,
        partition: str | None = None,
        min_version: int | None = None,
        whole_groups: bool = False,
        allow_partial: bool = False,
    ) -> tuple[
        int | None,
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.int64],
        float | None,
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
    def clear(self, partition: str) -> int: ...
    def delete(self, indexes: npt.NDArray[np.uint64]) -> None: ...
    def schema(self, field: str) -> tuple[str, list[int] | None]: ...
    def stats(self) -> dict[str, Any]: ...

@final
class Store(_Backend):
    def __new__(
        cls, shards: int = 8, memory_limit: int | None = None, lease_timeout: float = 30.0
    ) -> Store: ...

@final
class RemoteStore(_Backend):
    def __new__(
        cls, url: str, *, token: str | None = None, transport: str = "auto"
    ) -> RemoteStore: ...

def serve(args: list[str]) -> int: ...
