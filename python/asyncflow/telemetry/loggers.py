"""Experiment trackers (``run.loggers``): TensorBoard, Weights & Biases, MLflow, each optional.

Each gets what ``metrics.jsonl`` has, step by step (nested records flattened to ``a/b`` names,
numbers only), the run's config when it starts, and the summary figure when the run ends. Nothing
leaves the machine unless asked: wandb runs offline unless ``WANDB_MODE`` says otherwise, and
MLflow writes to a ``file:`` store under the run unless ``MLFLOW_TRACKING_URI`` names another.

A tracker that cannot start (its package missing, its service refusing) or that fails later is
warned about once (:class:`TrackerWarning`) and left out; the run goes on without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

#: The names ``run.loggers`` takes.
NAMES = ("tensorboard", "wandb", "mlflow")


class TrackerWarning(RuntimeWarning):
    """An experiment tracker could not start, or stopped working; the run goes on without it."""


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``record``, nested keys joined by ``/`` (booleans and text left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, name + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class Tracker:
    """One experiment tracker: started with the run's config, fed each step, closed at the end."""

    name = ""

    def step(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def figure(self, path: Path) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any], keep_until: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run redoes the steps after its checkpoint: their first events are purged.
        purge = None if keep_until is None else keep_until + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "```\n" + text + "```", 0)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def figure(self, path: Path) -> None:
        import matplotlib.image

        image = matplotlib.image.imread(str(path))
        self.writer.add_image("summary", image[..., :3], 0, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class Wandb(Tracker):
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], keep_until: int | None) -> None:
        import wandb  # type: ignore[import-not-found, unused-ignore]

        self.wandb = wandb
        self.run = wandb.init(
            project=str(config.get("run", {}).get("name", "asyncflow")),
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def figure(self, path: Path) -> None:
        self.run.log({"summary": self.wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


class MLflow(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict[str, Any], keep_until: int | None) -> None:
        import mlflow  # type: ignore[import-not-found, unused-ignore]

        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3.x refuses its file store (in maintenance) unless told it is wanted.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(str(config.get("run", {}).get("name", "asyncflow")))
        self.run = mlflow.start_run()
        # Parameters are short strings: the flattened config, each value as its JSON text.
        params = {k: json.dumps(v)[:250] for k, v in _leaves(config).items()}
        mlflow.log_params(params)
        mlflow.log_text(yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def figure(self, path: Path) -> None:
        self.mlflow.log_artifact(str(path))

    def close(self) -> None:
        self.mlflow.end_run()


def _leaves(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


#: Each kind, made with the run's directory, its config and (resumed) the last step kept: a
#: resumed run is a new wandb or MLflow run, holding the steps from there on.
KINDS: dict[str, Callable[[Path, dict[str, Any], int | None], Tracker]] = {
    "tensorboard": TensorBoard,
    "wandb": Wandb,
    "mlflow": MLflow,
}


class Trackers:
    """The run's trackers: each call goes to every one still working; one that fails is warned
    about once and dropped."""

    def __init__(
        self,
        names: Sequence[str],
        run_dir: Path,
        config: dict[str, Any],
        keep_until: int | None = None,
    ) -> None:
        unknown = [n for n in names if n not in KINDS]
        if unknown:
            raise ValueError(f"run.loggers: unknown {unknown}; known: {list(NAMES)}")
        self.active: list[Tracker] = []
        for name in dict.fromkeys(names):
            try:
                self.active.append(KINDS[name](run_dir, config, keep_until))
            except Exception as e:  # an optional package missing, a service refusing
                _warn(name, "could not start", e)

    def step(self, record: dict[str, Any]) -> None:
        scalars = {k: v for k, v in flatten(record).items() if k != "step"}
        step = int(record.get("step", 0))
        self._each(lambda t: t.step(step, scalars), "failed to log a step")

    def figure(self, path: Path) -> None:
        if path.exists():
            self._each(lambda t: t.figure(path), "failed to take the summary figure")

    def close(self) -> None:
        trackers, self.active = self.active, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as e:
                _warn(tracker.name, "failed to close", e)

    def _each(self, call: Callable[[Tracker], None], what: str) -> None:
        for tracker in list(self.active):
            try:
                call(tracker)
            except Exception as e:
                self.active.remove(tracker)
                _warn(tracker.name, what, e)
                # Dropped, so it is warned about once; what it had is closed if it can be.
                with contextlib.suppress(Exception):
                    tracker.close()


def _warn(name: str, what: str, error: BaseException) -> None:
    hint = " (pip install " + name + ")" if isinstance(error, ImportError) else ""
    warnings.warn(
        f"experiment tracker {name} {what}: {type(error).__name__}: {error}{hint}; "
        f"the run goes on without it",
        TrackerWarning,
        stacklevel=3,
    )
