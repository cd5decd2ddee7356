"""What the data-parallel rank tests share: two ranks of a train engine on CPU, each in its own
process, reading a step from a store daemon, checked against one step of the single-process hf
engine on the whole batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.daemon import DaemonProcess
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.launch.ranks import RankGroup
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.workers.steps import StepLoss

GROUPS, N = 4, 4

Setting = tuple[af.Store, RankGroup, Path]


def rank_config(*overrides: str) -> cfg.Config:
    """Two ranks of a tiny model, with the engine's own ``overrides``."""
    return cfg.load(
        None,
        [
            "model.hidden_size=64",
            "model.intermediate_size=128",
            "trainer.dp_size=2",
            f"trainer.groups_per_step={GROUPS}",
            f"rollout.n={N}",
            # Small enough that the ranks need different numbers of micro-batches.
            "trainer.micro_batch_tokens=40",
            "trainer.lr=1e-3",
            "trainer.timeout=300",
            *overrides,
        ],
    )


def samples(seed: int) -> dict[str, list[np.ndarray]]:
    """A step's worth of rollout samples with advantages, of varied lengths."""
    rng = np.random.default_rng(seed)
    tok = chatml_tokenizer()
    rows = GROUPS * N
    prompts = [np.array(tok.encode(f"{rng.integers(10, 99)}+7="), np.int64) for _ in range(rows)]
    responses = [
        rng.integers(2, len(tok), rng.integers(1, 9)).astype(np.int64) for _ in range(rows)
    ]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "behaviour_logprobs": [np.full(len(r), -2.0, np.float32) for r in responses],
        "advantage": list(rng.normal(size=rows).astype(np.float32)),
        "reward": list(rng.integers(0, 2, rows).astype(np.float32)),
    }


def rank_group(root: Path, config: cfg.Config) -> Iterator[Setting]:
    """A store daemon and a rank group over a fresh tiny model (a module fixture's body)."""
    model_dir = create_tiny_model(config.model, root / "model", seed=3)
    with DaemonProcess() as daemon:
        store = af.connect(daemon.url)
        store.register_task("train", partitions=["step-"])
        group = RankGroup(model_dir, config, store, daemon.url, root / "logs")
        yield store, group, model_dir
        group.close()


def check_initial_weights(setting: Setting, config: cfg.Config) -> None:
    """The ranks start from the model's weights and publish them as version 0."""
    store, group, model_dir = setting
    initial = dict(group.export_weights())
    assert group.version == 0 == weights.latest_version(store)
    reference = dict(HFTrainEngine(model_dir, config).export_weights())
    assert initial.keys() == reference.keys()
    assert all(torch.equal(initial[k], reference[k]) for k in reference)


def check_one_step(setting: Setting, config: cfg.Config) -> None:
    """One step of the ranks gives the weights of one single-process step on the whole batch."""
    store, group, model_dir = setting
    data = samples(0)
    store.put(data, partition="step-0", groups=np.repeat(np.arange(GROUPS), N), group_size=N)

    loss = StepLoss(config, chatml_tokenizer().pad_id)
    whole = loss.batch(data)
    reference = HFTrainEngine(model_dir, config)
    assert (group.logprobs(whole) - reference.logprobs(whole)).abs().max() < 1e-5

    result = group.train_step(0, threading.Event())
    assert result is not None and group.version == 1
    assert result.trained_groups == list(range(GROUPS)), "every group trained once, on one rank"

    reference.forward_backward(whole, loss)
    expected = reference.optimizer_step()
    assert result.optimizer["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    published = dict(group.export_weights())
    want = dict(reference.export_weights())
    initial = dict(HFTrainEngine(model_dir, config).export_weights())
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
    gap = max(float((published[k] - want[k]).abs().max()) for k in want)
    assert moved > 1e-4, "the step changed the weights"
    assert gap < 1e-5, f"ranks' weights differ from the single-process step by {gap}"
