"""Trainer ranks on a GPU machine: each rank takes a GPU of its own, so more ranks than GPUs is
refused before any rank process starts (on one GPU, the second rank once failed at start-up
with CUDA's "invalid device ordinal")."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

import asyncflow as af
from asyncflow import config as cfg
from asyncflow.errors import ConfigError
from asyncflow.launch import ranks


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ranks, "gpu_count", lambda: 1)
    started: list[object] = []
    monkeypatch.setattr(multiprocessing, "get_context", lambda *_: started.append(1))
    config = cfg.load(None, ["trainer.engine=deepspeed", "trainer.dp_size=2"])
    with pytest.raises(ConfigError, match=r"trainer.dp_size 2 needs a GPU per rank .* it has 1"):
        ranks.RankGroup(tmp_path, config, af.Store(), "tcp://127.0.0.1:1", tmp_path)
    assert not started
