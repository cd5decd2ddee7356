"""``transferqueue/*`` and ``ray/*``: peers on the store suite's workload, each against our own
figure for the same case (``asyncflow-shm``: the daemon reached from the same machine, which is
how both peers run here too), so ``ratio`` = peer / ours. Peers get exactly our work: the same
rows, rounds and bytes per case, the same number of timed repeats, the same latency samples.

- TransferQueue 0.1.11 with its default SimpleStorage backend: ``put`` a TensorDict of the rows,
  ``get_meta`` (its claim: ready rows not yet consumed by the task), ``get_data``, and
  ``clear_samples`` (its ack: frees the rows).
- Ray's object store: ``ray.put`` of the rows and ``ray.get`` (zero-copy from shared memory). Ray
  has no claim, so it reports ``handoff_p50`` / ``handoff_p99`` instead: taking the next batch's
  reference from a ``ray.util.queue.Queue``, the usual way Ray workers hand batches to each
  other. The reference travels nested in a list, so the queue actor holds and returns only the
  reference; a bare ``ObjectRef`` argument would be resolved, and the batch copied into and out
  of the actor on every hand-off.

Peers that fail to import or start are reported as skipped, not as errors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncflow.bench.records import Report
from asyncflow.bench.workload import CLAIM_BATCH, Rounds, latency_samples, repeats

#: Seconds for a peer to do one case's rounds.
Timing = Callable[[Rounds], float]
#: p50 and p99 (µs) of a peer's claim (or hand-off) of rows of a size, over so many samples.
Latency = Callable[[int, int], tuple[float, float]]
#: Starts a peer; returns how to time it.
Setup = Callable[[bool], tuple[Timing, Latency]]

# As asyncflow.launch does, before Ray is imported: Ray's workers run in this environment, not in
# one that `uv run` builds again in a copy of the working directory (minutes before the first
# TransferQueue actor starts).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def ours(report: Report, label: str, metric: str) -> float | None:
    """Our figure for ``shm/<label>``, measured earlier in this run."""
    found = [r.value for r in report.records if r.case == f"shm/{label}" and r.metric == metric]
    return found[-1] if found else None


def latencies(
    claim: Callable[[], Any], undo: Callable[[Any], None], samples: int
) -> tuple[float, float]:
    lat = np.empty(samples)
    for i in range(samples):
        t0 = time.perf_counter()
        taken = claim()
        lat[i] = time.perf_counter() - t0
        undo(taken)
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def start_ray() -> None:
    """One Ray instance of our own for both peers, on loopback (never a cluster that something
    else on this machine started). TransferQueue's controller and two storage units each
    reserve a CPU, so four logical CPUs are declared whatever the machine has."""
    import ray

    from asyncflow.launch.ray_join import join

    if not ray.is_initialized():
        join(
            None, num_cpus=4, include_dashboard=False, log_to_driver=False,
            object_store_memory=2 << 30,
        )  # fmt: skip


def transferqueue_timings(quick: bool) -> tuple[Timing, Latency]:
    import torch  # noqa: PLC0415 - only this peer needs tensors; the store bench runs without torch
    import transfer_queue as tq
    from tensordict import TensorDict

    start_ray()
    tq.init()
    client = tq.get_client()

    def rounds(work: Rounds) -> float:
        data = TensorDict({"payload": torch.from_numpy(work.block)}, batch_size=work.rows)
        t0 = time.perf_counter()
        for _ in range(work.rounds):
            client.put(data, partition_id="bench")
            meta = client.get_meta(["payload"], work.rows, "bench", task_name="bench")
            client.get_data(meta)
            client.clear_samples(meta)
        return time.perf_counter() - t0

    def claim_latency(size: int, samples: int) -> tuple[float, float]:
        rows = max(1, min(256, (256 << 20) // size))
        block = torch.zeros((rows, size), dtype=torch.uint8)
        client.put(TensorDict({"lat": block}, batch_size=rows), partition_id="latency")
        batch = min(CLAIM_BATCH, rows)

        def claim() -> Any:
            return client.get_meta(["lat"], batch, "latency", task_name="latency")

        def undo(_: Any) -> None:
            client.reset_consumption("latency", "latency")

        result = latencies(claim, undo, samples)
        client.clear_partition("latency")
        return result

    return rounds, claim_latency


def ray_timings(quick: bool) -> tuple[Timing, Latency]:
    import ray
    from ray.util.queue import Queue

    start_ray()

    def rounds(work: Rounds) -> float:
        t0 = time.perf_counter()
        for _ in range(work.rounds):
            ref = ray.put(work.block)
            ray.get(ref)
            del ref
        return time.perf_counter() - t0

    def claim_latency(size: int, samples: int) -> tuple[float, float]:
        queue = Queue()
        ref = ray.put(np.zeros((min(CLAIM_BATCH, max(1, (256 << 20) // size)), size), np.uint8))
        queue.put([ref])  # nested: the queue passes the reference on, never the batch

        def claim() -> Any:
            return queue.get()

        def undo(taken: Any) -> None:
            assert isinstance(taken[0], ray.ObjectRef), "the queue resolved the reference"
            queue.put(taken)

        result = latencies(claim, undo, samples)
        queue.shutdown()
        return result

    return rounds, claim_latency


PEERS: dict[str, Setup] = {
    "transferqueue": transferqueue_timings,
    "ray": ray_timings,
}


def run(report: Report, sizes: dict[str, int], quick: bool) -> None:
    times = repeats(quick)
    samples = latency_samples(quick)
    for name, setup in PEERS.items():
        try:
            rounds, claim_latency = setup(quick)
        except Exception as e:  # a missing or broken peer is reported, not fatal
            report.progress(f"{name}: skipped ({type(e).__name__}: {e})")
            continue
        # Ray has no claim: what it is timed on is a hand-off, and named so.
        latency = "handoff" if name == "ray" else "claim"
        for label, size in sizes.items():
            report.progress(f"{name}/{label}: the same workload")
            work = Rounds.of(size, quick)
            seconds = min(rounds(work) for _ in range(times))
            report.add(
                f"{name}/{label}", "throughput", work.moved / seconds / 1e9, "GB/s",
                "asyncflow-shm", ours(report, label, "throughput"),
            )  # fmt: skip
            p50, p99 = claim_latency(size, samples)
            for metric, value in (("p50", p50), ("p99", p99)):
                report.add(
                    f"{name}/{label}", f"{latency}_{metric}", value, "us",
                    "asyncflow-shm", ours(report, label, f"claim_{metric}"),
                )  # fmt: skip
