"""The critic's engine: a value model (a transformer backbone and a linear value head) with its
own AdamW optimiser, apart from the policy's.

The backbone is a copy of the policy's starting weights (``critic.path`` unset) or another model
directory that reads the same token ids (``critic.path``); the head is new and starts at zero, so
every value starts at 0. ``values(batch)[:, t]`` is the value of the state before token ``t``
(the head read at position ``t - 1``), aligned as log-probs are (position 0 gets 0).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config
from asyncflow.engines.base import ADAM_BETAS, TrainBatch

#: Maps the critic's per-token values ``[batch, length]`` and the batch to (loss, stats).
ValueLossFn = Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, float]]]


class CriticEngine(ABC):
    """Estimates per-token values and trains them; ``version`` counts its optimiser steps."""

    name: str = "critic"

    def __init__(self) -> None:
        self.version = 0

    @abstractmethod
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token values ``[batch, length]`` without gradients."""

    @abstractmethod
    def forward_backward(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """Accumulates the gradients of ``loss_fn`` on one micro-batch."""

    @abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Applies the accumulated gradients (clipped), clears them, bumps ``version``."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Writes the value model, the optimiser's state and ``version`` into ``directory``."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restores what :meth:`save` wrote."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Frees the engine's resources."""


class ValueModel(torch.nn.Module):
    """A transformer backbone and a linear head giving one value per position."""

    def __init__(self, backbone: Any, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        hidden = self.backbone(**batch.model_inputs()).last_hidden_state
        state_values = self.head(hidden.float()).squeeze(-1)
        # The value of the state before token t is read where token t - 1 is.
        return torch.nn.functional.pad(state_values[:, :-1], (1, 0))


def load_value_model(model_dir: Path) -> ValueModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)
    return ValueModel(backbone, int(backbone.config.hidden_size))


class HFCriticEngine(CriticEngine):
    """The value model trained with AdamW in this process."""

    name = "hf"

    def __init__(self, model_dir: Path, config: Config) -> None:
        super().__init__()
        c = config.critic
        self.model = load_value_model(Path(c.path) if c.path else model_dir).train()
        self.grad_clip = config.trainer.grad_clip
        self.lr = c.lr if c.lr is not None else config.trainer.lr
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.lr,
            betas=ADAM_BETAS,
            weight_decay=0.0,
        )

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        values: torch.Tensor = self.model(batch)
        return values

    def forward_backward(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        loss, stats = loss_fn(self.model(batch), batch)
        loss.backward()
        return stats

    def optimizer_step(self) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"critic_grad_norm": float(norm)}

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
        }
        torch.save(state, directory / "critic.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(directory / "critic.pt", weights_only=True, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # a resume may change critic.lr
            group["lr"] = self.lr
        self.version = int(state["version"])
