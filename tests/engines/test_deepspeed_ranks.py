"""Two DeepSpeed ranks on CPU, each in its own process, training one step from the store daemon.

Set-up (two rank processes importing torch and DeepSpeed) is the cost, so one rank group serves
the module, and the test that kills a rank runs last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from asyncflow import config as cfg
from asyncflow.engines.deepspeed import DeepSpeedTrainEngine
from asyncflow.engines.errors import EngineDiedError
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.workers.steps import StepLoss
from rank_groups import (
    Setting,
    check_initial_weights,
    check_one_step,
    rank_config,
    rank_group,
    samples,
)

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

CONFIG = rank_config("trainer.zero_stage=3")


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setting]:
    yield from rank_group(tmp_path_factory.mktemp("ranks"), CONFIG)


def test_ranks_start_and_publish_the_initial_weights(setting: Setting) -> None:
    check_initial_weights(setting, CONFIG)


def test_a_two_rank_zero3_step_equals_one_step_on_the_whole_batch(setting: Setting) -> None:
    check_one_step(setting, CONFIG)


def test_the_ranks_meet_and_listen_on_loopback_only(
    setting: Setting, listeners_off_loopback: Callable[[], list[str]]
) -> None:
    """Rank 0's rendezvous store and the collectives' sockets (and the store daemon)."""
    _, group, _ = setting
    next(group.export_weights())  # once every rank has started
    assert listeners_off_loopback() == []


@pytest.mark.parametrize("stage", [0, 1])
def test_one_rank_reports_the_gradient_norm_it_clipped_at_stage(stage: int, tmp_path: Path) -> None:
    """ZeRO-0 clips with a plain optimiser, whose norm DeepSpeed does not keep: it read NaN."""
    config = cfg.load(None, ["model.hidden_size=64", f"trainer.zero_stage={stage}"])
    model_dir = create_tiny_model(config.model, tmp_path / "model", seed=3)
    loss = StepLoss(config, chatml_tokenizer().pad_id)
    batch = loss.batch(samples(0))
    reference = HFTrainEngine(model_dir, config)
    reference.forward_backward(batch, loss)
    expected = reference.optimizer_step()["grad_norm"]
    engine = DeepSpeedTrainEngine(model_dir, config)
    try:
        engine.forward_backward(batch, loss)
        assert engine.optimizer_step()["grad_norm"] == pytest.approx(expected, rel=1e-4)
    finally:
        engine.close()
        torch.distributed.destroy_process_group()


def test_a_rank_that_dies_is_an_error_naming_it_not_a_hang(
    setting: Setting,
) -> None:
    _, group, _ = setting
    group.procs[1].kill()
    with pytest.raises(EngineDiedError, match="deepspeed trainer rank 1 exited"):
        group.train_step(1, threading.Event())
