"""Rows read from the store -> training micro-batches: padded, or packed.

Padded: one right-padded row per sample. Packed: samples laid end to end in rows, each with
positions restarting at 0; the model then attends only within a sample (transformers reads the
boundaries from the positions), so no sample sees another. A row is at most as wide as the
longest sample of the step's claim (:func:`pack_width`), not a whole micro-batch long: attention
costs each token the width of its row (the mask over a row is width x width), so one row of
thousands of short samples would cost thousands of times what their own lengths do. The short
samples share rows (first fit, longest first: :func:`pack_rows`), and a micro-batch's tensors
are as wide as its fullest row, so the padding left is the rows' unfilled ends. Either way,
:func:`split_micro_batches` keeps every micro-batch within the token budget, counting what the
tensors hold (rows times their width).

Packed with shared prompts (``shared``), the samples that follow one another with the same
prompt (a GRPO group's) form one unit: the prompt once, then each response, every response
attending to the prompt and to itself only, its positions going on from the prompt's. The
prompt's forward and backward pass is then computed once per unit instead of once per sample,
and its gradient is the sum of what each sample's would be. Such a micro-batch carries the
attention mask itself (``TrainBatch.shared_mask``) and where each token's logits are
(``TrainBatch.logit_source``: a response's first token is predicted at the prompt's last).
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
    width: int | None = None,
    loss_mask: Sequence[Any] | None = None,
    shared: bool = False,
) -> TrainBatch:
    """``prompt + response`` sequences. ``per_token`` arrays (one value per response token, e.g.
    behaviour log-probs) are placed at the response positions of a ``[B, L]`` tensor; ``per_row``
    arrays become ``[B]`` tensors (packed: ``[rows, width]``, the sample's value on each of its
    tokens; see :func:`_packed`). ``loss_mask`` (per response token, 1 where the model wrote it)
    narrows the response mask to those tokens: environment tokens (tool output) are in the
    response but not the policy's, so no loss, KL term or normalisation counts them. ``shared``
    (packed only): consecutive samples with the same prompt share it (see the module's
    docstring)."""
    if shared and not packed:
        raise ValueError("shared prompts are a packed layout")
    if loss_mask is not None:
        per_token = {**(per_token or {}), "loss_mask": loss_mask}
    if packed:
        units = prompt_runs(prompts) if shared else [[i] for i in range(len(prompts))]
        tb = _packed(prompts, responses, units, per_token or {}, per_row or {}, pad_id, width)
    else:
        tb = _padded(prompts, responses, pad_id, per_token or {}, per_row or {})
    if loss_mask is not None:
        tb.response_mask = tb.response_mask * tb.extras.pop("loss_mask")
    return tb


def _padded(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    pad_id: int,
    per_token: Mapping[str, Sequence[Any]],
    per_row: Mapping[str, np.ndarray],
) -> TrainBatch:
    """One sample per row, each padded to the longest."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths)
    rows = len(lengths)
    ids = np.full((rows, width), pad_id, dtype=np.int64)
    attention = np.zeros((rows, width), dtype=np.int64)
    response = np.zeros((rows, width), dtype=np.float32)
    token_values = {name: np.zeros((rows, width), dtype=np.float32) for name in per_token}
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n, m = len(p), len(r)
        ids[i, :n] = p
        ids[i, n : n + m] = r
        attention[i, : n + m] = 1
        response[i, n : n + m] = 1
        for name, values in per_token.items():
            token_values[name][i, n : n + m] = _row_values(name, values, i, m)
    extras = {name: torch.from_numpy(v) for name, v in token_values.items()}
    for name, column in per_row.items():
        extras[name] = torch.from_numpy(np.array(column, dtype=np.float32))
    return TrainBatch(
        torch.from_numpy(ids), torch.from_numpy(attention), torch.from_numpy(response), extras
    )


def _row_values(name: str, values: Sequence[Any], i: int, tokens: int) -> Any:
    """Sample ``i``'s values of a per-token field, refused unless one per response token (a
    single value would broadcast over them all)."""
    if len(row := values[i]) != tokens:
        raise ValueError(f"{name} of row {i}: {len(row)} values for {tokens} tokens")
    return row


