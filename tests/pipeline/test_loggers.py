"""Experiment trackers (``run.loggers``): each gets the per-step metrics of ``metrics.jsonl``, the
config and the summary figure; one that cannot start, or fails later, is warned about once and
the run goes on. TensorBoard is installed here and read back; wandb and MLflow are optional
packages: their missing-package path is tested as is, and their calls against stand-ins."""

from __future__ import annotations

import json
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import matplotlib as mpl
import matplotlib.pyplot as plt
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from asyncflow import config as cfg
from asyncflow.telemetry.loggers import TrackerWarning, flatten
from asyncflow.telemetry.metrics import MetricsLog

mpl.use("Agg")

RECORDS = [
    {"step": 1, "loss": 0.5, "reward": {"mean": 0.25}, "stale": False},
    {"step": 2, "loss": 0.25, "reward": {"mean": 0.75}, "eval_accuracy": 0.5},
]


def figure(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [0, 1])
    fig.savefig(path)
    plt.close(fig)
    return path


def run_log(tmp_path: Path, loggers: list[str]) -> list[dict[str, Any]]:
    config = cfg.load(None, [f"run.loggers=[{','.join(loggers)}]", "run.name=tracked"])
    metrics = MetricsLog(tmp_path, loggers=config.run.loggers, config=config.to_dict())
    for record in RECORDS:
        metrics.log(record)
    metrics.close()
    metrics.finish(figure(tmp_path / "summary.png"))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_tensorboard_gets_the_steps_of_metrics_jsonl_the_config_and_the_figure(
    tmp_path: Path,
) -> None:
    records = run_log(tmp_path, ["tensorboard"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    expected = {
        key: [(r["step"], v) for r in records for k, v in flatten(r).items() if k == key]
        for key in ("loss", "reward/mean", "eval_accuracy")
    }
    got = {key: [(e.step, e.value) for e in events.Scalars(key)] for key in expected}
    assert got == expected
    assert "stale" not in events.Tags()["scalars"], "booleans are not metrics"
    assert events.Images("summary")[0].width > 0
    (config,) = events.Tensors("config/text_summary")
    assert b"name: tracked" in config.tensor_proto.string_val[0]


def test_a_resumed_run_gives_tensorboard_each_step_once(tmp_path: Path) -> None:
    """Killed after step 3 with a checkpoint at step 1, then resumed: steps 2 and 3 are logged
    again, and TensorBoard shows their second logging only."""
    first = MetricsLog(tmp_path, loggers=["tensorboard"])
    for step in (1, 2, 3):
        first.log({"step": step, "loss": float(step)})
    first.close()
    first.finish()
    resumed = MetricsLog(tmp_path, keep_until=1, loggers=["tensorboard"])
    # Whole on disk before the first new step is logged: a kill then lost the history.
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [1]
    for step in (2, 3, 4):
        resumed.log({"step": step, "loss": 10.0 * step})
    resumed.close()
    resumed.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert got == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_a_tracker_whose_package_is_missing_warns_once_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails, installed or not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = run_log(tmp_path, ["wandb", "tensorboard"])
    ours = [w for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "wandb could not start: ModuleNotFoundError" in str(ours[0].message)
    assert "pip install wandb" in str(ours[0].message)
    assert [r["step"] for r in records] == [1, 2], "metrics.jsonl is whole"
    assert any((tmp_path / "tensorboard").iterdir()), "the other tracker still works"


class Recorder:
    """Stands in for a tracker's package: records the calls asyncflow makes."""

    def __init__(self, fail_on_step: int | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_on_step = fail_on_step

    def wandb(self) -> types.ModuleType:
        module = types.ModuleType("wandb")
        recorder = self

        class Run:
            def log(self, data: dict[str, Any], step: int | None = None) -> None:
                if step is not None and step == recorder.fail_on_step:
                    raise ConnectionError("refused")
                recorder.calls.append(("log", (step, data)))

            def finish(self) -> None:
                recorder.calls.append(("finish", None))

        def init(**kwargs: Any) -> Run:
            self.calls.append(("init", kwargs))
            return Run()

        module.init = init  # type: ignore[attr-defined]
        module.Image = lambda path: ("image", path)  # type: ignore[attr-defined]
        return module

    def mlflow(self) -> types.ModuleType:
        module = types.ModuleType("mlflow")
        for name in (
            "set_tracking_uri",
            "set_experiment",
            "start_run",
            "log_params",
            "log_text",
            "log_metrics",
            "log_artifact",
            "end_run",
        ):
            setattr(module, name, self._call(name))
        return module

    def _call(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            self.calls.append((name, (args, kwargs)))

        return call


def test_wandb_is_offline_by_default_and_gets_steps_config_and_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "wandb", recorder.wandb())
    records = run_log(tmp_path, ["wandb"])
    (name, init), *rest = recorder.calls
    assert name == "init" and init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert init["config"]["run"]["name"] == "tracked" and init["project"] == "tracked"
    steps = [data for call, data in rest if call == "log" and data[0] is not None]
    expected = [(r["step"], {k: v for k, v in flatten(r).items() if k != "step"}) for r in records]
    assert steps == expected
    assert ("log", (None, {"summary": ("image", str(tmp_path / "summary.png"))})) in rest
    assert rest[-1] == ("finish", None)


def test_mlflow_writes_to_a_file_store_under_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    recorder = Recorder()
    monkeypatch.setitem(sys.modules, "mlflow", recorder.mlflow())
    run_log(tmp_path, ["mlflow"])
    calls = dict(recorder.calls[:5])
    assert calls["set_tracking_uri"][0] == ((tmp_path / "mlruns").resolve().as_uri(),)
    assert calls["set_tracking_uri"][0][0].startswith("file:")
    assert calls["log_params"][0][0]["run.name"] == '"tracked"'
    assert calls["log_text"][0][1] == "config.yaml"
    metrics = [a for name, a in recorder.calls if name == "log_metrics"]
    assert metrics == [
        ((flatten({k: v for k, v in r.items() if k != "step"}),), {"step": r["step"]})
        for r in RECORDS
    ]
    assert ("log_artifact", ((str(tmp_path / "summary.png"),), {})) in recorder.calls
    assert recorder.calls[-1][0] == "end_run"
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true", (
        "MLflow 3 refuses a file store otherwise"
    )


def test_a_tracker_that_fails_mid_run_is_warned_about_once_and_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(fail_on_step=1)
    monkeypatch.setitem(sys.modules, "wandb", recorder.wandb())
    with pytest.warns(TrackerWarning, match="wandb failed to log a step: ConnectionError") as got:
        records = run_log(tmp_path, ["wandb"])
    assert len([w for w in got if issubclass(w.category, TrackerWarning)]) == 1
    assert len(records) == 2
    assert [c for c, _ in recorder.calls] == ["init", "finish"], "dropped, closed once"


def test_an_unknown_logger_is_refused_when_the_config_loads() -> None:
    with pytest.raises(cfg.ConfigError, match=r"run.loggers\[1\] must be one of"):
        cfg.load(None, ["run.loggers=[wandb,neptune]"])
