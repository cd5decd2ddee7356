"""What the default job's two busy workers cost each other on this machine: the DeepSpeed
trainer's forward/backward pass plus optimiser step, and the vLLM rollout engine's generation
call, each timed alone, then both at once as two threads of one process (as the job runs them)
and as two processes::

    OMP_NUM_THREADS=1 .venv/bin/python benches/profiles/contention.py [SECONDS] [SEED]

The model is the default job's (``model.*`` defaults), made here with random weights from SEED
(default 0); a training micro-batch is 128 rows of 12 tokens (7 prompt, 5 response), a generation
call 16 prompts of 7 tokens with 16 samples each and at most 8 new tokens (the job's
``rollout.groups_per_call``, ``rollout.n`` and ``rollout.max_tokens``). Each case runs SECONDS
(default 20) after one warm-up call; medians in milliseconds. ``OMP_NUM_THREADS=1`` is what the
``asyncflow`` command sets for itself.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncflow import config as cfg
from asyncflow.engines.base import Sampling, TrainBatch
from asyncflow.engines.deepspeed import DeepSpeedTrainEngine
from asyncflow.engines.vllm import VLLMRolloutEngine
from asyncflow.models.tiny import create_tiny_model

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
SEED = int(sys.argv[2]) if len(sys.argv) > 2 else 0


def trainer(model_dir: Path) -> Callable[[], None]:
    """One forward/backward pass and optimiser step of the job's trainer engine, as a call."""
    engine = DeepSpeedTrainEngine(model_dir, cfg.load(None, []))
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(3, 40, (128, 12), generator=generator)
    response = torch.zeros(128, 12, dtype=torch.long)
    response[:, 7:] = 1
    batch = TrainBatch(ids, torch.ones_like(ids), response, {})

    def loss(logprobs: torch.Tensor, b: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = b.response_mask.float()
        return -(logprobs * mask).sum() / mask.sum(), {}

    def step() -> None:
        engine.forward_backward(batch, loss)
        engine.optimizer_step()

    return step


def generator(model_dir: Path) -> Callable[[], None]:
    """One generation call of the job's rollout engine."""
    engine = VLLMRolloutEngine(model_dir, cfg.load(None, []))
    prompts = [[1 + (i + j) % 30 for j in range(7)] for i in range(16)]
    sampling = Sampling(n=16, temperature=1.0, max_tokens=8)
    return lambda: engine.generate(prompts, sampling)


def timed(call: Callable[[], None], start: float, seconds: float) -> float:
    """Median milliseconds of ``call`` over ``seconds`` from ``start`` (a ``time.time()``)."""
    call()
    while time.time() < start:
        time.sleep(0.001)
    took = []
    while time.time() < start + seconds:
        t = time.perf_counter()
        call()
        took.append(time.perf_counter() - t)
    return 1e3 * statistics.median(took)


def trainer_process(model_dir: Path, start: Any, out: Any) -> None:
    step = trainer(model_dir)
    step()
    out.put("ready")
    while start.value == 0:
        time.sleep(0.01)
    out.put(timed(step, start.value, SECONDS))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        create_tiny_model(cfg.load(None, []).model, model_dir, SEED)
        # The trainer first: its process group must exist before vLLM makes its own.
        train = trainer(model_dir)
        generate = generator(model_dir)
        results: dict[str, tuple[float, float]] = {}
        results["alone"] = (
            timed(train, time.time(), SECONDS),
            timed(generate, time.time(), SECONDS),
        )

        got: dict[str, float] = {}
        start = time.time() + 2
        threads = [
            threading.Thread(target=lambda: got.update(t=timed(train, start, SECONDS))),
            threading.Thread(target=lambda: got.update(g=timed(generate, start, SECONDS))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results["threads of one process"] = (got["t"], got["g"])

        spawn = mp.get_context("spawn")
        when, out = spawn.Value("d", 0.0), spawn.Queue()
        child = spawn.Process(target=trainer_process, args=(model_dir, when, out))
        child.start()
        assert out.get() == "ready"
        when.value = time.time() + 1
        g = timed(generate, when.value, SECONDS)
        results["two processes"] = (out.get(), g)
        child.join()

    print("| case | trainer step ms | generation call ms |")
    print("|---|---:|---:|")
    for case, (t, g) in results.items():
        print(f"| {case} | {t:.1f} | {g:.1f} |")


if __name__ == "__main__":
    main()
