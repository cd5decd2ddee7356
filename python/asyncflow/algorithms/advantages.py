"""Group-relative advantages: every response is scored against the other responses to the same
prompt, so no value network is needed.

- GRPO: ``(r - mean(group)) / (std(group) + eps)`` (or without the division).
- RLOO: ``r - mean(others)``, the leave-one-out baseline, ``= n/(n-1) * (r - mean(group))``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

EPS = 1e-6


def group_advantages(
    rewards: np.ndarray,
    groups: np.ndarray,
    method: Literal["grpo", "rloo", "reinforce++"] = "grpo",
    normalize_std: bool = True,
) -> np.ndarray:
    """Advantage of each row from the rewards of its group (rows sharing a group id)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    if rewards.shape != groups.shape or rewards.ndim != 1:
        raise ValueError("rewards and groups must be 1-D arrays of the same length")
    out = np.empty_like(rewards)
    for g in np.unique(groups):
        members = groups == g
        r = rewards[members]
        n = r.size
        if method == "rloo":
            out[members] = (r - r.mean()) * n / (n - 1) if n > 1 else 0.0
        else:
            centred = r - r.mean()
            out[members] = centred / (r.std() + EPS) if normalize_std else centred
    return out.astype(np.float32)


def informative_groups(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per row: whether its group's rewards differ (DAPO's dynamic sampling keeps only those:
    a group whose rewards are all equal has zero group-relative advantage everywhere)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros(rewards.shape, bool)
    for g in np.unique(groups):
        members = groups == g
        r = rewards[members]
        out[members] = bool(r.max() > r.min()) if r.size else False
    return out


def failed_groups(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Per row: whether any row of its group has no reward (NaN: a reward source failed)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    groups = np.asarray(groups)
    bad = set(np.unique(groups[~np.isfinite(rewards)]).tolist())
    return np.array([g in bad for g in groups.tolist()], bool)


def batch_normalised(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE++: ``(r - mean) / (std + eps)`` over all of ``rewards``, no groups."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.size == 0:
        return rewards.astype(np.float32)
    out: np.ndarray = ((rewards - rewards.mean()) / (rewards.std() + EPS)).astype(np.float32)
    return out


def overlong_penalty(
    lengths: np.ndarray, max_tokens: int, buffer: int, penalty: float
) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` tokens, then falling
    linearly to ``-penalty`` at ``max_tokens`` (and beyond)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    start = max_tokens - buffer
    return (-penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)).astype(np.float32)
