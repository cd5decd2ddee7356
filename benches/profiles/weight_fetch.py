"""What a rollout worker's fetch of new weights costs its thread, alone in its process and beside
busy Python threads (a rollout process runs hundreds), against one daemon::

    .venv/bin/python benches/profiles/weight_fetch.py [FETCHES]

Publishes one version of 16 float32 tensors of 1 MiB (the pipeline suite's emulated weights,
``emulation.weights_mib``) over shared memory, then times ``weights.fetch`` of it FETCHES times
(default 50) with 0 and then 2 other threads spinning in Python. Per fetch, means: the calling
thread's CPU (``time.thread_time``) and its voluntary context switches. A call that lets go of
the GIL (a store request, most torch calls) has to take it back, and beside a busy thread that
means waiting for it.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

import asyncflow as af
from asyncflow import weights
from asyncflow.daemon import DaemonProcess
from asyncflow.telemetry.threads import voluntary_switches


def fetches(store: af.Store, n: int, busy: int) -> tuple[float, float]:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(100))

    spinners = [threading.Thread(target=spin) for _ in range(busy)]
    for t in spinners:
        t.start()
    try:
        switches, cpu = voluntary_switches(), time.thread_time()
        for _ in range(n):
            weights.fetch(store, 0)
        return (time.thread_time() - cpu) / n, (voluntary_switches() - switches) / n
    finally:
        stop.set()
        for t in spinners:
            t.join()


def main(n: int) -> None:
    with DaemonProcess() as daemon:
        store = af.connect(daemon.url, transport="shm")
        tensors = {f"layer.{i}.weight": torch.zeros(1 << 18) for i in range(16)}
        weights.publish(store, 0, iter(tensors.items()))
        weights.fetch(store, 0)  # the first read maps the segments
        print("busy threads   CPU per fetch (µs)   switches per fetch")
        for busy in (0, 2):
            cpu, switches = fetches(store, n, busy)
            print(f"{busy:12d} {1e6 * cpu:20.0f} {switches:20.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
