"""Rows read from the store -> training micro-batches: padded, or packed.

Padded: one right-padded row per sample. Packed: the samples laid end to end in one row, each
with positions restarting at 0; the model then attends only within a sample (transformers reads
the boundaries from the positions), so no sample sees another and no token is padding. Either
way, :func:`split_micro_batches` keeps every micro-batch within the token budget, counting what
the tensors hold: packed, the samples' tokens; padded, rows times the longest row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from asyncflow.engines.base import TrainBatch
from asyncflow.scheduler import micro_batches


def to_train_batch(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    pad_id: int,
    per_token: Mapping[str, Sequence[Any]] | None = None,
    per_row: Mapping[str, np.ndarray] | None = None,
    packed: bool = False,
) -> TrainBatch:
    """``prompt + response`` sequences. ``per_token`` arrays (one value per response token, e.g.
    behaviour log-probs) are placed at the response positions of a ``[B, L]`` tensor; ``per_row``
    arrays become ``[B]`` tensors (packed: ``[1, L]``, the row's value on each of its tokens)."""
    if packed:
        return _packed(prompts, responses, per_token or {}, per_row or {})
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


def _packed(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    per_token: Mapping[str, Sequence[Any]],
    per_row: Mapping[str, np.ndarray],
) -> TrainBatch:
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    total = sum(lengths)
    ids = np.concatenate([np.concatenate([p, r]) for p, r in zip(prompts, responses, strict=True)])
    positions = np.concatenate([np.arange(n) for n in lengths])
    sequence = np.repeat(np.arange(len(lengths)), lengths)
    response = np.zeros(total, dtype=np.float32)
    token_values = {name: np.zeros(total, dtype=np.float32) for name in per_token}
    start = 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        first, end = start + len(p), start + len(p) + len(r)
        response[first:end] = 1
        for name, values in per_token.items():
            token_values[name][first:end] = values[i]
        start = end
    extras = {name: torch.from_numpy(v)[None] for name, v in token_values.items()}
    for name, column in per_row.items():
        spread = np.asarray(column, dtype=np.float32)[sequence]
        extras[name] = torch.from_numpy(spread)[None]
    return TrainBatch(
        torch.from_numpy(ids.astype(np.int64))[None],
        torch.ones((1, total), dtype=torch.int64),
        torch.from_numpy(response)[None],
        extras,
        position_ids=torch.from_numpy(positions.astype(np.int64))[None],
        sequence_ids=torch.from_numpy(sequence.astype(np.int64))[None],
    )


def split_micro_batches(
    lengths: Sequence[int], budget: int, packed: bool, min_count: int = 1
) -> list[list[int]]:
    """Rows (by index into ``lengths``) in micro-batches whose tensors hold at most ``budget``
    tokens; at least ``min_count`` of them (the extra ones empty). A row longer than the budget
    raises ``BadRequestError``."""
    if packed or not lengths:
        return micro_batches(lengths, budget, min_count=min_count) if lengths else [[]] * min_count
    longest = max(lengths)
    if longest > budget:
        micro_batches(lengths, budget)  # raises, naming the row
    # Padded: longest first, so each micro-batch's rows are close in length (little padding).
    parts: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    parts += [[] for _ in range(min_count - len(parts))]
    return [sorted(part) for part in parts]
