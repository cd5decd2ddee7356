"""PPO with a critic: GAE by hand, the clipped value loss, the critic learning on a fixed batch,
the advantage worker reading the critic's ``values`` from the store, and a short run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_workflow import run

import asyncflow as af
from asyncflow import config as cfg
from asyncflow.algorithms.value import gae, token_rewards, value_loss, whiten
from asyncflow.config import ConfigError, ModelConfig
from asyncflow.engines.base import TrainBatch
from asyncflow.engines.critic import CriticEngine, HFCriticEngine, ValueLossFn
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.progress import Reporter
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks, train
from asyncflow.workers.advantage import AdvantageWorker
from asyncflow.workers.base import Context, RunState, step_partition
from asyncflow.workers.critic import CriticWorker
from asyncflow.workers.steps import StepLoss


def test_gae_matches_a_hand_computation() -> None:
    rewards = token_rewards(1.0, 3)
    assert rewards.tolist() == [0.0, 0.0, 1.0]
    values = np.array([0.5, 0.25, 0.75])
    adv, returns = gae(rewards, values, gamma=0.9, lam=0.5)
    # delta_2 = 1 - 0.75 = 0.25;  delta_1 = 0.9 * 0.75 - 0.25 = 0.425;
    # delta_0 = 0.9 * 0.25 - 0.5 = -0.275;  A_1 = 0.425 + 0.45 * 0.25 = 0.5375;
    # A_0 = -0.275 + 0.45 * 0.5375 = -0.033125
    np.testing.assert_allclose(adv, [-0.033125, 0.5375, 0.25], atol=1e-12)
    np.testing.assert_allclose(returns, [0.466875, 0.7875, 1.0], atol=1e-12)
    # gamma = lam = 1: the Monte Carlo advantage, the reward less each value.
    adv, returns = gae(rewards, values, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [0.5, 0.75, 0.25])
    np.testing.assert_allclose(returns, [1.0, 1.0, 1.0])


def test_the_kl_penalty_goes_on_each_token_and_whitening_spans_all_responses() -> None:
    r = token_rewards(1.0, 2, kl=np.array([0.5, -1.0]), kl_coef=0.1)
    np.testing.assert_allclose(r, [-0.05, 1.1])
    white = whiten([np.array([1.0, 2.0]), np.array([3.0])])
    flat = np.concatenate(white)
    assert abs(flat.mean()) < 1e-6 and abs(flat.std() - 1) < 1e-4
    assert white[0][0] < white[0][1] < white[1][0]


def test_gae_of_a_multi_turn_row_steps_over_the_environments_tokens() -> None:
    # model, tool output, model, tool output: the reward goes on the last token the model wrote,
    # and the episode is the model's tokens alone (the tool's have no advantage and no KL).
    mask = np.array([1, 0, 1, 0], np.uint8)
    kl = np.array([0.5, 7.0, -1.0, 7.0])
    rewards = token_rewards(1.0, 4, kl=kl, kl_coef=0.1, mask=mask)
    np.testing.assert_allclose(rewards, [-0.05, 0.0, 1.1, 0.0])
    values = np.array([0.5, 9.0, 0.25, 9.0])
    adv, returns = gae(rewards, values, gamma=0.9, lam=0.5, mask=mask)
    # delta_2 = 1.1 - 0.25 = 0.85; delta_0 = -0.05 + 0.9 * 0.25 - 0.5 = -0.325;
    # A_0 = -0.325 + 0.45 * 0.85 = 0.0575
    np.testing.assert_allclose(adv, [0.0575, 0.0, 0.85, 0.0], atol=1e-12)
    alone, alone_returns = gae(rewards[[0, 2]], values[[0, 2]], gamma=0.9, lam=0.5)
    np.testing.assert_allclose(adv[[0, 2]], alone)
    np.testing.assert_allclose(returns[[0, 2]], alone_returns)
    # Whitening counts only the model's tokens and leaves the others at 0.
    white = whiten([adv, np.array([2.0])], [mask, None])
    np.testing.assert_allclose(white[0][[1, 3]], [0.0, 0.0])
    expected = whiten([adv[[0, 2]], np.array([2.0])])
    np.testing.assert_allclose(white[0][[0, 2]], expected[0], atol=1e-6)
    np.testing.assert_allclose(white[1], expected[1], atol=1e-6)
    with pytest.raises(ValueError, match="loss mask"):
        gae(rewards, values, 0.9, 0.5, mask=np.ones(3))


def test_a_row_left_out_of_the_loss_moves_no_other_rows_whitened_advantages() -> None:
    """Under ``overlong: filter`` a cut row has no advantage; its values, whatever they are,
    leave the others' advantages as they would be without it."""
    config = cfg.load(
        None,
        [
            "rollout.n=3",
            "algorithm.advantage=gae",
            "algorithm.overlong=filter",
            "rollout.max_tokens=3",
        ],
    )
    worker = AdvantageWorker(Context(af.Store(), config, chatml_tokenizer(), Tracer(), RunState()))
    eos = worker.ctx.tokenizer.eos_id
    # Rows 0 and 1 ended; row 2 was cut at rollout.max_tokens.
    responses = [np.array([5, eos]), np.array([6, 7, eos]), np.array([5, 6, 7])]
    rewards = np.array([1.0, 0.0, 0.0])

    def advantages(cut_values: float) -> list[np.ndarray]:
        values = [np.array([0.2, 0.4]), np.array([0.1, 0.3, 0.5]), np.full(3, cut_values)]
        data: dict[str, list[object]] = {"response_ids": list(responses), "values": values}
        adv, _ = worker.advantages(rewards, np.zeros(3, np.int64), data)
        shaped = worker.token_advantages(worker.shaped_rewards, adv, data)
        return shaped["token_advantages"]  # type: ignore[return-value]

    low, high = advantages(0.0), advantages(5.0)
    for a, b in zip(low, high, strict=True):
        np.testing.assert_allclose(a, b)
    assert not high[2].any() and high[0].any()
    # Whitened over the two rows in the loss alone.
    flat = np.concatenate(high[:2])
    assert abs(flat.mean()) < 1e-5 and flat.std() == pytest.approx(1.0, rel=1e-4)