def _packed(
    prompts: Sequence[np.ndarray],
    responses: Sequence[np.ndarray],
    units: Sequence[Sequence[int]],
    per_token: Mapping[str, Sequence[Any]],
    per_row: Mapping[str, np.ndarray],
    pad_id: int,
    width: int | None,
) -> TrainBatch:
    """The units in order (each: its first sample's prompt, then its samples' responses), end
    to end, a new row begun whenever the next does not fit in ``width`` (default: the longest
    unit): the rows :func:`pack_rows` made, when given its rows' units one row after another.
    The tensors are as wide as the fullest row; a row's unfilled end is padding, positioned as
    a sequence of its own and outside every mask."""
    lengths = unit_lengths(prompts, responses, units)
    width = pack_width(lengths) if width is None else width
    starts: list[tuple[int, int]] = []  # (row, column) of each unit
    row, column = 0, 0
    for n in lengths:
        if n > width:
            raise ValueError(f"a sample of {n} tokens does not fit in packed rows of {width}")
        if column + n > width:
            row, column = row + 1, 0
        starts.append((row, column))
        column += n
    rows = row + 1 if lengths else 0
    width = max((c + n for (_, c), n in zip(starts, lengths, strict=True)), default=1)
    ids = np.full((rows, width), pad_id, dtype=np.int64)
    attention = np.zeros((rows, width), dtype=np.int64)
    response = np.zeros((rows, width), dtype=np.float32)
    # Padding counts on from 0 after the row's last unit: a sequence of its own.
    positions = np.zeros((rows, width), dtype=np.int64)
    sequence = np.zeros((rows, width), dtype=np.int64)
    # Shared units only: which unit a token is in (padding: -1), and which of its samples'
    # responses (-1: the prompt, which every response of the unit sees); where its logits are.
    unit_of = np.full((rows, width), -1, dtype=np.int64)
    branch = np.full((rows, width), -1, dtype=np.int64)
    source = np.tile(np.maximum(np.arange(width) - 1, 0), (rows, 1))
    token_values = {name: np.zeros((rows, width), dtype=np.float32) for name in per_token}
    row_values = {name: np.zeros((rows, width), dtype=np.float32) for name in per_row}
    ends = np.zeros(rows, dtype=np.int64)
    for k, ((r, c), unit) in enumerate(zip(starts, units, strict=True)):
        p = prompts[unit[0]]
        n = len(p)
        ids[r, c : c + n] = p
        positions[r, c : c + n] = np.arange(n)
        sequence[r, c : c + n] = unit[0]
        unit_of[r, c : c + n] = k
        for name, column_values in per_row.items():
            row_values[name][r, c : c + n] = column_values[unit[0]]
        at = c + n
        for i in unit:
            m = len(responses[i])
            ids[r, at : at + m] = responses[i]
            response[r, at : at + m] = 1
            positions[r, at : at + m] = np.arange(n, n + m)
            sequence[r, at : at + m] = i
            unit_of[r, at : at + m] = k
            branch[r, at : at + m] = i
            if m:
                source[r, at] = c + n - 1
            for name, values in per_token.items():
                token_values[name][r, at : at + m] = _row_values(name, values, i, m)
            for name, column_values in per_row.items():
                row_values[name][r, at : at + m] = column_values[i]
            at += m
        attention[r, c:at] = 1
        ends[r] = at
    for r, end in enumerate(ends):
        positions[r, end:] = np.arange(width - end)
    extras = {name: torch.from_numpy(v) for name, v in (token_values | row_values).items()}
    batch = TrainBatch(
        torch.from_numpy(ids),
        torch.from_numpy(attention),
        torch.from_numpy(response),
        extras,
        position_ids=torch.from_numpy(positions),
        sequence_ids=torch.from_numpy(sequence),
    )
    if any(len(u) > 1 for u in units):
        causal = np.tril(np.ones((width, width), dtype=bool))
        same_unit = unit_of[:, :, None] == unit_of[:, None, :]
        seen = (branch[:, None, :] == -1) | (branch[:, :, None] == branch[:, None, :])
        batch.shared_mask = torch.from_numpy((same_unit & seen & causal)[:, None])
        batch.logit_source = torch.from_numpy(source)
    return batch


def unit_lengths(
    prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], units: Sequence[Sequence[int]]
) -> list[int]:
    """Each unit's tokens: its prompt once, and its samples' responses."""
    return [len(prompts[u[0]]) + sum(len(responses[i]) for i in u) for u in units]


