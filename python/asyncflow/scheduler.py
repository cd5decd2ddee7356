"""Proactive load balancing, computed in the Rust core.

Pull-based claims balance load dynamically (a faster worker claims more often). What pulling
cannot do is split one training step evenly over data-parallel ranks when response lengths are
long-tailed; this module does that, cuts a rank's rows into token-bounded micro-batches, and
routes prompt groups to the least-loaded rollout engine.

Costs: ``"tokens"`` balances token counts; ``"attention"`` balances ``tokens² + linear_weight ·
tokens``, which accounts for attention's quadratic work (``linear_weight ≈ 6 · hidden_size`` for a
dense transformer; the default assumes a hidden size of 4096).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from asyncflow import _native
from asyncflow.columns import uint64_array
from asyncflow.errors import BadRequestError

__all__ = [
    "DEFAULT_LINEAR_WEIGHT",
    "Cost",
    "EngineState",
    "Method",
    "Rerouted",
    "Router",
    "costs",
    "micro_batches",
    "partition",
]

Cost = Literal["tokens", "attention"]
Method = Literal["balanced", "kk", "lpt", "round_robin"]

#: ``linear_weight`` of the attention cost for a hidden size of 4096 (6 · 4096).
DEFAULT_LINEAR_WEIGHT: float = _native.DEFAULT_LINEAR_WEIGHT


def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    return uint64_array(lengths, "token lengths")


def costs(
    lengths: Sequence[int] | np.ndarray,
    cost: Cost = "tokens",
    *,
    linear_weight: float = DEFAULT_LINEAR_WEIGHT,
) -> np.ndarray:
    """The cost of each row under a cost model (float64)."""
    return _native.costs(_lengths(lengths), cost, linear_weight)


def partition(
    lengths: Sequence[int] | np.ndarray,
    k: int,
    cost: Cost = "tokens",
    groups: Sequence[int] | np.ndarray | None = None,
    equal_count: bool = False,
    *,
    linear_weight: float = DEFAULT_LINEAR_WEIGHT,
    method: Method = "balanced",
) -> list[list[int]]:
    """Splits rows of the given token ``lengths`` into ``k`` data-parallel parts, making the
    costliest part (which every other rank waits for) as cheap as possible.

    Returns each part's indexes into ``lengths``, ascending; parts come in order of their first
    row, empty parts last. ``groups`` (one id per row) keeps rows with the same id in one part;
    ``equal_count`` gives every part ``⌊n/k⌋`` or ``⌈n/k⌉`` rows (with groups: as many groups ±1,
    and all groups must have the same size). ``method``: ``"balanced"`` (the better of largest
    differencing and greedy LPT, improved by local search; never worse than LPT), or one
    ingredient alone: ``"kk"``, ``"lpt"``, ``"round_robin"`` (ignores costs; a baseline).
    """
    if k < 1:
        raise BadRequestError(f"k must be at least 1, not {k}")
    group_ids = None
    if groups is not None:
        group_ids = np.ascontiguousarray(np.asarray(groups), dtype=np.int64)
        if group_ids.ndim != 1:
            raise BadRequestError("groups must be a 1-D sequence of group ids")
    return _native.partition(
        _lengths(lengths),
        k,
        cost,
        linear_weight,
        group_ids,
        equal_count,
        method,
    )


def micro_batches(
    lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    cost: Cost = "tokens",
    *,
    min_count: int = 1,
    linear_weight: float = DEFAULT_LINEAR_WEIGHT,
) -> list[list[int]]:
    """Splits one rank's rows into as few micro-batches of at most ``max_tokens`` tokens as the
    budget allows, with costs as even as possible; returns indexes into ``lengths``.

    Micro-batches come costliest first (a rank that runs out of memory does so at once). At least
    ``min_count`` are returned, e.g. the most any data-parallel rank needs, so that every rank
    runs the same number (some may be empty). A row longer than ``max_tokens`` raises
    ``BadRequestError``.
    """
    if min_count < 0:
        raise BadRequestError(f"min_count must be >= 0, not {min_count}")
    return _native.micro_batches(_lengths(lengths), max_tokens, cost, linear_weight, min_count)


@dataclass(frozen=True)
class Rerouted:
    """Work moved off an engine that stopped reporting; ``to`` is None when no engine was left
    (the router then forgets the work, and the caller routes it again later)."""

    work: int
    source: str
    to: str | None


@dataclass(frozen=True)
class EngineState:
    """An engine as the router sees it: its last report plus work routed to it since."""

    name: str
    tokens: int
    requests: int
    in_rotation: bool
    assigned: int


class Router:
    """Routes prompt groups to the rollout engine with the least outstanding work.

    Engines ``report`` their outstanding tokens and requests; between reports the router adds the
    work it has routed to them since. An engine silent for ``heartbeat_timeout`` seconds gets no
    new work, and ``expire`` takes it out of rotation and routes its unfinished work elsewhere
    (call it regularly, e.g. before each routing round); a report brings it back. ``now`` is
    seconds on ``time.monotonic()``'s clock unless given (pass it to run under a test's clock).
    """

    def __init__(
        self,
        engines: Sequence[str] = (),
        *,
        heartbeat_timeout: float = 30.0,
        now: float | None = None,
    ) -> None:
        self._native = _native.Router(heartbeat_timeout)
        for name in engines:
            self.add_engine(name, now=now)

    @staticmethod
    def _now(now: float | None) -> float:
        return time.monotonic() if now is None else now

    def add_engine(self, name: str, *, now: float | None = None) -> None:
        """Puts an engine into rotation with no load, as if it had just reported."""
        self._native.add_engine(name, self._now(now))

    def report(self, engine: str, tokens: int, requests: int, *, now: float | None = None) -> None:
        """Records an engine's outstanding load; an engine out of rotation rejoins it."""
        self._native.report(engine, tokens, requests, self._now(now))

    def route(
        self, work: int, tokens: int, requests: int = 1, *, now: float | None = None
    ) -> str | None:
        """Routes ``work`` (e.g. a prompt group id) with its expected tokens and requests to the
        least-loaded live engine; returns its name, or None if no engine is live."""
        return self._native.route(work, tokens, requests, self._now(now))

    def complete(self, work: int) -> str:
        """Marks ``work`` finished; returns the engine it was assigned to."""
        return self._native.complete(work)

    def expire(self, *, now: float | None = None) -> list[Rerouted]:
        """Takes silent engines out of rotation and routes their unfinished work elsewhere."""
        moved = self._native.expire(self._now(now))
        return [Rerouted(work, source, to) for work, source, to in moved]

    def engines(self) -> list[EngineState]:
        """Every engine, in the order they were added."""
        return [EngineState(*row) for row in self._native.engines()]

    def assigned_to(self, work: int) -> str | None:
        """The engine ``work`` is assigned to, if it is routed and unfinished."""
        return self._native.assigned_to(work)
