"""The package's exceptions: the store's hierarchy, rooted at :class:`StoreError`, and
:class:`ConfigError` for an invalid configuration.

The native module raises these classes (one per Rust error variant). Each also derives from the
closest builtin, so ``except TimeoutError`` and ``except ValueError`` keep working. A failed call
leaves the store unchanged.
"""

from __future__ import annotations

import builtins

__all__ = [
    "AuthError",
    "BadRequestError",
    "ConfigError",
    "ConnectionError",
    "LeaseError",
    "MemoryLimitError",
    "PersistenceError",
    "SchemaError",
    "StoreError",
    "StoreTimeoutError",
    "TimeoutError",
    "UnknownFieldError",
    "UnknownIndexError",
    "UnknownTaskError",
]


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and what is wrong."""


class StoreError(Exception):
    """Base of every error raised by the sample store."""


class StoreTimeoutError(StoreError, builtins.TimeoutError):
    """A blocking call ran out of time; the message says what it waited for."""


#: The name used in docs and examples: ``af.TimeoutError`` (also a builtin ``TimeoutError``).
TimeoutError = StoreTimeoutError  # noqa: A001 - named like the builtin it subclasses, on purpose


class MemoryLimitError(StoreError):
    """A put does not fit in the store's memory limit, even after waiting."""


class SchemaError(StoreError, ValueError):
    """Data disagrees with a field's fixed dtype/shape, or a put is inconsistent."""


class UnknownFieldError(StoreError, LookupError):
    """A field that no put has written."""


class UnknownIndexError(StoreError, LookupError):
    """A row index that does not exist (or whose row was freed)."""


class UnknownTaskError(StoreError, LookupError):
    """A task that was never registered."""


class LeaseError(StoreError):
    """A lease that expired, was already acked or released, or does not hold the given rows."""


class BadRequestError(StoreError, ValueError):
    """Malformed arguments: bad sizes, options or names."""


class ConnectionError(StoreError, builtins.ConnectionError):  # noqa: A001 - the builtin it subclasses
    """The store daemon cannot be reached, or the connection broke."""


class AuthError(ConnectionError):
    """The daemon refused the connection's token."""


class PersistenceError(StoreError, OSError):
    """The daemon could not make a change durable (its write-ahead log failed); it refuses
    further changes until it is restarted."""
