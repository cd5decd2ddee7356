"""One process of an emulated pipeline: ``python -m asyncflow.bench.emulation.process SPEC``.

It connects to the store daemon, builds its device pool, the emulated engines and the real
workers of its roles, runs them in threads until its trainer finishes (or, without one, until
SIGTERM), and writes a report: busy spans per role, CPU seconds (and of them, those of the emulated
devices' serving threads), and the trainer's clock.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import asyncflow as af
from asyncflow import weights
from asyncflow.bench import costs as cost_model
from asyncflow.bench.costs import CostModel
from asyncflow.bench.emulation.devices import BusyMeter, DecodeDevice, DevicePool
from asyncflow.bench.emulation.engines import (
    CALLS,
    EmulatedPartialRollout,
    EmulatedRollout,
    EmulatedTask,
    EmulatedTokenizer,
    EmulatedTrainer,
    ModelledVerifier,
)
from asyncflow.bench.emulation.modes import (
    ALL_MODES,
    Mode,
    ProcessSpec,
    job_config,
    placement,
    rollout_calls,
)
from asyncflow.launch.local import run_threads
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.telemetry.trace import Tracer
from asyncflow.workers.advantage import AdvantageWorker
from asyncflow.workers.base import Context, RunState, Worker
from asyncflow.workers.feeder import Feeder
from asyncflow.workers.partial import PartialRollout
from asyncflow.workers.reference import ReferenceWorker
from asyncflow.workers.reward import RewardWorker
from asyncflow.workers.rollout import Rollout
from asyncflow.workers.trainer import Ledger, Trainer


def rollout_workers(
    ctx: Context, costs: CostModel, mode: Mode, pool: DevicePool, meter: BusyMeter
) -> tuple[list[Worker], list[DecodeDevice]]:
    """Real rollout workers, several per emulated device when the mode keeps calls in flight."""
    place = placement(mode, costs)
    per_device, groups = rollout_calls(mode, costs, place.rollout_devices)
    ctx.config.rollout.groups_per_call = groups
    load_s = 0.0 if place.colocated else costs.rollout.weight_load_s
    workers: list[Worker] = []
    devices = []
    for d in range(place.rollout_devices):
        device = DecodeDevice(
            f"device-{d}", costs.rollout, pool, meter, costs.emulation.compression
        )
        devices.append(device)
        if mode.partial != "off":
            # One worker drives the device request by request (see job_config's max_num_seqs).
            step_timeout = ctx.config.run.poll_interval / 10
            partial = EmulatedPartialRollout(device, costs, load_s, step_timeout)
            workers.append(PartialRollout(ctx, partial, f"rollout-{d}"))
            continue
        engine = EmulatedRollout(device, costs, load_s)
        workers += [Rollout(ctx, engine, f"rollout-{d}.{k}") for k in range(per_device)]
    return workers, devices


def trainer_worker(
    ctx: Context, costs: CostModel, mode: Mode, pool: DevicePool, run_dir: Path
) -> tuple[Trainer, MetricsLog]:
    """The real trainer on an emulated data-parallel engine; publishes version 0 first, as the
    main job does."""
    place = placement(mode, costs)
    publish_s = 0.0 if place.colocated else costs.network.publish_s(place.rollout_devices)
    engine = EmulatedTrainer(pool, costs, costs.trainer.tokens_per_s, publish_s)
    metrics = MetricsLog(run_dir, loggers=())  # metrics.jsonl only: no tracker to finish
    weights.publish(ctx.store, 0, engine.export_weights())
    return Trainer(ctx, engine, metrics, Ledger(run_dir / "ledger.jsonl")), metrics


def build(
    spec: ProcessSpec, ctx: Context, meter: BusyMeter
) -> tuple[list[Worker], list[Any], list[DecodeDevice]]:
    """The workers of this process, what to close afterwards, and its emulated decode devices."""
    costs = cost_model.from_dict(spec.costs)
    mode = ALL_MODES[spec.mode]
    place = placement(mode, costs)
    moves = costs.colocated if place.colocated else cost_model.Colocated(0.0, 0.0)
    devices = place.train_devices if "trainer" in spec.roles else place.rollout_devices
    c = costs.emulation.compression
    pool = DevicePool(spec.name, devices, meter, c, moves.to_train_s, moves.to_generate_s)
    workers: list[Worker] = []
    closing: list[Any] = []
    decode_devices: list[DecodeDevice] = []
    if "rollout" in spec.roles:
        rollouts, decode_devices = rollout_workers(ctx, costs, mode, pool, meter)
        workers += rollouts
        closing += decode_devices
    if "feeder" in spec.roles:
        workers.append(Feeder(ctx, EmulatedTask(costs)))
    if "reward" in spec.roles:
        verifier = ModelledVerifier(costs.reward.per_sample_s, c)
        workers += [RewardWorker(ctx, verifier) for _ in range(costs.reward.workers)]
    if "advantage" in spec.roles:
        workers.append(AdvantageWorker(ctx))
    if "reference" in spec.roles:
        ref = EmulatedTrainer(pool, costs, costs.reference.tokens_per_s, 0.0, role="reference")
        workers.append(ReferenceWorker(ctx, ref))
    if "trainer" in spec.roles:
        trainer, metrics = trainer_worker(ctx, costs, mode, pool, Path(spec.run_dir))
        workers.append(trainer)
        closing.append(metrics)
    return workers, closing, decode_devices


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str]) -> int:
    spec = ProcessSpec.read(Path(argv[0]))
    costs = cost_model.from_dict(spec.costs)
    run_dir = Path(spec.run_dir)
    config = job_config(ALL_MODES[spec.mode], costs, spec.store_url, run_dir)
    store = af.connect(spec.store_url)
    tracer = Tracer()
    ctx = Context(store, config, EmulatedTokenizer(), tracer, RunState())
    # Set from a thread of its own: the handler runs in the main thread, which may be inside
    # ``stop.wait`` holding the event's lock, where ``Event.set`` would wait for it for ever.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=ctx.stop.set).start())
    meter = BusyMeter()
    workers, closing, decode_devices = build(spec, ctx, meter)
    finisher = next((w for w in workers if isinstance(w, Trainer)), workers[0])
    cpu_at_start, calls_at_start = cpu_seconds(), CALLS.seconds
    print("ready", flush=True)
    try:
        run_threads(workers, ctx.stop, finisher)
    finally:
        for thing in closing:
            thing.close()
        calls = CALLS.seconds - calls_at_start
        report = {
            "name": spec.name,
            "tracer_origin": tracer.origin,
            "meter": meter.all_spans(),
            "worker_spans": [
                (s.role, tracer.origin + s.start, tracer.origin + s.end)
                for s in tracer.spans()
                if s.kind == "busy"
            ],
            "cpu_s": cpu_seconds() - cpu_at_start,
            # The serving threads of the emulated devices, and the workers' calls into the
            # emulated engines and verifier: counted apart, as the emulator's.
            "emulator_cpu_s": sum(d.cpu_s for d in decode_devices) + calls,
            "emulated_calls_cpu_s": calls,
        }
        Path(spec.report).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
