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
    method: Literal["grpo", "rloo"] = "grpo",
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