def test_the_value_loss_is_clipped_around_the_scoring_values() -> None:
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5]])
    returns = torch.zeros(1, 2)
    loss, stats = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # token 0: max(1^2, 0.7^2) / 2 = 0.5; token 1: max(0^2, 0.3^2) / 2 = 0.045; mean 0.2725
    assert float(loss.detach()) == pytest.approx(0.2725)
    assert stats["value_clip_fraction"] == pytest.approx(1.0)
    loss.backward()
    assert values.grad is not None
    # Token 1's clipped term wins and does not move with the value: no gradient there.
    assert values.grad[0].tolist() == pytest.approx([0.5, 0.0])


@pytest.mark.parametrize(("advantage", "kl_in_loss"), [("gae", False), ("grpo", True)])
def test_the_kl_to_the_reference_is_in_the_reward_or_in_the_loss_never_both(
    advantage: str, kl_in_loss: bool
) -> None:
    # GAE takes kl_coef x KL in its per-token rewards (the advantage worker), so its loss must
    # not add the KL again; GRPO's loss carries it.
    config = cfg.load(
        None,
        [
            f"algorithm.advantage={advantage}",
            "algorithm.reference=true",
            "trainer.kl_coef=0.5",
            "trainer.packing=false",
        ],
    )
    loss_fn = StepLoss(config, pad_id=0)
    logp = torch.full((1, 6), -1.2)

    def loss_with_reference(ref: float) -> float:
        data = {
            "prompt_ids": [np.array([5, 6, 7], np.int64)],
            "response_ids": [np.array([8, 9, 10], np.int64)],
            "behaviour_logprobs": [np.full(3, -1.0, np.float32)],
            "ref_logprobs": [np.full(3, ref, np.float32)],
            "advantage": [1.0],
            "token_advantages": [np.array([0.5, -0.25, 1.0], np.float32)],
        }
        return float(loss_fn(logp, loss_fn.batch(data))[0])

    assert (loss_with_reference(-1.0) != loss_with_reference(-3.0)) == kl_in_loss


def critic_config(*overrides: str) -> cfg.Config:
    return cfg.load(
        None, ["rollout.n=2", "trainer.groups_per_step=2", "algorithm.advantage=gae", *overrides]
    )


def test_the_value_loss_falls_on_a_fixed_batch(tmp_path: Path) -> None:
    model = create_tiny_model(
        ModelConfig(hidden_size=32, intermediate_size=64, layers=1), tmp_path / "m", seed=0
    )
    config = critic_config("trainer.lr=1e-3")
    tok = chatml_tokenizer()
    ctx = Context(af.Store(), config, tok, Tracer(), RunState())
    worker = CriticWorker(ctx, HFCriticEngine(model, config))
    rng = np.random.default_rng(0)
    data: dict[str, list[np.ndarray]] = {
        "prompt_ids": [np.array(tok.encode(f"{i}+{i}="), np.int64) for i in range(4)],
        "response_ids": [rng.integers(3, 20, size=3 + i) for i in range(4)],
        "returns": [rng.uniform(0, 1, size=3 + i).astype(np.float32) for i in range(4)],
    }
    tokens = sum(len(r) for r in data["response_ids"])
    losses = []
    for _ in range(40):
        # As in the pipeline: the samples are scored, then trained on with those values.
        data["values"] = [np.zeros(len(r), np.float32) for r in data["response_ids"]]
        for part, tb in worker.micro_batches(data):
            v = worker.engine.values(tb)
            for row, i in enumerate(part):
                p = len(data["prompt_ids"][i])
                data["values"][i] = v[row, p : p + len(data["response_ids"][i])].numpy()
        total = 0.0
        for _, tb in worker.micro_batches(data, with_targets=True):
            stats = worker.engine.forward_backward(tb, worker.loss_share(tokens))
            total += stats["value_loss"] * float(tb.response_mask.sum()) / tokens
        worker.engine.optimizer_step()
        losses.append(total)
    assert losses[0] > 0.1  # values start at 0, the returns average 0.5
    assert losses[-1] < 0.3 * losses[0]
    assert worker.engine.version == 40


