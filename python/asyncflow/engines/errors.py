"""Errors of the engines. Every message names the engine and what was being waited for, so that a
run that cannot go on says why instead of hanging."""

from __future__ import annotations

import builtins


class EngineError(RuntimeError):
    """An engine failed; the message names it."""


class EngineStartError(EngineError):
    """An engine could not be started (missing package, bad model, a rank that exited)."""


class EngineTimeoutError(EngineError, builtins.TimeoutError):
    """An engine did not answer in time; the message says what was waited for."""


class EngineDiedError(EngineError):
    """An engine's process exited while it was working or being waited for."""


class WeightLoadError(EngineError, ValueError):
    """A version of the weights could not be loaded (a missing tensor, a wrong shape, a
    truncated publication); the engine still holds, whole, the version it had. ``version``: the
    version refused, where the raiser knows it (a weight source may load a newer version than
    the one it was asked for, and the failure must name the one that failed)."""

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message)
        self.version = version
