"""Trainer ranks on a GPU machine: each rank takes a GPU of its own, so more ranks than GPUs is
refused before any rank process starts (on one GPU, the second rank once failed at start-up
with CUDA's "invalid device ordinal"); on a CPU machine, or with a GPU per rank, ranks start."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import asyncflow as af
from asyncflow import config as cfg
from asyncflow.errors import ConfigError
from asyncflow.launch import ranks
from asyncflow.launch.rank_process import RankSpec


class StartedError(Exception):
    """Raised where the rank processes would be spawned: the check let them start."""


def start_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int, dp_size: int) -> None:
    monkeypatch.setattr(ranks, "gpu_count", lambda: gpus)

    def spawning(*_: object) -> None:
        raise StartedError

    monkeypatch.setattr(multiprocessing, "get_context", spawning)
    config = cfg.load(None, ["trainer.engine=deepspeed", f"trainer.dp_size={dp_size}"])
    ranks.RankGroup(tmp_path, config, af.Store(), "tcp://127.0.0.1:1", tmp_path)


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"trainer.dp_size 2 needs a GPU per rank .* it has 1"):
        start_ranks(tmp_path, monkeypatch, gpus=1, dp_size=2)


@pytest.mark.parametrize("gpus", [0, 2])
def test_ranks_start_on_a_cpu_machine_or_with_a_gpu_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int
) -> None:
    with pytest.raises(StartedError):
        start_ranks(tmp_path, monkeypatch, gpus=gpus, dp_size=2)


def test_rank_0_gets_the_rendezvous_port_already_listening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A port found free and closed again could be bound by another process before rank 0, a
    # process still importing its engine, listens on it: rank 0 gets the listening socket.
    specs: list[RankSpec] = []
    held: list[int] = []  # the ports no other socket could bind as each rank started

    class Context:
        def Pipe(self) -> tuple[Any, Any]:  # noqa: N802 (multiprocessing's name)
            return mock.Mock(), mock.Mock()

        def Process(self, target: Any, args: tuple[Any, ...], **_: Any) -> Any:  # noqa: N802
            specs.append(args[0])
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", args[0].master_port))
                except OSError:
                    held.append(args[0].master_port)
            return mock.Mock()

    monkeypatch.setattr(multiprocessing, "get_context", lambda _: Context())
    config = cfg.load(None, ["trainer.engine=deepspeed", "trainer.dp_size=2"])
    ranks.RankGroup(tmp_path, config, af.Store(), "tcp://127.0.0.1:1", tmp_path)
    assert [s.rank for s in specs] == [0, 1]
    assert held == [specs[0].master_port] * 2
    assert specs[1].listener is None
    listener = specs[0].listener
    assert listener is not None
    # The job's process closed its copy once rank 0 was started with it.
    assert listener.fileno() == -1