class RecordingCritic(CriticEngine):
    """Values all 1; ``forward_backward`` records each micro-batch and its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[tuple[TrainBatch, float]] = []

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return torch.ones(batch.input_ids.shape)

    def forward_backward(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        loss, stats = loss_fn(self.values(batch), batch)
        self.batches.append((batch, float(loss)))
        return stats

    def optimizer_step(self) -> dict[str, float]:
        self.version += 1
        return {}

    def save(self, directory: Path) -> None:
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        raise NotImplementedError


def test_the_critic_learns_values_only_at_the_tokens_the_model_wrote() -> None:
    config = critic_config("agent.enabled=true", "run.poll_interval=0.05")
    store = af.Store()
    register_tasks(store, reference=False, critic=True)
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState())
    engine = RecordingCritic()
    worker = CriticWorker(ctx, engine)
    masks = [np.array([1, 0, 0, 1], np.uint8), np.array([1, 1], np.uint8)]
    store.put(
        {
            "prompt_ids": [np.array([1, 2], np.int64)] * 2,
            "response_ids": [np.array([5, 6, 7, 8], np.int64), np.array([5, 6], np.int64)],
            "loss_mask": masks,
            # Values 1 everywhere, returns 0 where the model wrote and 5 at the tool's tokens:
            # with the tool's tokens masked, every counted token has loss 0.5 * 1^2.
            "values": [np.ones(4, np.float32), np.ones(2, np.float32)],
            "returns": [np.array([0, 5, 5, 0], np.float32), np.zeros(2, np.float32)],
        },
        partition=step_partition(0),
        groups=[0, 0],
        group_size=2,
    )
    assert worker.train()
    ((batch, loss),) = engine.batches
    # The response mask at each row's response positions is its loss mask.
    got = [batch.response_mask[i, 2 : 2 + len(m)].tolist() for i, m in enumerate(masks)]
    assert got == [m.tolist() for m in masks]
    assert loss == pytest.approx(0.5)  # the mean over the 4 tokens the model wrote


def test_the_critic_claims_its_training_rows_under_the_checkpoints_lock() -> None:
    # A checkpoint holds the lock while it saves the critic; a batch claimed outside it would
    # spend that time on its lease.
    config = critic_config("run.poll_interval=0.05")
    store = af.Store()
    register_tasks(store, reference=False, critic=True)
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState())
    worker = CriticWorker(ctx, RecordingCritic())
    held: list[bool] = []

    def claim(task: str, fields: list[str], rows: int) -> af.Batch:
        held.append(worker.lock.locked())
        return store.claim(task, fields, rows, timeout=0.0, allow_partial=True)

    worker.claim_quietly = claim  # type: ignore[method-assign]
    assert not worker.train()  # nothing to learn from yet
    assert held == [True]


def test_rows_the_critic_has_learnt_from_are_marked_and_not_learnt_from_twice() -> None:
    config = critic_config("run.poll_interval=0.05")
    store = af.Store()
    register_tasks(store, reference=False, critic=True)
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState())
    engine = RecordingCritic()
    worker = CriticWorker(ctx, engine)

    def put(group: int, **extra: list[object]) -> np.ndarray:
        return store.put(
            {
                "prompt_ids": [np.array([1, 2], np.int64)],
                "response_ids": [np.array([5, 6], np.int64)],
                "values": [np.ones(2, np.float32)],
                "returns": [np.zeros(2, np.float32)],
                **extra,
            },
            partition=step_partition(0),
            groups=[group],
            group_size=1,
        )

    # As a resumed run restores them: one row learnt from before the checkpoint, one not.
    learnt = put(0, critic_trained=[np.uint8(1)])
    new = put(1)
    assert worker.train()
    ((batch, _),) = engine.batches
    assert batch.input_ids.shape[0] == 1  # only the new row
    # Both acked; the new one now carries the mark a checkpoint would keep.
    assert "critic_trained" in store.ready_fields(new)[0]
    assert "critic_trained" in store.ready_fields(learnt)[0]
    left = store.claim("critic_train", ["returns"], 2, timeout=0.05, allow_partial=True)
    assert len(left) == 0


def test_a_resumed_ppo_run_carries_on_with_the_critic_it_checkpointed(tmp_path: Path) -> None:
    first = run(
        tmp_path,
        "trainer.max_steps=4",
        "run.checkpoint_every=2",
        "trainer.groups_per_step=4",
        "rollout.n=4",
        "algorithm.advantage=gae",
    )
    ckpt = tmp_path / "checkpoints" / "step-000002"
    saved = torch.load(ckpt / "critic" / "critic.pt", weights_only=True)
    assert saved["version"] >= 1 and saved["version"] <= first["critic"]["version"]
    config = cfg.load(tmp_path / "config.yaml", [])
    resumed = train(config, resume=tmp_path, reporter=Reporter(enabled=False))
    critic = resumed["critic"]
    # The critic went on from its checkpointed state: its optimiser steps continue from there.
    assert critic["updates"] >= 1
    assert critic["version"] == saved["version"] + critic["updates"]
    # A checkpoint without the critic's state cannot resume a run that has a critic.
    shutil.rmtree(ckpt / "critic")
    shutil.rmtree(tmp_path / "checkpoints" / "step-000004", ignore_errors=True)
    with pytest.raises(ConfigError, match="no critic state"):
        train(config, resume=tmp_path, reporter=Reporter(enabled=False))


def test_the_advantage_worker_reads_the_critics_values_from_the_store() -> None:
    config = critic_config("run.poll_interval=0.05", "algorithm.gamma=0.9", "algorithm.lam=0.5")
    store = af.Store()
    register_tasks(store, reference=False, critic=True)
    ctx = Context(store, config, chatml_tokenizer(), Tracer(), RunState())
    values = [np.array([0.5, 0.25, 0.75], np.float32), np.array([0.0, 0.5], np.float32)]
    idx = store.put(
        {
            "prompt_ids": [np.array([1, 2], np.int64)] * 2,
            "response_ids": [np.array([5, 6, 7], np.int64), np.array([5, 6], np.int64)],
            "reward": [1.0, 0.0],
        },
        partition=step_partition(0),
        groups=[0, 0],
        group_size=2,
    )
    worker = AdvantageWorker(ctx)
    assert worker.step()  # no values yet: nothing is claimed
    claimed = store.claim("train", ["advantage"], 2, timeout=0.05, allow_partial=True)
    assert len(claimed) == 0
    claimed.release()
    store.put({"values": values}, indexes=idx)  # what the critic worker writes
    worker.step()
    with store.claim("train", ["token_advantages", "returns", "advantage"], 2, timeout=5) as b:
        got = b.read()
        order = np.argsort(b.indexes)
    returns = [np.asarray(got["returns"][i]) for i in order]
    np.testing.assert_allclose(returns[0], [0.466875, 0.7875, 1.0], atol=1e-6)
    # second: delta_1 = -0.5, delta_0 = 0.9 * 0.5 - 0 = 0.45; A_0 = 0.45 - 0.225 = 0.225
    np.testing.assert_allclose(returns[1], [0.225, 0.0], atol=1e-6)
    raw = [np.array([-0.033125, 0.5375, 0.25]), np.array([0.225, -0.5])]
    expected = whiten(raw)
    for i, k in enumerate(order):
        np.testing.assert_allclose(np.asarray(got["token_advantages"][k]), expected[i], atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.gamma=1.5"], "algorithm.gamma"),
        (["algorithm.lam=-0.1"], "algorithm.lam"),
        (["critic.value_clip=0"], "critic.value_clip"),
        (["critic.path=/nonexistent/critic"], "critic.path"),
        (["launcher=ray"], "launcher local"),
    ],
)
def test_bad_critic_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        critic_config(*overrides)


def test_a_ppo_run_trains_the_policy_and_the_critic(tmp_path: Path) -> None:
    summary = run(
        tmp_path,
        "trainer.max_steps=3",
        "trainer.groups_per_step=4",
        "rollout.n=4",
        "algorithm.advantage=gae",
    )
    critic = summary["critic"]
    assert critic["updates"] >= 1
    assert critic["value_loss_first"] > 0 and np.isfinite(critic["value_loss_last"])
    assert summary["samples_dropped"] == 0
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [len(step["trained"]) for step in ledger] == [4, 4, 4]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(np.isfinite(r["pg_loss"]) for r in records)
    assert any("critic" in r["busy"] for r in records)
