"""AsyncFlow: asynchronous streaming RL post-training for LLMs, on a Rust sample store.

>>> import asyncflow as af
>>> store = af.Store(shards=8, memory_limit="1GiB")          # embedded, in this process
>>> remote = af.connect("tcp://127.0.0.1:7379")              # a daemon: same methods
"""

from asyncflow import scheduler
from asyncflow._native import __version__
from asyncflow.batch import Batch
from asyncflow.columns import Ragged
from asyncflow.daemon import connect
from asyncflow.errors import (
    AuthError,
    BadRequestError,
    ConnectionError,  # noqa: A004 - af.ConnectionError subclasses the builtin
    LeaseError,
    MemoryLimitError,
    PersistenceError,
    SchemaError,
    StoreError,
    StoreTimeoutError,
    TimeoutError,  # noqa: A004 - af.TimeoutError subclasses the builtin
    UnknownFieldError,
    UnknownIndexError,
    UnknownTaskError,
)
from asyncflow.options import ClaimOptions, PutOptions
from asyncflow.store import Rows, Store
from asyncflow.units import parse_size

__all__ = [
    "AuthError",
    "BadRequestError",
    "Batch",
    "ClaimOptions",
    "ConnectionError",
    "LeaseError",
    "MemoryLimitError",
    "PersistenceError",
    "PutOptions",
    "Ragged",
    "Rows",
    "SchemaError",
    "Store",
    "StoreError",
    "StoreTimeoutError",
    "TimeoutError",
    "UnknownFieldError",
    "UnknownIndexError",
    "UnknownTaskError",
    "__version__",
    "connect",
    "parse_size",
    "scheduler",
]
