"""The ``weights`` suite: seconds from "the optimiser step is done" (the new version's tensors
exist on the trainer) to "the weights are loaded in the engine" (copied into the engine's own
parameters), per transport, for weight sets of 0.1, 0.5, 1 and 2 GB.

What is timed is the load into an engine's parameters, not generation: the engine here is a
stand-in holding one tensor per parameter and loading them in place with ``copy_``, as the hf
engine does (a real model of these sizes would not fit this suite's time on a CPU machine).

- ``store/<size>``: publish into an embedded store, then load from its zero-copy views (one
  process: the default job's layout). Baseline ``memcpy``: ``numpy.copyto`` of the same bytes,
  tensor by tensor, into buffers of their own, in the same process.
- ``broadcast/<size>``: rank 0 (this process) broadcasts over a gloo group on loopback to one
  receiving process, which swaps the version in and loads it into its engine; the clock stops
  when that load returns (CLOCK_MONOTONIC, shared by the processes). Baseline
  ``broadcast-raw``: one ``broadcast`` of the same bytes as one flat tensor over the same group,
  until the receiver has them.

On a machine with CUDA, each size also gets GPU cases, the trainer's tensors and the engine's
parameters both on the GPU (one GPU: NCCL cannot put two members on one, so ``broadcast`` stays
on gloo and host memory there):

- ``ipc/<size>``: the ``ipc`` transport to one receiving process on the same GPU (CUDA IPC,
  no host copy). Baseline ``d2d``: a device-to-device ``copy_`` of the same bytes, tensor by
  tensor, in one process.
- ``store-cuda/<size>``: the ``store`` transport from GPU tensors to a GPU engine (the version
  goes to host memory and back). Baseline ``roundtrip``: each tensor copied to host memory and
  back into a GPU buffer of its own, in one process.

Weight sets are whole decoder layers shaped like Qwen2-1.5B's (``config.json`` of
``Qwen/Qwen2-1.5B``: hidden_size 1536, intermediate_size 8960, 12 attention heads, 2 key-value
heads, head_dim 128; bfloat16), as many as come nearest the size. Each case is timed
``REPEATS`` times after ``WARM_UP`` untimed rounds; the record is the mean, with the range beside
it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import asyncflow as af
from asyncflow import weights
from asyncflow.bench.records import Report
from asyncflow.daemon import DaemonProcess
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.engines.process_group import listening
from asyncflow.weight_sync.broadcast import BroadcastPublisher, BroadcastReceiver
from asyncflow.weight_sync.group import Group, GroupSpec
from asyncflow.weight_sync.ipc import IpcPublisher, IpcReceiver
from asyncflow.weight_sync.layout import as_bytes
from asyncflow.weight_sync.store_transport import StorePublisher, StoreReceiver

#: Qwen2-1.5B (config.json of Qwen/Qwen2-1.5B).
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 1536, 8960, 12, 2, 128
SIZES_GB = (0.1, 0.5, 1.0, 2.0)
QUICK_SIZES_GB = (0.01, 0.05)
REPEATS = 3
#: Untimed rounds before each case's timings (every case, baselines alike), so that each has
#: touched every buffer it cycles through: first touches are page faults, not data movement.
#: The store keeps ``KEEP_VERSIONS`` versions and deletes the oldest only once a new one is in,
#: so a put first reuses memory at version ``KEEP_VERSIONS + 2``: that many rounds less one
#: (a broadcast receiver cycles through two staging buffers, fewer).
WARM_UP = weights.KEEP_VERSIONS + 1
BUCKET = 64 << 20
#: Copies of a weight set alive at once at the suite's peak (the broadcast case: the trainer's,
#: the baseline's flat buffer on both sides, the receiver's two staging buffers and its engine).
PEAK_COPIES = 6


def layer_shapes(layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """One Qwen2 decoder layer's parameters (bias on q, k, v only, as in Qwen2)."""
    p = f"model.layers.{layer}."
    kv = KV_HEADS * HEAD_DIM
    return [
        (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
        (p + "self_attn.q_proj.bias", (HEADS * HEAD_DIM,)),
        (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
        (p + "self_attn.k_proj.bias", (kv,)),
        (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
        (p + "self_attn.v_proj.bias", (kv,)),
        (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
        (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
        (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
        (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        (p + "input_layernorm.weight", (HIDDEN,)),
        (p + "post_attention_layernorm.weight", (HIDDEN,)),
    ]


def layer_bytes() -> int:
    return sum(2 * _numel(shape) for _, shape in layer_shapes(0))


def layers_for(gigabytes: float) -> int:
    return max(1, round(gigabytes * 1e9 / layer_bytes()))


def weight_set(layers: int, fill: Callable[[tuple[int, ...]], torch.Tensor]) -> list[Any]:
    return [(name, fill(shape)) for i in range(layers) for name, shape in layer_shapes(i)]


def random_weights(layers: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return weight_set(
        layers, lambda shape: torch.randn(shape, generator=generator).to(torch.bfloat16)
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class HeldWeights(RolloutEngine):
    """A stand-in engine: parameters only, loaded in place as the hf engine loads them."""

    name = "held-weights"

    def __init__(self, layers: int, device: str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.params = dict(
            weight_set(
                layers, lambda shape: torch.zeros(shape, dtype=torch.bfloat16, device=device)
            )
        )

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        raise NotImplementedError("the stand-in engine only holds weights")

    @torch.no_grad()
    def load_weights(self, version: int, weights: Any) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)
        _synchronize(self.device)
        self.version = version


def _synchronize(device: torch.device) -> None:
    """Waits for the GPU's queued copies (a no-op on the CPU), so that clocks stop after them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(times: list[float]) -> tuple[float, float, float]:
    return statistics.fmean(times), min(times), max(times)


def _add(
    report: Report, case: str, nbytes: int, times: list[float], baseline: str, base: list[float]
) -> None:
    mean, lo, hi = _summary(times)
    b_mean = statistics.fmean(base)
    report.add(case, "seconds", mean, "s", baseline, b_mean)
    report.add(case, "seconds_min", lo, "s")
    report.add(case, "seconds_max", hi, "s")
    report.add(case, "throughput", nbytes / mean / 1e9, "GB/s", baseline, nbytes / b_mean / 1e9)


def _baseline(report: Report, case: str, times: list[float]) -> None:
    mean, lo, hi = _summary(times)
    report.add(case, "seconds", mean, "s")
    report.add(case, "seconds_min", lo, "s")
    report.add(case, "seconds_max", hi, "s")


# -- the receiving process ---------------------------------------------------------------------


def _receiver_main(spec: GroupSpec, store_url: str, transport: str, conn: Any) -> None:
    """Rank 1: answers the bench's commands until told to stop."""
    store = af.connect(store_url)
    group = Group(spec, 1, "bench receiver")
    device = "cuda" if transport == "ipc" else "cpu"
    receiver = (
        IpcReceiver(store, group, poll_interval=0.005)
        if transport == "ipc"
        else BroadcastReceiver(store, group, poll_interval=0.005)
    )
    engine: HeldWeights | None = None
    flat: torch.Tensor | None = None
    while True:
        command, argument = conn.recv()
        if command == "stop":
            receiver.close()
            return
        if command == "raw":
            if flat is None or flat.numel() != argument:
                flat = None
                flat = torch.zeros(argument, dtype=torch.uint8)  # touched: a warm buffer
            conn.send("ready")
            group.broadcast(flat).wait()
            conn.send(time.monotonic())
        elif command == "engine":
            engine = flat = None  # the baseline's buffer is done with: free it first
            engine = HeldWeights(argument, device)
            conn.send("ready")
        elif command == "load":
            assert engine is not None
            if not receiver.wait_for(argument, 600):
                raise TimeoutError(f"weights v{argument} never arrived")
            receiver.load(engine, argument)
            conn.send(time.monotonic())


# -- the cases ---------------------------------------------------------------------------------


def _timings(round_: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` rounds, after ``WARM_UP`` untimed ones."""
    times = []
    for _ in range(WARM_UP + repeats):
        t0 = time.monotonic()
        round_()
        times.append(time.monotonic() - t0)
    return times[WARM_UP:]


def memcpy_times(weights: list[tuple[str, torch.Tensor]], repeats: int) -> list[float]:
    """``numpy.copyto`` of each tensor's bytes into a buffer of its own (one thread)."""
    sources = [as_bytes(t).numpy() for _, t in weights]
    targets = [np.empty_like(s) for s in sources]

    def round_() -> None:
        for source, target in zip(sources, targets, strict=True):
            np.copyto(target, source)

    return _timings(round_, repeats)


def d2d_times(weights: list[tuple[str, torch.Tensor]], repeats: int) -> list[float]:
    """A device-to-device ``copy_`` of each (GPU) tensor into a buffer of its own."""
    return _copy_times(weights, repeats, lambda t: t)


def roundtrip_times(weights: list[tuple[str, torch.Tensor]], repeats: int) -> list[float]:
    """Each (GPU) tensor copied to host memory and back into a GPU buffer of its own."""
    return _copy_times(weights, repeats, lambda t: t.cpu())


def _copy_times(
    weights: list[tuple[str, torch.Tensor]],
    repeats: int,
    source: Callable[[torch.Tensor], torch.Tensor],
) -> list[float]:
    """Each tensor ``copy_``-ed from ``source(tensor)`` into a buffer of its own on its device,
    until the device is done."""
    targets = [torch.empty_like(t) for _, t in weights]

    def round_() -> None:
        for (_, tensor), target in zip(weights, targets, strict=True):
            target.copy_(source(tensor))
        _synchronize(targets[0].device)

    return _timings(round_, repeats)


def store_times(
    weights: list[tuple[str, torch.Tensor]], layers: int, repeats: int, device: str = "cpu"
) -> list[float]:
    store = af.Store(shards=8)
    publisher, receiver = StorePublisher(store), StoreReceiver(store)
    engine = HeldWeights(layers, device)
    versions = itertools.count(1)

    def round_() -> None:
        version = next(versions)
        publisher.publish(version, weights)
        receiver.load(engine, version)

    return _timings(round_, repeats)


class BroadcastBench:
    """This process (rank 0) and one receiving process, over one gloo group on loopback; the
    ``broadcast`` transport, or ``ipc`` (the receiver's engine on this process's GPU)."""

    def __init__(self, transport: str = "broadcast") -> None:
        self.daemon = DaemonProcess()
        self.store = self.daemon.connect()
        listener, port = listening()
        spec = GroupSpec(port=port, world_size=2, timeout=600.0, backend="gloo")
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.proc = context.Process(
            target=_receiver_main, args=(spec, self.daemon.url, transport, theirs), daemon=True
        )
        self.proc.start()
        theirs.close()
        self.group = Group(spec, 0, "bench trainer rank 0", listener)
        self.publisher = (
            IpcPublisher(self.store, self.group)
            if transport == "ipc"
            else BroadcastPublisher(self.store, self.group, BUCKET)
        )
        self.version = 0

    def _ask(self, command: str, argument: Any) -> Any:
        self.conn.send((command, argument))
        if not self.conn.poll(900):
            raise TimeoutError(f"the receiving process did not answer {command!r}")
        return self.conn.recv()

    def raw_times(self, nbytes: int, repeats: int) -> list[float]:
        flat = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        times = []
        for _ in range(WARM_UP + repeats):
            assert self._ask("raw", nbytes) == "ready"
            t0 = time.monotonic()
            self.group.broadcast(flat).wait()
            times.append(self.conn.recv() - t0)
        return times[WARM_UP:]

    def transport_times(
        self, weights: list[tuple[str, torch.Tensor]], layers: int, repeats: int
    ) -> list[float]:
        assert self._ask("engine", layers) == "ready"
        times = []
        for _ in range(WARM_UP + repeats):
            self.version += 1
            self.conn.send(("load", self.version))
            t0 = time.monotonic()
            self.publisher.publish(self.version, weights)
            if not self.conn.poll(900):
                raise TimeoutError(f"the receiving process did not load v{self.version}")
            times.append(self.conn.recv() - t0)
        return times[WARM_UP:]

    def close(self) -> None:
        self.conn.send(("stop", None))
        self.proc.join(timeout=30)
        self.group.close()
        self.daemon.stop()


def available_bytes() -> int:
    with Path("/proc/meminfo").open() as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run(report: Report, quick: bool = False) -> None:
    sizes, repeats = (QUICK_SIZES_GB, 1) if quick else (SIZES_GB, REPEATS)
    report.note(
        f"weight sets: whole Qwen2-1.5B-shaped decoder layers of {layer_bytes() / 1e6:.1f} MB "
        f"(bfloat16); {repeats} timings per case after {WARM_UP} untimed, mean (with "
        f"seconds_min/max); broadcast buckets of {BUCKET >> 20} MiB; timed until the weights "
        "are in a stand-in engine's "
        "parameters (not until it generates)"
    )
    bench = BroadcastBench()
    ipc = BroadcastBench("ipc") if torch.cuda.is_available() else None
    if ipc is not None:
        report.note(f"GPU cases on {torch.cuda.get_device_name()}")
    try:
        for gb in sizes:
            layers = layers_for(gb)
            nbytes = layers * layer_bytes()
            need = PEAK_COPIES * nbytes
            if need > available_bytes():
                report.note(
                    f"{gb:g}GB left out: its peak of {need / 1e9:.1f} GB is more than the "
                    f"{available_bytes() / 1e9:.1f} GB of memory available now"
                )
                continue
            label = f"{gb:g}GB"
            report.note(f"{label}: {layers} layers, {nbytes / 1e9:.3f} GB")
            weights = random_weights(layers, seed=layers)
            memcpy = memcpy_times(weights, repeats)
            _baseline(report, f"memcpy/{label}", memcpy)
            _add(
                report,
                f"store/{label}",
                nbytes,
                store_times(weights, layers, repeats),
                "memcpy",
                memcpy,
            )
            raw = bench.raw_times(nbytes, repeats)
            _baseline(report, f"broadcast-raw/{label}", raw)
            ours = bench.transport_times(weights, layers, repeats)
            _add(report, f"broadcast/{label}", nbytes, ours, "broadcast-raw", raw)
            if ipc is not None:
                _gpu_cases(report, ipc, weights, layers, label, nbytes, repeats)
            del weights
    finally:
        bench.close()
        if ipc is not None:
            ipc.close()


def _gpu_cases(
    report: Report,
    ipc: BroadcastBench,
    weights: list[tuple[str, torch.Tensor]],
    layers: int,
    label: str,
    nbytes: int,
    repeats: int,
) -> None:
    on_gpu = [(name, t.cuda()) for name, t in weights]
    d2d = d2d_times(on_gpu, repeats)
    _baseline(report, f"d2d/{label}", d2d)
    _add(report, f"ipc/{label}", nbytes, ipc.transport_times(on_gpu, layers, repeats), "d2d", d2d)
    roundtrip = roundtrip_times(on_gpu, repeats)
    _baseline(report, f"roundtrip/{label}", roundtrip)
    ours = store_times(on_gpu, layers, repeats, "cuda")
    _add(report, f"store-cuda/{label}", nbytes, ours, "roundtrip", roundtrip)
    del on_gpu
    torch.cuda.empty_cache()
