"""Rows read from the store -> padded training micro-batches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow.engines.base import TrainBatch


def to_train_batch(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    pad_id: int,
    per_token: Mapping[str, Sequence[Any]] | None = None,
    per_row: Mapping[str, np.ndarray] | None = None,
) -> TrainBatch:
    """Right-padded ``prompt + response`` sequences. ``per_token`` arrays (one value per response
    token, e.g. behaviour log-probs) are placed at the response positions of a ``[B, L]`` tensor;
    ``per_row`` arrays become ``[B]`` tensors."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths)
    rows = len(lengths)
    ids = np.full((rows, width), pad_id, dtype=np.int64)
    attention = np.zeros((rows, width), dtype=np.int64)
    response = np.zeros((rows, width), dtype=np.float32)
    token_values = {name: np.zeros((rows, width), dtype=np.float32) for name in per_token or {}}
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n, m = len(p), len(r)
        ids[i, :n] = p
        ids[i, n : n + m] = r
        attention[i, : n + m] = 1
        response[i, n : n + m] = 1
        for name, per_row_values in (per_token or {}).items():
            token_values[name][i, n : n + m] = per_row_values[i]
    extras = {name: torch.from_numpy(v) for name, v in token_values.items()}
    for name, column in (per_row or {}).items():
        extras[name] = torch.from_numpy(np.array(column, dtype=np.float32))
    return TrainBatch(
        torch.from_numpy(ids), torch.from_numpy(attention), torch.from_numpy(response), extras
    )
