"""A trainer rank of the local launcher ends with the job's process, however the job ends: a job
killed outright (SIGKILL, so none of its cleanup runs) left its ranks running until their own
waits ran out, minutes later."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import asyncflow as af
from asyncflow import config as cfg
from asyncflow.launch import rank_process, ranks
from asyncflow.launch.rank_process import RankSpec

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the parent-death signal is Linux's"
)


def test_the_job_starts_each_rank_to_end_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs: list[RankSpec] = []

    class Context:
        def Pipe(self) -> tuple[Any, Any]:  # noqa: N802 (multiprocessing's name)
            return mock.Mock(), mock.Mock()

        def Process(self, target: Any, args: tuple[Any, ...], **_: Any) -> Any:  # noqa: N802
            specs.append(args[0])
            return mock.Mock()

    monkeypatch.setattr(multiprocessing, "get_context", lambda _: Context())
    config = cfg.load(None, ["trainer.engine=deepspeed", "trainer.dp_size=2"])
    ranks.RankGroup(tmp_path, config, af.Store(), "tcp://127.0.0.1:1", tmp_path)
    assert [s.parent for s in specs] == [os.getpid()] * 2


def test_a_rank_whose_job_is_gone_ends_before_it_starts(tmp_path: Path) -> None:
    # Its parent is not the job it was started for (that job ended before the rank could ask
    # to end with it): it returns at once, with no log opened and no engine started.
    with subprocess.Popen([sys.executable, "-c", "pass"]) as other:
        other.wait()
    spec = RankSpec(
        0,
        1,
        0,
        tmp_path,
        cfg.load(),
        "tcp://127.0.0.1:1",
        None,
        tmp_path / "rank.log",
        parent=other.pid,
    )
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(target=rank_process.main, args=(spec, theirs))
    proc.start()
    theirs.close()
    proc.join(120)  # generous: the rank's process imports the package before it returns
    assert proc.exitcode == 0
    assert not (tmp_path / "rank.log").exists()
    with pytest.raises(EOFError):
        ours.recv()
