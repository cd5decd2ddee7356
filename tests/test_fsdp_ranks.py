"""Two FSDP2 ranks on CPU (gloo), each in its own process, training one step from the store
daemon: the same weights as one step of the single-process hf engine on the whole batch.

Set-up (two rank processes importing torch) is the cost, so one rank group serves the module."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights
from asyncflow.daemon import DaemonProcess
from asyncflow.engines.fsdp import FSDPTrainEngine, decoder_layers
from asyncflow.engines.hf import HFTrainEngine, load_model
from asyncflow.engines.ranks import RankGroup
from asyncflow.engines.registry import create_train_engine
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.workers.steps import StepLoss

GROUPS, N = 4, 4
CONFIG = cfg.load(
    None,
    [
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "trainer.engine=fsdp",
        "trainer.dp_size=2",
        f"trainer.groups_per_step={GROUPS}",
        f"rollout.n={N}",
        # Small enough that the ranks need different numbers of micro-batches.
        "trainer.micro_batch_tokens=40",
        "trainer.lr=1e-3",
        "trainer.timeout=300",
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


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[af.Store, RankGroup, Path]]:
    root = tmp_path_factory.mktemp("fsdp")
    model_dir = create_tiny_model(CONFIG.model, root / "model", seed=3)
    with DaemonProcess() as daemon:
        store = af.connect(daemon.url)
        store.register_task("train", partitions=["step-"])
        group = RankGroup(model_dir, CONFIG, store, daemon.url, root / "logs")
        yield store, group, model_dir
        group.close()


def test_fsdp_is_a_registered_engine_sharding_every_decoder_layer(tmp_path: Path) -> None:
    model_dir = create_tiny_model(CONFIG.model, tmp_path / "model", seed=3)
    layers = decoder_layers(load_model(model_dir, "float32"))
    assert len(layers) == CONFIG.model.layers > 1
    assert all(type(layer).__name__ == "Qwen2DecoderLayer" for layer in layers)
    one = cfg.load(None, ["model.hidden_size=64", "model.intermediate_size=128"])
    engine = create_train_engine("fsdp", model_dir, one)  # a group of one, in this process
    try:
        assert isinstance(engine, FSDPTrainEngine)
        sharded = [p for _, p in engine.model.named_parameters()]
        assert all(type(p).__name__ == "DTensor" for p in sharded), "every parameter sharded"
    finally:
        engine.close()
        torch.distributed.destroy_process_group()


def test_two_fsdp_ranks_start_and_publish_the_initial_weights(
    setting: tuple[af.Store, RankGroup, Path],
) -> None:
    store, group, model_dir = setting
    initial = dict(group.export_weights())
    assert group.version == 0 == weights.latest_version(store)
    assert group.name == "fsdp"
    reference = dict(HFTrainEngine(model_dir, CONFIG).export_weights())
    assert initial.keys() == reference.keys()
    assert all(torch.equal(initial[k], reference[k]) for k in reference)


def test_a_two_rank_fsdp_step_equals_one_step_on_the_whole_batch(
    setting: tuple[af.Store, RankGroup, Path],
) -> None:
    store, group, model_dir = setting
    data = samples(0)
    store.put(data, partition="step-0", groups=np.repeat(np.arange(GROUPS), N), group_size=N)

    loss = StepLoss(CONFIG, chatml_tokenizer().pad_id)
    whole = loss.batch(data)
    reference = HFTrainEngine(model_dir, CONFIG)
    assert (group.logprobs(whole) - reference.logprobs(whole)).abs().max() < 1e-5

    result = group.train_step(0, threading.Event())
    assert result is not None and group.version == 1
    assert result.trained_groups == list(range(GROUPS)), "every group trained once, on one rank"

    reference.forward_backward(whole, loss)
    expected = reference.optimizer_step()
    assert result.optimizer["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    published = dict(group.export_weights())
    want = dict(reference.export_weights())
    initial = dict(HFTrainEngine(model_dir, CONFIG).export_weights())
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
    gap = max(float((published[k] - want[k]).abs().max()) for k in want)
    assert moved > 1e-4, "the step changed the weights"
    assert gap < 1e-5, f"ranks' weights differ from the single-process step by {gap}"


def test_a_checkpoint_of_the_ranks_brings_back_their_model_and_version(
    setting: tuple[af.Store, RankGroup, Path], tmp_path: Path
) -> None:
    """Judged by the ranks' own models (their log-probs), not by weights published earlier."""
    store, group, _ = setting
    probe = StepLoss(CONFIG, chatml_tokenizer().pad_id).batch(samples(2))
    group.save(tmp_path / "ckpt")
    saved, version = group.logprobs(probe), group.version
    rows = np.repeat(np.arange(GROUPS), N)
    store.put(samples(1), partition=f"step-{version}", groups=rows, group_size=N)
    assert group.train_step(version, threading.Event()) is not None
    assert (group.logprobs(probe) - saved).abs().max() > 1e-4, "the step moved the model"
    group.load(tmp_path / "ckpt")
    assert group.version == version
    assert torch.equal(group.logprobs(probe), saved)


def test_the_fsdp_ranks_meet_and_listen_on_loopback_only(
    setting: tuple[af.Store, RankGroup, Path], listeners_off_loopback: Callable[[], list[str]]
) -> None:
    _, group, _ = setting
    next(group.export_weights())
    assert listeners_off_loopback() == []
