"""Checkpoints, taken by the trainer between steps: the train engine's state (model, optimiser),
the feeder's cursor, and every row still in flight in the store (prompts not yet rolled out,
samples not yet trained) with whatever fields they had. A resumed run puts those rows back and
carries on, so no sample is lost and none is trained twice.

Files: ``trainer/`` (engine), ``rows.parquet`` (rows), ``state.json`` (step, cursor, figures).
A checkpoint directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncflow.engines.base import TrainEngine
from asyncflow.store import Store
from asyncflow.workers.base import PROMPTS, RunState

KEEP = 2
SAMPLE_PREFIX = "step-"


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    found = sorted(checkpoints_dir(run_dir).glob("step-*[0-9]"))
    return found[-1] if found else None


def _in_flight(store: Store) -> tuple[pa.Table, int]:
    """Prompt and sample rows with their ready fields, as one table. A prompt group whose samples
    are already in the store is left out (rollout writes samples before acking prompts)."""
    rows = store.rows()
    keep = [i for i, p in enumerate(rows.partitions) if p == PROMPTS or p.startswith(SAMPLE_PREFIX)]
    sampled = {int(rows.groups[i]) for i in keep if rows.partitions[i] != PROMPTS}
    keep = [
        i for i in keep if not (rows.partitions[i] == PROMPTS and int(rows.groups[i]) in sampled)
    ]
    indexes = rows.indexes[keep]
    ready = store.ready_fields(indexes) if len(indexes) else []
    by_fields: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for k, names in enumerate(ready):
        by_fields[tuple(sorted(names))].append(k)
    columns: dict[str, list[Any]] = defaultdict(lambda: [None] * len(indexes))
    for fields, ks in by_fields.items():
        values = store.read(indexes[ks], list(fields))
        for name in fields:
            for k, value in zip(ks, values[name], strict=True):
                columns[name][k] = value if isinstance(value, bytes) else np.asarray(value).tolist()
    meta = {
        "__partition": [rows.partitions[i] for i in keep],
        "__group": [int(rows.groups[i]) for i in keep],
        "__version": [int(rows.versions[i]) for i in keep],
    }
    return pa.table(meta | dict(columns)), len(indexes)


def save(
    run_dir: Path,
    step: int,
    engine: TrainEngine,
    store: Store,
    state: RunState,
    figures: dict[str, Any],
) -> Path:
    """Writes the checkpoint of the moment between step ``step - 1`` and ``step``."""
    final = checkpoints_dir(run_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    engine.save(tmp / "trainer")
    with state.snapshot_lock:
        table, count = _in_flight(store)
        cursor = state.issued_groups
    pq.write_table(table, tmp / "rows.parquet")
    schemas = {
        name: store.schema(name)[0] for name in table.column_names if not name.startswith("__")
    }
    info = {"step": step, "issued_groups": cursor, "rows": count, "dtypes": schemas, **figures}
    (tmp / "state.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(checkpoints_dir(run_dir).glob("step-*[0-9]"))[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(checkpoint: Path) -> dict[str, Any]:
    return dict(json.loads((checkpoint / "state.json").read_text()))


def restore_rows(checkpoint: Path, store: Store, group_size: int) -> int:
    """Puts the checkpoint's in-flight rows back; returns how many."""
    table = pq.read_table(checkpoint / "rows.parquet")
    dtypes = read_state(checkpoint)["dtypes"]
    data = table.to_pylist()
    buckets: dict[tuple[str, tuple[str, ...]], list[dict[str, Any]]] = defaultdict(list)
    for row in data:
        fields = tuple(
            sorted(k for k, v in row.items() if not k.startswith("__") and v is not None)
        )
        buckets[(row["__partition"], fields)].append(row)
    for (partition, fields), rows in buckets.items():
        values = {name: [_cell(dtypes[name], r[name]) for r in rows] for name in fields}
        store.put(
            values,
            partition=partition,
            groups=[r["__group"] for r in rows],
            group_size=1 if partition == PROMPTS else group_size,
            version=[r["__version"] for r in rows],
        )
    return len(data)


_NUMPY = {
    "bool": np.bool_,
    "u8": np.uint8,
    "i32": np.int32,
    "i64": np.int64,
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
}


def _cell(dtype: str, value: Any) -> Any:
    return value if dtype == "bytes" else np.asarray(value, dtype=_NUMPY[dtype])
