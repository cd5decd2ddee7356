"""The pipeline modes compared on one workload, and how each one places the roles on devices and
processes.

- ``colocated-sync``: one pool of every device time-shares generation, reference and training;
  each step is generated, then scored, then trained (verl's default).
- ``separated-sync``: generation and training on their own devices, one step at a time; the
  trainer waits for the whole step.
- ``streaming``: as ``separated-sync``, but the trainer trains micro-batches as their samples
  arrive through the store (staleness 0: still on-policy).
- ``async-1`` / ``async-2``: streaming, with the trainer up to 1 or 2 policy versions ahead of
  the samples it trains on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncflow import config as cfg
from asyncflow.bench.costs import CostModel
from asyncflow.bench.emulation.engines import stored_tokens


@dataclass(frozen=True)
class Mode:
    name: str
    colocated: bool
    staleness: int
    streaming: bool
    #: ``rollout.partial``: ``off``, or weights loaded mid-generation (``continue``, ``abort``).
    partial: str = "off"

    @property
    def simulated_as(self) -> str:
        """The simulator's mode for this one: the same name (``asyncflow-sim`` runs the partial
        modes too)."""
        return self.name


MODES = {
    m.name: m
    for m in [
        Mode("colocated-sync", colocated=True, staleness=0, streaming=False),
        Mode("separated-sync", colocated=False, staleness=0, streaming=False),
        Mode("streaming", colocated=False, staleness=0, streaming=True),
        Mode("async-1", colocated=False, staleness=1, streaming=True),
        Mode("async-2", colocated=False, staleness=2, streaming=True),
    ]
}
BASELINE = "colocated-sync"
#: async-1 with weights loaded mid-generation: run by ``benches/partial_rollout.py`` beside
#: ``async-1``, not by the suite's default sweep.
PARTIAL_MODES = {
    m.name: m
    for m in [
        Mode("async-1+continue", colocated=False, staleness=1, streaming=True, partial="continue"),
        Mode("async-1+abort", colocated=False, staleness=1, streaming=True, partial="abort"),
    ]
}
ALL_MODES = {**MODES, **PARTIAL_MODES}


@dataclass(frozen=True)
class Placement:
    """Devices per pool: generation and training share one pool when colocated."""

    rollout_devices: int
    train_devices: int
    colocated: bool

    def devices(self, role: str) -> int:
        """Devices the role's busy fraction is measured against."""
        if role in ("rollout", "weight_load"):
            return self.rollout_devices
        return self.train_devices


def placement(mode: Mode, costs: CostModel) -> Placement:
    if mode.colocated:
        return Placement(costs.devices, costs.devices, colocated=True)
    rollout, train = costs.split()
    return Placement(rollout, train, colocated=False)


def rollout_calls(mode: Mode, costs: CostModel, rollout_devices: int) -> tuple[int, int]:
    """(workers per device, groups per call). The synchronous modes split each step evenly over
    the devices, one call each; the others keep several small calls in flight per device."""
    e = costs.emulation
    if mode.streaming:
        return e.calls_per_device, e.groups_per_call
    return 1, math.ceil(costs.workload.prompts_per_step / rollout_devices)


def job_config(mode: Mode, costs: CostModel, store_url: str, run_dir: Path) -> cfg.Config:
    """The main job's configuration for this mode, as the real workers read it."""
    w, e = costs.workload, costs.emulation
    max_tokens = stored_tokens(w.response_max_tokens, e.compression)
    config = cfg.Config()
    config.rollout.n = w.group_size
    config.rollout.max_tokens = max_tokens
    prompt = stored_tokens(w.prompt_tokens, e.compression)  # the emulated task's prompt width
    config.data.max_prompt_length = prompt
    longest = prompt + max_tokens
    config.model.max_positions = longest + 1  # no model is built; this only passes validation
    config.trainer.max_steps = e.warmup_steps + e.steps
    config.trainer.groups_per_step = w.prompts_per_step
    config.trainer.max_staleness = mode.staleness
    config.rollout.partial = mode.partial  # type: ignore[assignment]
    # One request-level worker per device keeps as many sequences in flight as the calls of the
    # other streaming modes do, and claims as many groups at once as fit.
    config.rollout.max_num_seqs = e.calls_per_device * e.groups_per_call * w.group_size
    config.trainer.streaming = mode.streaming
    config.trainer.micro_batch_tokens = e.micro_batch_groups * longest * w.group_size
    # One row per sample: the emulated trainer spreads a micro-batch's rows over its devices.
    config.trainer.packing = False
    config.algorithm.reference = True
    config.store.address = store_url
    config.run.output_dir = str(run_dir)
    config.run.stall_timeout = 900.0
    # Real-time constants shrink with modelled time: a claim waits for a full batch at most two
    # modelled seconds, and a waiting worker looks again as often.
    config.run.claim_wait = config.run.poll_interval = 2.0 / e.compression
    config.run.progress = False
    cfg.validate(config)
    return config


@dataclass(frozen=True)
class ProcessSpec:
    """What one worker process runs: its roles on its pool, for one mode."""

    name: str
    mode: str
    roles: tuple[str, ...]
    store_url: str
    costs: dict[str, Any]
    run_dir: str
    report: str

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> ProcessSpec:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "roles": tuple(raw["roles"])})


def processes(mode: Mode) -> dict[str, tuple[str, ...]]:
    """Process name -> the roles it runs. A device pool lives in one process; the feeder sits
    with the trainer, whose progress it follows."""
    cpu = ("reward", "advantage")
    if mode.colocated:
        return {"devices": ("rollout", "reference", "trainer", "feeder"), "cpu": cpu}
    return {"rollout": ("rollout",), "train": ("reference", "trainer", "feeder"), "cpu": cpu}
