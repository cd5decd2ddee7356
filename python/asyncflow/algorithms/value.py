"""PPO with a critic: generalised advantage estimation from a value model's per-token values, and
the critic's clipped value loss.

A response of ``T`` tokens is an episode: the state before token ``t`` is the prompt and the
tokens before ``t``, the action is token ``t``, and the episode ends after the last token (the
value after it is 0). The reward is the sequence's reward on its last token (less, with a
reference, ``kl_coef`` times each token's log-ratio to the reference, on that token).

- GAE (Schulman et al. 2016, arXiv 1506.02438): ``delta_t = r_t + gamma * V_{t+1} - V_t``,
  ``A_t = delta_t + gamma * lam * A_{t+1}``; the critic's target is the return ``A_t + V_t``.
- Multi-turn rows: only the tokens the model wrote are actions. Environment tokens (``mask`` 0)
  are skipped: the state after a model turn's last token is the state before the next model
  turn's first, the reward sits on the last model token, and environment tokens get advantage 0,
  no KL and no value loss.
- Value loss (PPO's value clipping, as in Ziegler et al. 2019, arXiv 1909.08593):
  ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` per token, where ``V_old`` is
  the value the critic gave the token when the sample was scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

EPS = 1e-8


def _actions(length: int, mask: np.ndarray | None) -> np.ndarray:
    """Which of a response's ``length`` tokens the model wrote (all, without a mask)."""
    if mask is None:
        return np.ones(length, bool)
    actions = np.asarray(mask).astype(bool)
    if actions.shape != (length,):
        raise ValueError(f"a loss mask of shape {actions.shape} for {length} tokens")
    return actions


def token_rewards(
    reward: float,
    length: int,
    kl: np.ndarray | None = None,
    kl_coef: float = 0.0,
    mask: np.ndarray | None = None,
) -> np.ndarray:
    """Per-token rewards of one response: ``reward`` on its last token the model wrote, less
    ``kl_coef`` times each such token's ``kl`` (behaviour minus reference log-prob)."""
    actions = _actions(length, mask)
    out = np.zeros(length, np.float64)
    written = np.flatnonzero(actions)
    if written.size:
        out[written[-1]] = reward
    if kl is not None and kl_coef:
        out -= kl_coef * np.where(actions, np.asarray(kl, np.float64), 0.0)
    return out


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    gamma: float,
    lam: float,
    mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns of one response's tokens (both ``[T]``); the value after the last
    token is 0 (the episode ends there). Tokens outside ``mask`` (environment tokens) are not
    steps of the episode: their advantage is 0 and their return their own value."""
    rewards = np.asarray(rewards, np.float64)
    values = np.asarray(values, np.float64)
    if rewards.shape != values.shape or rewards.ndim != 1:
        raise ValueError("rewards and values must be 1-D arrays of the same length")
    actions = _actions(rewards.size, mask)
    adv = np.zeros_like(rewards)
    running = following = 0.0
    for t in range(rewards.size - 1, -1, -1):
        if not actions[t]:
            continue
        delta = rewards[t] + gamma * following - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
        following = values[t]
    return adv, adv + values


def whiten(
    advantages: Sequence[np.ndarray], masks: Sequence[np.ndarray | None] | None = None
) -> list[np.ndarray]:
    """Advantages shifted and scaled to mean 0 and standard deviation 1 over all the tokens of
    the responses given (as Ziegler et al. whiten theirs over the batch), or over the tokens in
    ``masks`` only (the others stay 0)."""
    arrays = [np.asarray(a, np.float64) for a in advantages]
    chosen = [_actions(a.size, None if masks is None else masks[i]) for i, a in enumerate(arrays)]
    flat = np.concatenate([a[c] for a, c in zip(arrays, chosen, strict=True)]) if arrays else []
    if len(flat) == 0:
        return [a.astype(np.float32) for a in arrays]
    mean, std = np.mean(flat), np.std(flat)
    return [
        np.where(c, (a - mean) / (std + EPS), 0.0).astype(np.float32)
        for a, c in zip(arrays, chosen, strict=True)
    ]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, a mean over the masked tokens, and diagnostics. Tensors are
    ``[batch, tokens]``."""
    mask = mask.to(values.dtype)
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    count = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / count
    stats = {
        "value_loss": float(loss.detach()),
        "value_clip_fraction": float(
            (((values - old_values).abs() > clip).to(values.dtype) * mask).sum() / count
        ),
        "value_mean": float((values.detach() * mask).sum() / count),
    }
    return loss, stats