def prompt_runs(prompts: Sequence[np.ndarray]) -> list[list[int]]:
    """The samples (by index) in runs of consecutive ones with the same prompt."""
    runs: list[list[int]] = []
    for i, p in enumerate(prompts):
        if runs and np.array_equal(prompts[runs[-1][0]], p):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def prompt_units(prompts: Sequence[np.ndarray]) -> list[list[int]]:
    """The samples (by index) by prompt: those with the same prompt, in order of their first."""
    units: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
        units.setdefault(np.asarray(p, np.int64).tobytes(), []).append(i)
    return list(units.values())


def pair_cost(hf_config: Any) -> float | None:
    """What attending one (query, key) pair costs against one token's pass through the weights
    (the linear layers and the output head), from a transformers model config: the measure
    that tells whether sharing a prompt pays for its longer rows, whose attention is dense.
    None when the config does not give the sizes, or when a layer attends within a window or a
    chunk (the shared layout's mask, one for every layer, would replace theirs)."""
    kinds = getattr(hf_config, "layer_types", None)
    if kinds is not None:
        if any(kind != "full_attention" for kind in kinds):
            return None
    elif getattr(hf_config, "sliding_window", None) and getattr(
        hf_config, "use_sliding_window", True
    ):
        return None
    if getattr(hf_config, "attention_chunk_size", None):
        return None
    try:
        hidden = int(hf_config.hidden_size)
        layers = int(hf_config.num_hidden_layers)
        heads = int(hf_config.num_attention_heads)
        inner = int(hf_config.intermediate_size)
        vocab = int(hf_config.vocab_size)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    except (AttributeError, TypeError, ValueError):
        return None
    attention = 2 * hidden * (heads + kv_heads) * head_dim  # q and o; k and v
    per_layer = attention + 3 * hidden * inner
    return layers * 2 * heads * head_dim / (layers * per_layer + hidden * vocab)


def pack_width(lengths: Sequence[int]) -> int:
    """The width of packed rows for samples of these lengths: the longest."""
    return max(lengths, default=1)


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Samples (by index into ``lengths``) in rows of at most ``width`` tokens: longest first,
    each into the first row with room (first fit decreasing); a row's samples in the order they
    went in."""
    rows: list[list[int]] = []
    shortest = min(lengths, default=0)
    open_rows: list[int] = []  # the rows with room for the shortest sample, oldest first
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k in open_rows if room[k] >= lengths[i]), None)
        if k is None:
            k = len(rows)
            rows.append([])
            room.append(width)
            open_rows.append(k)
        rows[k].append(i)
        room[k] -= lengths[i]
        if room[k] < shortest:  # full: no sample left fits
            open_rows.remove(k)
    return rows


def split_micro_batches(
    lengths: Sequence[int], budget: int, packed: bool, min_count: int = 1
) -> list[list[int]]:
    """Rows (by index into ``lengths``) in micro-batches whose tensors hold at most ``budget``
    tokens; at least ``min_count`` of them (the extra ones empty). A row longer than the budget
    raises ``BadRequestError``. Packed, a micro-batch lists its samples one packed row after
    another (rows of :func:`pack_width`), as :func:`to_train_batch` lays them out."""
    if not lengths:
        return [[] for _ in range(min_count)]
    longest = max(lengths)
    if longest > budget:
        micro_batches(lengths, budget)  # raises, naming the row
    if packed:
        width = pack_width(lengths)
        rows = pack_rows(lengths, width)
        count = -(-len(rows) // (budget // width))
        # Consecutive rows, as evenly as can be: first fit opens rows longest sample first, so
        # a micro-batch's rows are close in fill and its tensors only as wide as its fullest.
        # Each keeps the rows' order: its samples, laid out anew, fall into the same rows.
        size, longer = divmod(len(rows), count)
        packed_parts: list[list[int]] = []
        start = 0
        for k in range(count):
            end = start + size + (k < longer)
            packed_parts.append([i for row in rows[start:end] for i in row])
            start = end
        return packed_parts + [[] for _ in range(min_count - count)]
    # Padded: longest first, so each micro-batch's rows are close in length (little padding).
    parts: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if parts and (len(parts[-1]) + 1) * lengths[parts[-1][0]] <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    parts += [[] for _ in range(min_count - len(parts))]
    return [sorted(part) for part in parts]
