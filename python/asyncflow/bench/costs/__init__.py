"""The cost model behind the ``pipeline`` and ``sim`` suites: what each RL role's work costs on
one emulated device (decode steps, prefill, training and reference tokens per second, weight
publication), the workload (prompts per step, long-tailed response lengths), and the derived
quantities both suites report against, such as the ideal throughput of a placement.

Parameters come from a YAML file; ``paper-7b.yaml`` beside this module is the default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

DEFAULT = Path(__file__).with_name("paper-7b.yaml")


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    response_median_tokens: float
    response_sigma: float
    response_max_tokens: int
    seed: int

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def mean_response_tokens(self) -> float:
        """Mean of the lognormal cut at ``response_max_tokens``."""
        mu, sigma, cap = (
            math.log(self.response_median_tokens),
            self.response_sigma,
            float(self.response_max_tokens),
        )
        z = (math.log(cap) - mu) / sigma
        below = math.exp(mu + sigma**2 / 2) * _normal_cdf(z - sigma)
        return below + cap * (1 - _normal_cdf(z))


def _normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@dataclass(frozen=True)
class Rollout:
    max_batch: int
    decode_step_s: float
    decode_per_sequence_s: float
    prefill_tokens_per_s: float
    weight_load_s: float

    def decode_step(self, batch: int) -> float:
        """Seconds of one decode step with ``batch`` sequences in flight."""
        return self.decode_step_s + self.decode_per_sequence_s * batch


@dataclass(frozen=True)
class Reference:
    tokens_per_s: float


@dataclass(frozen=True)
class Trainer:
    tokens_per_s: float
    optimizer_step_s: float


@dataclass(frozen=True)
class Network:
    weights_gib: float
    bandwidth_gib_s: float
    hop_latency_s: float

    def transfer_s(self) -> float:
        return self.weights_gib / self.bandwidth_gib_s

    def publish_s(self, receivers: int) -> float:
        """Gathering the trained weights, then a pipelined tree broadcast to ``receivers``."""
        return 2 * self.transfer_s() + math.ceil(math.log2(receivers + 1)) * self.hop_latency_s

    def all_reduce_s(self, ranks: int) -> float:
        """A ring all-reduce of the gradients over ``ranks`` data-parallel ranks."""
        if ranks <= 1:
            return 0.0
        return (
            2 * (ranks - 1) / ranks * self.transfer_s()
            + 2 * math.ceil(math.log2(ranks)) * self.hop_latency_s
        )


@dataclass(frozen=True)
class Reward:
    workers: int
    per_sample_s: float


@dataclass(frozen=True)
class Colocated:
    to_train_s: float
    to_generate_s: float


@dataclass(frozen=True)
class Emulation:
    compression: float
    warmup_steps: int
    steps: int
    calls_per_device: int
    groups_per_call: int
    micro_batch_groups: int
    weights_mib: int


@dataclass(frozen=True)
class CostModel:
    devices: int
    rollout_devices: int | None
    workload: Workload
    rollout: Rollout
    reference: Reference
    trainer: Trainer
    network: Network
    reward: Reward
    colocated: Colocated
    emulation: Emulation

    # -- per-sample work, in device-seconds ------------------------------------------------------

    def generate_s(self) -> float:
        """Device-seconds to generate one response with the device's batch full."""
        r, w = self.rollout, self.workload
        per_token = r.decode_step(r.max_batch) / r.max_batch
        return w.mean_response_tokens() * per_token + w.prompt_tokens / r.prefill_tokens_per_s

    def sample_tokens(self) -> float:
        return self.workload.prompt_tokens + self.workload.mean_response_tokens()

    def train_s(self) -> float:
        """Device-seconds to train on one sample and compute its reference log-probs."""
        tokens = self.sample_tokens()
        return tokens / self.trainer.tokens_per_s + tokens / self.reference.tokens_per_s

    # -- placement and bounds ----------------------------------------------------------------

    def split(self) -> tuple[int, int]:
        """(rollout devices, training devices) of the separated modes."""
        if self.rollout_devices is not None:
            return self.rollout_devices, self.devices - self.rollout_devices
        best = max(range(1, self.devices), key=self.separated_bound)
        return best, self.devices - best

    def separated_bound(self, rollout_devices: int) -> float:
        """Samples/s if the slower side of a separated placement were always busy."""
        train_devices = self.devices - rollout_devices
        return min(rollout_devices / self.generate_s(), train_devices / self.train_s())

    def colocated_bound(self) -> float:
        """Samples/s if one pool did nothing but generate and train, one after the other."""
        return self.devices / (self.generate_s() + self.train_s())

    def scaled(self, devices: int) -> CostModel:
        """The same model on ``devices`` accelerators, with prompts per step, the trainer's
        micro-batch, the reward workers and an explicit rollout split grown alike (weak
        scaling)."""

        def grow(x: int) -> int:
            return max(1, round(x * devices / self.devices))

        return replace(
            self,
            devices=devices,
            rollout_devices=None if self.rollout_devices is None else grow(self.rollout_devices),
            workload=replace(self.workload, prompts_per_step=grow(self.workload.prompts_per_step)),
            reward=replace(self.reward, workers=grow(self.reward.workers)),
            emulation=replace(
                self.emulation, micro_batch_groups=grow(self.emulation.micro_batch_groups)
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def params(self) -> dict[str, float]:
        """Every parameter as ``section.key`` -> number, as the simulator reads them."""
        flat: dict[str, float] = {"devices": float(self.devices)}
        if self.rollout_devices is not None:
            flat["rollout_devices"] = float(self.rollout_devices)
        for name, section in asdict(self).items():
            if isinstance(section, dict):
                flat.update({f"{name}.{key}": float(value) for key, value in section.items()})
        return flat


def _section(cls: type, raw: dict[str, Any], name: str) -> Any:
    known = {f.name for f in fields(cls)}
    missing = known - set(raw)
    unknown = set(raw) - known
    if missing or unknown:
        raise ValueError(
            f"cost model section {name!r}: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    return cls(**raw)


def from_dict(raw: dict[str, Any]) -> CostModel:
    sections = {
        "workload": Workload,
        "rollout": Rollout,
        "reference": Reference,
        "trainer": Trainer,
        "network": Network,
        "reward": Reward,
        "colocated": Colocated,
        "emulation": Emulation,
    }
    values: dict[str, Any] = {
        name: _section(cls, raw.get(name) or {}, name) for name, cls in sections.items()
    }
    extra = set(raw) - set(sections) - {"devices", "rollout_devices"}
    if extra:
        raise ValueError(f"cost model: unknown keys {sorted(extra)}")
    return CostModel(
        devices=int(raw["devices"]), rollout_devices=raw.get("rollout_devices"), **values
    )


def load(path: str | Path | None = None) -> CostModel:
    """The cost model in ``path`` (default: ``paper-7b.yaml``)."""
    return from_dict(yaml.safe_load(Path(path or DEFAULT).read_text()))
