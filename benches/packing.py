"""Padding waste of the trainer's micro-batches with ``trainer.packing`` on and off:
``python benches/packing.py OUT_DIR`` makes chat data of varied prompt lengths and a model
(both locally), runs ``asyncflow train --config examples/parquet.yaml`` for seeds 0-2 with
packing on and off, and prints a markdown table (about ten minutes on 2 CPU cores).

The figure is a count of tokens, not a timing: pad tokens over the tokens the micro-batches'
tensors hold, the mean over a run's steps (``padding_fraction`` in ``metrics.jsonl``; with
packing also ``padding_fraction_unpacked``, what the same micro-batches would hold padded).
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncflow.config import ModelConfig
from asyncflow.models.tiny import create_tiny_model

SEEDS = (0, 1, 2)
DASH = "\u2013"  # ranges as RESULTS.md writes them
EXAMPLE = Path(__file__).parent.parent / "examples" / "parquet.yaml"
SETTINGS = [
    "rollout.max_tokens=16",
    "rollout.n=8",
    "trainer.groups_per_step=8",
    "trainer.max_steps=4",
    "trainer.micro_batch_tokens=2048",
    "run.progress=false",
]


def chat_rows(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """``What is a+b?`` after 0 to 6 filler sentences, a system message on about half."""
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        filler = " ".join(
            f"Item {k} costs {rng.randint(1, 9)} dollars." for k in range(rng.randint(0, 6))
        )
        chat = [{"role": "user", "content": f"{filler} What is {a}+{b}?".strip()}]
        if rng.random() < 0.5:
            chat.insert(0, {"role": "system", "content": "Answer with the number only."})
        rows.append({"prompt": chat, "reward_model": {"ground_truth": str(a + b)}})
    return rows


def make_data(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    create_tiny_model(ModelConfig(max_positions=512), out / "model", seed=0)
    rng = random.Random(0)
    pq.write_table(pa.Table.from_pylist(chat_rows(rng, 400)), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(chat_rows(rng, 50)), out / "test.parquet")


def run(out: Path, seed: int, packing: bool) -> dict[str, float]:
    run_dir = out / f"run-s{seed}-{'packed' if packing else 'padded'}"
    command = [sys.executable, "-m", "asyncflow.cli", "train", "--config", str(EXAMPLE)]
    command += ["--run-dir", str(run_dir), f"model.path={out / 'model'}"]
    command += [
        f"data.train_file={out / 'train.parquet'}",
        f"data.eval_file={out / 'test.parquet'}",
    ]
    command += [*SETTINGS, f"trainer.packing={str(packing).lower()}", f"run.seed={seed}"]
    subprocess.run(command, check=True, capture_output=True)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    figures = {
        key: statistics.mean(r[key] for r in steps)
        for key in ("padding_fraction", "padding_fraction_unpacked")
    }
    figures["micro_batch_tokens_max"] = max(r["micro_batch_tokens_max"] for r in steps)
    return figures


def spread(values: list[float], digits: int) -> str:
    low, mean, high = (
        f"{v:.{digits}f}" for v in (min(values), statistics.mean(values), max(values))
    )
    return f"{mean} ({low}{DASH}{high})"


def main(out: Path) -> None:
    make_data(out)
    print("| | padding fraction | largest micro-batch tensor (tokens) |\n|---|---:|---:|")
    for packing in (True, False):
        runs = [run(out, seed, packing) for seed in SEEDS]
        label = "packed (default)" if packing else "`trainer.packing: false`"
        pad = spread([r["padding_fraction"] for r in runs], 3)
        print(f"| {label} | {pad} | {spread([r['micro_batch_tokens_max'] for r in runs], 0)} |")
        if packing:
            unpacked = spread([r["padding_fraction_unpacked"] for r in runs], 3)
            print(f"| the same micro-batches, had they been padded | {unpacked} | |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
