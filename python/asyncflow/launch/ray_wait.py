"""What the launcher asks of a Ray cluster, checked against what the cluster has, and waits that
say what they wait for.

Ray's CPU (and custom) resources are logical: a node declares how many it has, and placement
groups and actors reserve from that count, not from the processor. So the launcher sizes a Ray
instance it starts itself to what the run's placement needs (:func:`cpus_to_start`), and a
placement that can never fit the cluster's *total* resources (not merely what is free now) is an
error at once (:func:`check_fits`) rather than a wait until ``ray.start_timeout``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import ray

Bundle = dict[str, float]
Say = Callable[[str], None]

#: Seconds between two lines saying what a long wait waits for.
SAY_EVERY = 5.0


class PlacementError(RuntimeError):
    """The run's placement can never fit the cluster it joined."""


def total(bundles: list[Bundle]) -> Bundle:
    """The resources of ``bundles`` summed, by name."""
    sums: Bundle = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            sums[name] = sums.get(name, 0.0) + amount
    return sums


def cpus_to_start(demand: Bundle) -> int:
    """Logical CPUs for a Ray instance started for the run: the machine's, or what the run's
    placement reserves in all where that is more (the actors mostly wait on each other, as the
    local launcher's threads do, so they share the processors)."""
    need = demand.get("CPU", 0.0)
    return max(os.cpu_count() or 1, int(-(-need // 1)))


def _fmt(resources: Bundle) -> str:
    shown = {k: round(v, 2) for k, v in sorted(resources.items()) if k in ("CPU", "GPU") or v}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


def check_fits(groups: dict[str, list[Bundle]], nodes: list[Bundle]) -> None:
    """Raises :class:`PlacementError`, naming demand and capacity, when ``groups`` (bundles by
    role) could never be placed on nodes with these total resources: a bundle larger than every
    node, or more of a resource in all than the cluster has."""
    capacity = total(nodes)
    demand = total([b for bundles in groups.values() for b in bundles])
    for role, bundles in groups.items():
        for bundle in bundles:
            if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
                raise PlacementError(
                    f"the {role} placement group's bundle {_fmt(bundle)} fits on no node of the "
                    f"cluster (nodes have {', '.join(_fmt(n) for n in nodes) or 'nothing'}); "
                    f"lower its ray.* resources or add a node that has them"
                )
    short = {k: v for k, v in demand.items() if v > capacity.get(k, 0.0) + 1e-9}
    if short:
        by_role = "; ".join(f"{role} {_fmt(total(b))}" for role, b in groups.items() if b)
        raise PlacementError(
            f"the run's placement needs {_fmt(demand)} in all ({by_role}), the cluster has "
            f"{_fmt(capacity)} in all: it can never fit; lower ray.trainer_cpus, "
            f"ray.rollout_cpus, ray.worker_cpus (or the GPUs), or join a larger cluster"
        )


def node_resources() -> list[Bundle]:
    """The total resources of each alive node of the cluster joined."""
    return [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]


def wait(
    refs: list[Any],
    what: str,
    timeout: float,
    say: Say | None,
    detail: Callable[[], str] | None = None,
    every: float = SAY_EVERY,
    clock: Callable[[], float] = time.monotonic,
) -> list[Any]:
    """``ray.get(refs)`` within ``timeout`` seconds, saying every ``every`` seconds what it still
    waits for (``what``, then ``detail()``); a :class:`TimeoutError` naming it past ``timeout``."""
    start = clock()
    pending = list(refs)
    last_said = start
    while pending:
        now = clock()
        left = start + timeout - now
        if left <= 0:
            extra = f"; {detail()}" if detail is not None else ""
            raise TimeoutError(f"waited {timeout:.0f}s (ray.start_timeout) for {what}{extra}")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(left, every, 1.0))
        now = clock()
        due = now - last_said >= every and now < start + timeout
        if pending and say is not None and due:
            last_said = now
            extra = f" ({detail()})" if detail is not None else ""
            say(f"waiting {now - start:.0f}s for {what}{extra}")
    return list(ray.get(refs))
