"""The ``asyncflow`` command's own handling of what it is given: clear one-line errors, no
traceback, nothing run or overwritten."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow import cli
from asyncflow.daemon import DaemonProcess


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "sched", "--costs", "x.yaml"], "reads no cost model"),
        (["bench", "pipeline", "--costs", "/no/such.yaml"], "no such file"),
        (["bench", "sched", "--json", "out.md"], "give the records a name of their own"),
        (["bench", "e2e", "--cases", "bogus"], "e2e cases are"),
        (["bench", "e2e", "--seeds", "7"], "e2e seeds are some of"),
        (["data", "make", "gsm-synthetic", "--out", "d", "--train", "-5"], "must be at least 1"),
    ],
)
def test_arguments_a_command_cannot_use_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # They were tracebacks after the suite's start, or (negative counts) empty files.
    os.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_python_dash_m_asyncflow_is_the_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncflow", "--help"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("usage: asyncflow")


def test_a_config_file_of_ones_own_in_the_run_directory_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "config.yaml"
    mine.write_text("# my experiment: keep this file!\ntrainer:\n  max_steps: 2\n")
    argv = ["train", "--config", str(mine), "--run-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "would be replaced" in capsys.readouterr().err
    assert mine.read_text().startswith("# my experiment")


def test_ctrl_c_ends_a_run_with_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("asyncflow.train.train", interrupted)
    monkeypatch.setattr(cli, "_stop_on_sigterm", lambda: None)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == (
        "asyncflow train: interrupted (the run's processes were stopped)\n"
    )


def test_a_jobs_own_daemon_is_out_of_reach_of_the_terminals_ctrl_c() -> None:
    # In the job's process group, a Ctrl-C stopped the daemon with the job, whose workers then
    # retried the dead store for minutes before the job could end.
    with DaemonProcess(exit_with_parent=True) as daemon:
        assert os.getpgid(daemon.proc.pid) != os.getpgid(0)
    with DaemonProcess() as daemon:  # a daemon of one's own stays in the group
        assert os.getpgid(daemon.proc.pid) == os.getpgid(0)


def test_overrides_after_an_option_are_overrides_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse left them over and refused them ("unrecognized arguments").
    argv = ["train", "trainer.max_steps=3", "--run-dir", str(tmp_path / "r"), "trainer.lr=fast"]
    assert cli.main(argv) == 2
    assert "trainer.lr must be a number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "sched", "extra=1"])
    assert "unrecognized arguments: extra=1" in capsys.readouterr().err


def test_paths_given_with_a_leading_tilde_are_in_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shell leaves --run-dir=~/x (and a quoted ~) alone.
    monkeypatch.setenv("HOME", str(tmp_path))
    args = cli.build_parser().parse_args(["train", "--run-dir=~/x", "--config", "~/c.yaml"])
    assert args.run_dir == tmp_path / "x" and args.config == tmp_path / "c.yaml"
    args = cli.build_parser().parse_args(["bench", "sched", "--json=~/o.json", "--costs=~/c.yaml"])
    assert args.json == tmp_path / "o.json" and args.costs == tmp_path / "c.yaml"
    # A user with no home directory is a usage error, not a traceback.
    with pytest.raises(SystemExit) as usage:
        cli.build_parser().parse_args(["train", "--run-dir=~nosuchuser/x"])
    assert usage.value.code == 2
