"""Two DeepSpeed ranks on CPU, each in its own process, training one step from the store daemon.

Set-up (two rank processes importing torch and DeepSpeed) is the cost, so one rank group serves
the module, and the test that kills a rank runs last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from asyncflow.engines.errors import EngineDiedError
from rank_groups import Setting, check_initial_weights, check_one_step, rank_config, rank_group

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


def test_a_rank_that_dies_is_an_error_naming_it_not_a_hang(
    setting: Setting,
) -> None:
    _, group, _ = setting
    group.procs[1].kill()
    with pytest.raises(EngineDiedError, match="deepspeed trainer rank 1 exited"):
        group.train_step(1, threading.Event())
