"""Advantages and losses against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncflow.algorithms.advantages import group_advantages
from asyncflow.algorithms.losses import LossSettings, policy_loss
from asyncflow.algorithms.lr_schedule import lr_factor
from asyncflow.config import TrainerConfig


def test_grpo_normalises_rewards_within_each_group() -> None:
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 3.0, 3.0])
    groups = np.array([5, 5, 5, 5, 9, 9])
    adv = group_advantages(rewards, groups, "grpo")
    # group 5: mean 0.5, std 0.5; group 9 has no spread
    np.testing.assert_allclose(adv, [1, -1, -1, 1, 0, 0], atol=1e-5)


def test_grpo_without_std_only_centres() -> None:
    adv = group_advantages(np.array([2.0, 0.0]), np.array([1, 1]), "grpo", normalize_std=False)
    np.testing.assert_allclose(adv, [1.0, -1.0])


def test_rloo_uses_the_mean_of_the_other_samples() -> None:
    adv = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4), "rloo")
    # 1 - mean(0, 0, 1) = 2/3 and 0 - mean(1, 0, 1) = -2/3
    np.testing.assert_allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=1e-6)


def _tokens(*probs: float) -> torch.Tensor:
    return torch.log(torch.tensor([[p] for p in probs]))


def test_ppo_clip_against_the_behaviour_policy() -> None:
    logp, behaviour = _tokens(0.5, 0.5), _tokens(0.4, 0.4)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    loss, stats = policy_loss(
        logp, behaviour, adv, mask, LossSettings(clip_eps=0.2, correction="none")
    )
    # ratio 1.25: A=+1 -> -min(1.25, 1.2) = -1.2 ; A=-1 -> -min(-1.25, -1.2) = 1.25
    assert float(loss) == pytest.approx((-1.2 + 1.25) / 2)
    assert stats["clip_fraction"] == pytest.approx(1.0)


def test_truncated_importance_weight_caps_stale_samples() -> None:
    logp, behaviour = _tokens(0.5, 0.5), _tokens(0.2, 0.2)  # weight 2.5
    adv, mask = torch.tensor([1.0, 1.0]), torch.ones(2, 1)
    tis, stats = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        LossSettings(correction="tis", is_cap=2.0),
        prox_logp=logp.detach(),
    )
    decoupled, _ = policy_loss(
        logp, behaviour, adv, mask, LossSettings(correction="decoupled"), prox_logp=logp.detach()
    )
    assert float(tis) == pytest.approx(-2.0)
    assert float(decoupled) == pytest.approx(-2.5)
    assert stats["is_weight"] == pytest.approx(2.0)


def test_gradient_of_the_decoupled_loss_is_the_weighted_policy_gradient() -> None:
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    loss, _ = policy_loss(
        logp,
        torch.log(torch.tensor([[0.25]])),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        LossSettings(correction="decoupled"),
        prox_logp=logp.detach(),
    )
    loss.backward()
    # d/dlogp of -(exp(logp - prox) * A * w) at logp = prox is -A * w = -2
    assert logp.grad is not None and float(logp.grad) == pytest.approx(-2.0)


def test_k3_kl_penalty_is_added() -> None:
    logp, ref = _tokens(0.5), _tokens(0.25)
    settings = LossSettings(correction="none", kl_coef=0.5)
    loss, stats = policy_loss(
        logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), settings, ref_logp=ref
    )
    kl = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25 / 0.5)
    assert stats["kl"] == pytest.approx(kl, rel=1e-5)
    assert float(loss) == pytest.approx(0.5 * kl, rel=1e-5)


def test_masked_tokens_do_not_count() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1]]))
    loss, _ = policy_loss(
        logp,
        behaviour,
        torch.tensor([1.0]),
        torch.tensor([[1.0, 0.0]]),
        LossSettings(correction="none"),
    )
    assert float(loss) == pytest.approx(-1.0)


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_a_masked_token_far_below_its_reference_leaves_loss_and_gradient_finite(
    correction: str,
) -> None:
    # A prompt token's log-prob of -95 against the 0 that stands there for the reference and
    # behaviour: exp(95) overflows float32, and inf times the mask's 0 was NaN.
    logp = torch.tensor([[-95.0, math.log(0.5)]], requires_grad=True)
    zero_there = torch.tensor([[0.0, math.log(0.25)]])
    mask = torch.tensor([[0.0, 1.0]])
    settings = LossSettings(correction=correction, kl_coef=0.5)  # type: ignore[arg-type]
    loss, stats = policy_loss(
        logp, zero_there, torch.tensor([1.0]), mask, settings,
        prox_logp=zero_there if correction != "none" else None, ref_logp=zero_there,
    )  # fmt: skip
    assert math.isfinite(float(loss.detach()))
    loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert float(logp.grad[0, 0]) == 0.0
    assert stats["kl"] == pytest.approx(0.5 - math.log(0.5) - 1, rel=1e-5)


def test_sequence_aggregation_weights_sequences_equally() -> None:
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    tok, _ = policy_loss(
        logp, logp.clone(), adv, mask, LossSettings(correction="none", aggregation="token")
    )
    seq, _ = policy_loss(
        logp, logp.clone(), adv, mask, LossSettings(correction="none", aggregation="sequence")
    )
    assert float(tok) == pytest.approx((-3 + 1) / 4)
    assert float(seq) == pytest.approx(0.0)


def test_the_learning_rate_warms_up_linearly_then_stays_constant() -> None:
    factor = lr_factor(TrainerConfig(warmup_steps=4, lr_schedule="constant", max_steps=10))
    assert [factor(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_the_epochs_of_one_rl_step_share_its_learning_rate() -> None:
    """The schedule counts RL steps: with 3 optimiser steps to each, it reaches its floor at
    ``max_steps`` RL steps, not a third of the way."""
    settings = {"warmup_steps": 2, "lr_schedule": "cosine", "max_steps": 6, "min_lr_ratio": 0.1}
    once = lr_factor(TrainerConfig(**settings))
    thrice = lr_factor(TrainerConfig(ppo_epochs=3, **settings))
    assert [thrice(s) for s in range(3 * 8)] == [once(s // 3) for s in range(3 * 8)]
    assert thrice(3 * 5) > thrice(3 * 6) == pytest.approx(0.1)


def test_the_cosine_schedule_decays_to_its_floor_at_the_last_step() -> None:
    factor = lr_factor(
        TrainerConfig(warmup_steps=2, lr_schedule="cosine", max_steps=12, min_lr_ratio=0.1)
    )
    assert factor(1) == 1.0 and factor(2) == pytest.approx(1.0)
    assert factor(7) == pytest.approx(0.55)
    assert factor(12) == pytest.approx(0.1) and factor(20) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(2, 15))
