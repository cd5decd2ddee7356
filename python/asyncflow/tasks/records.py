"""Rows of a local dataset file, as plain dicts: parquet, JSON lines or a JSON array, and what
Hugging Face ``datasets`` writes (``.arrow`` files, or a directory from ``save_to_disk``). All are
read with pyarrow or the json module; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncflow.errors import ConfigError


class DatasetError(ConfigError):
    """A dataset file cannot be used; the message names the file, and the row and key if any."""


def detect_format(path: Path) -> str:
    if path.is_dir():
        return "hf"
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".json", ".jsonl", ".ndjson"):
        return "json"
    if suffix == ".arrow":
        return "hf"
    raise DatasetError(
        f"{path}: cannot tell the format from the name; set data.format to parquet, json or hf"
    )


def read_records(path: str | Path, fmt: str = "auto") -> list[dict[str, Any]]:
    """Every row of the dataset at ``path``."""
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"{p} does not exist")
    fmt = detect_format(p) if fmt == "auto" else fmt
    try:
        if fmt == "parquet":
            return list(pq.read_table(p).to_pylist())
        if fmt == "json":
            return _read_json(p)
        if fmt == "hf":
            return _read_hf(p)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{p} cannot be read as {fmt}: {e}") from e
    raise DatasetError(f"{p}: unknown data.format {fmt!r}")


def _read_json(path: Path) -> list[dict[str, Any]]:
    """A JSON array of objects, or one object per line (UTF-8, a byte-order mark allowed)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: JSON must be UTF-8: {e}") from e
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON: {e}") from e
        numbered = list(enumerate(rows))
    else:
        numbered = []
        # Lines end at a newline only: U+2028, U+2029 and U+0085, which a JSON string may hold
        # unescaped, are characters of their line.
        for i, line in enumerate(text.split("\n")):
            if not line.strip():
                continue
            try:
                numbered.append((len(numbered), json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {i + 1}: not valid JSON: {e}") from e
    for i, row in numbered:
        if not isinstance(row, dict):
            raise DatasetError(f"{path} row {i}: a row must be a JSON object, not {row!r:.60}")
    return [row for _, row in numbered]


def _read_hf(path: Path) -> list[dict[str, Any]]:
    """A ``save_to_disk`` directory (its ``state.json`` lists the Arrow stream files) or one
    Arrow stream file, as ``datasets`` writes them."""
    if path.is_file():
        files = [path]
    elif (path / "state.json").is_file():
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state.get("_data_files", [])]
    elif (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DatasetError(
            f"{path} holds several splits {splits}; name one as the file, e.g. "
            f"{path / (splits[0] if splits else 'train')}"
        )
    else:
        raise DatasetError(f"{path} is a directory without a datasets state.json")
    rows: list[dict[str, Any]] = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    return rows
