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

from asyncflow import config as cfg
from asyncflow.engines.fsdp import FSDPTrainEngine, decoder_layers
from asyncflow.engines.hf import load_model
from asyncflow.engines.registry import create_train_engine
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.workers.steps import StepLoss
from rank_groups import (
    GROUPS,
    N,
    Setting,
    check_initial_weights,
    check_one_step,
    rank_config,
    rank_group,
    samples,
)

pytestmark = [pytest.mark.slow]

CONFIG = rank_config("trainer.engine=fsdp")


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setting]:
    yield from rank_group(tmp_path_factory.mktemp("fsdp"), CONFIG)


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


def test_two_fsdp_ranks_start_and_publish_the_initial_weights(setting: Setting) -> None:
    assert setting[1].name == "fsdp"
    check_initial_weights(setting, CONFIG)


def test_a_two_rank_fsdp_step_equals_one_step_on_the_whole_batch(setting: Setting) -> None:
    check_one_step(setting, CONFIG)


def test_a_checkpoint_of_the_ranks_brings_back_their_model_and_version(
    setting: Setting, tmp_path: Path
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
    setting: Setting, listeners_off_loopback: Callable[[], list[str]]
) -> None:
    _, group, _ = setting
    next(group.export_weights())
    assert listeners_off_loopback() == []
