"""Checkpoints, taken by the trainer between steps: the train engine's state (model, optimiser),
the feeder's cursor, and every row still in flight in the store (prompts not yet rolled out,
samples not yet trained) with whatever fields they had. A resumed run puts those rows back and
carries on, so no sample is lost and none is trained twice.

Files: ``trainer/`` (engine), ``critic/`` (PPO's value model, when there is one),
``rows.parquet`` (rows), ``state.json`` (step, cursor, figures).
A checkpoint directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncflow.engines.base import TrainEngine
from asyncflow.errors import UnknownIndexError
from asyncflow.store import Store
from asyncflow.workers.base import PROMPTS, SAMPLES, RunState

if TYPE_CHECKING:
    from asyncflow.workers.critic import CriticWorker

KEEP = 2


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def saved(run_dir: Path) -> list[Path]:
    """The run's checkpoints, oldest first (by step number: ``step-1000000`` after
    ``step-999999``)."""
    found = checkpoints_dir(run_dir).glob("step-*[0-9]")
    return sorted(found, key=step_of)


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint directory was taken after."""
    return int(checkpoint.name.removeprefix("step-"))


def latest(run_dir: Path) -> Path | None:
    found = saved(run_dir)
    return found[-1] if found else None


@dataclass
class _Row:
    """A row as a checkpoint keeps it: where it was, and its ready fields' values."""

    partition: str
    group: int
    version: int
    cells: dict[str, Any]


def _read(store: Store, indexes: np.ndarray) -> list[_Row]:
    """The rows ``indexes`` with the values of the fields ready on them; those with none ready
    (a put still under way) are left out. Raises ``UnknownIndexError`` if one was freed."""
    if len(indexes) == 0:
        return []
    meta = store.rows(indexes)
    ready = store.ready_fields(indexes)
    rows = [
        _Row(meta.partitions[k], int(meta.groups[k]), int(meta.versions[k]), {})
        for k in range(len(indexes))
    ]
    by_fields: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for k, names in enumerate(ready):
        if names:
            by_fields[tuple(sorted(names))].append(k)
    for fields, ks in by_fields.items():
        values = store.read(indexes[ks], list(fields))
        for name in fields:
            for k, value in zip(ks, values[name], strict=True):
                rows[k].cells[name] = (
                    value if isinstance(value, bytes) else np.asarray(value).tolist()
                )
    return [row for row in rows if row.cells]


def _read_live(store: Store, indexes: np.ndarray, attempts: int = 100) -> list[_Row]:
    """As :func:`_read`, leaving out the rows freed while they are read."""
    for _ in range(attempts):
        try:
            return _read(store, indexes)
        except UnknownIndexError:
            indexes = indexes[np.isin(indexes, store.rows().indexes)]
    raise RuntimeError(f"rows kept being freed while a checkpoint read them ({attempts} tries)")


def _in_flight(store: Store) -> tuple[pa.Table, int]:
    """Prompt and sample rows with their ready fields, as one table: each prompt group once, as
    its prompt or as its samples.

    The snapshot's lock keeps the feeder from putting prompts meanwhile, and a rollout worker of
    this process from turning prompts into samples; rollout workers elsewhere (the Ray
    launcher's actors) go on. A rollout makes a group's samples ready before it acks the group's
    prompt, so the prompts are read first and the samples listed after: a prompt freed before it
    was read has its samples listed; a prompt read whose samples are listed too is left out;
    samples still being put (no field ready yet) are left out, and their prompt kept."""
    prompts = _read_live(store, store.rows(partition=PROMPTS).indexes)
    listed = store.rows()
    is_sample = np.array([p.startswith(SAMPLES) for p in listed.partitions], bool)
    samples = _read_live(store, listed.indexes[is_sample])
    sampled = {row.group for row in samples}
    kept = [row for row in prompts if row.group not in sampled] + samples
    columns: dict[str, list[Any]] = defaultdict(lambda: [None] * len(kept))
    for k, row in enumerate(kept):
        for name, value in row.cells.items():
            columns[name][k] = value
    meta = {
        "__partition": [row.partition for row in kept],
        "__group": [row.group for row in kept],
        "__version": [row.version for row in kept],
    }
    return pa.table(meta | dict(columns)), len(kept)


@contextmanager
def made_whole(directory: Path) -> Iterator[Path]:
    """The temporary directory to write ``directory`` in, renamed to it when the block ends
    without an exception: a process killed meanwhile leaves nothing under the name that a
    later run would take for whole (a model's ``config.json`` is written before its weights, a
    checkpoint's state after its trainer's)."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    shutil.rmtree(directory, ignore_errors=True)  # one cut short before this rule
    tmp.rename(directory)


def synced(directory: Path) -> None:
    """Every file and directory under ``directory``, and itself, on disk: renamed into place
    after this, a checkpoint is whole after a power cut too, not only after a killed process
    (which the rename alone covers)."""
    for path in [*sorted(directory.rglob("*"), reverse=True), directory]:
        synced_entry(path)


def synced_entry(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    run_dir: Path,
    step: int,
    engine: TrainEngine,
    store: Store,
    state: RunState,
    figures: dict[str, Any],
    critic: CriticWorker | None = None,
) -> Path:
    """Writes the checkpoint of the moment between step ``step - 1`` and ``step``; with a
    ``critic``, its state as of the rows kept (no critic update between the two)."""
    final = checkpoints_dir(run_dir) / f"step-{step:06d}"
    with made_whole(final) as tmp:
        tmp.mkdir(parents=True)
        engine.save(tmp / "trainer")
        with critic.lock if critic is not None else nullcontext():
            if critic is not None:
                critic.engine.save(tmp / "critic")
            with state.snapshot_lock:
                table, count = _in_flight(store)
                cursor = state.issued_groups
                counts = state.counts()
        pq.write_table(table, tmp / "rows.parquet")
        schemas = {
            name: store.schema(name)[0] for name in table.column_names if not name.startswith("__")
        }
        info = {
            "step": step,
            "issued_groups": cursor,
            "rows": count,
            "dtypes": schemas,
            "counts": counts,
            **figures,
        }
        (tmp / "state.json").write_text(json.dumps(info, indent=1) + "\n")
        synced(tmp)
    synced_entry(final.parent)
    for old in saved(run_dir)[:-KEEP]:
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
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
}


def _cell(dtype: str, value: Any) -> Any:
    return value if dtype == "bytes" else np.asarray(value, dtype=_NUMPY[dtype])
