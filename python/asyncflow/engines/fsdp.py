"""The ``fsdp`` train engine: a transformers model under PyTorch FSDP2
(``torch.distributed.fsdp.fully_shard``), on CPU (gloo) or GPU (NCCL).

Each decoder layer is its own FSDP unit, and the root (embeddings, final norm, head) one more:
parameters are sharded over the data-parallel ranks and gathered a layer at a time for forward
and backward, gradients reduce-scattered back to their shards. ``model.dtype: bfloat16`` computes
in bf16 (``MixedPrecisionPolicy``) with fp32 master weights and fp32 gradient reduction.

As the DeepSpeed engine: gradient accumulation is unmanaged (a step has as many token-budget
micro-batches as its samples need, each ``forward_backward`` accumulates, ``optimizer_step`` is
the boundary, where gradients are clipped and applied), every rank runs the same number of
micro-batches (the trainer pads with empty ones) since each forward and backward is collective,
and the optimiser is ``torch.optim.AdamW`` under the hf engine's ``LambdaLR`` schedule.

With ``model.lora`` the model carries LoRA adapters before it is sharded (FSDP2 shards frozen
and trainable parameters alike, per parameter), only they are optimised, and the exported
weights have them merged in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from asyncflow.algorithms.lr_schedule import lr_factor, reapply
from asyncflow.config import Config
from asyncflow.engines import lora
from asyncflow.engines.base import ADAM_BETAS, LossFn, TrainBatch, TrainEngine, token_logprobs
from asyncflow.engines.errors import EngineStartError
from asyncflow.engines.hf import copy_tokenizer, load_model, save_merged
from asyncflow.engines.process_group import Rendezvous, group_of_one, join_group, on_gpu


def init_process_group(rendezvous: Rendezvous | None, timeout: float) -> None:
    """Joins (or, alone, creates) the default process group, as the DeepSpeed engine's does but
    without DeepSpeed: rank 0 serves the rendezvous on its address alone, and ranks meeting on
    loopback keep their collectives' sockets there. Without ``rendezvous`` an existing group is
    reused, else a group of one is made on a free loopback port."""
    if rendezvous is None:
        if dist.is_initialized():
            return
        rendezvous = group_of_one()
    join_group(rendezvous, timeout)
    if on_gpu():
        torch.cuda.set_device(rendezvous.rank % max(1, torch.cuda.device_count()))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules transformers keeps whole when it splits a model
    (``_no_split_modules``), else those whose class name ends in ``DecoderLayer``."""
    whole = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in whole]
    return layers or [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole (gathered from every rank: a collective call)."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


class FSDPTrainEngine(TrainEngine):
    """One data-parallel rank. Forward, backward, the optimiser step and exporting weights are
    collective: all ranks call them, in the same order."""

    name = "fsdp"

    def __init__(
        self, model_dir: Path, config: Config, rendezvous: Rendezvous | None = None
    ) -> None:
        super().__init__()
        self.model_dir = model_dir
        self.temperature = config.rollout.temperature
        self.grad_clip = config.trainer.grad_clip
        self.settings = config.trainer
        self.lora = config.model.lora
        rank = 0 if rendezvous is None else rendezvous.rank
        try:
            init_process_group(rendezvous, config.trainer.timeout)
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if on_gpu() else "cpu")
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            bf16 = config.model.dtype == "bfloat16"
            policy = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
            )
            model = lora.wrap(load_model(model_dir, "float32"), self.lora, config.run.seed).to(
                self.device
            )
            layers = decoder_layers(model)
            if not layers:
                raise ValueError(f"found no decoder layers in {type(model).__name__}")
            for layer in layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            self.model: Any = model.train()
            self.optimizer = torch.optim.AdamW(
                lora.trainable(self.model),
                lr=config.trainer.lr,
                betas=ADAM_BETAS,
                weight_decay=config.trainer.weight_decay,
            )
            self.schedule = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lr_factor(config.trainer)
            )
        except Exception as e:
            raise EngineStartError(
                f"fsdp train engine (rank {rank}) failed to start on {model_dir}: "
                f"{type(e).__name__}: {e}"
            ) from e

    @property
    def model_config(self) -> Any:
        return getattr(self.model, "config", None)

    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        logits = self.model(**batch.model_inputs()).logits
        return token_logprobs(logits, batch, self.temperature)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()  # no adapter dropout: the policy's own log-probs
        try:
            return self._logprobs(batch).float().cpu()
        finally:
            self.model.train()

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        loss, stats = loss_fn(self._logprobs(batch), batch)
        # ``loss`` is this rank's share of the step's loss; FSDP averages gradients over the
        # ranks, so the shares are scaled back up to make the average their sum.
        (loss * self.world_size).backward()
        return stats

    def optimizer_step(self) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": float(_full(norm)), "lr": lr}

    @torch.no_grad()
    def _full_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, _full(p.detach()).cpu()) for n, p in self.model.named_parameters()]

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights, gathered from every rank (a collective call), with any LoRA adapters
        merged in."""
        return iter(lora.merged(self._full_weights(), self.lora))

    def _state(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def save(self, directory: Path) -> None:
        """Every rank writes its shards of model and optimiser (a collective call)."""
        directory.mkdir(parents=True, exist_ok=True)
        state_dict_saver.save(self._state(), checkpoint_id=str(directory / "fsdp"))
        if self.rank == 0:
            extra = {"schedule": self.schedule.state_dict(), "version": self.version}
            torch.save(extra, directory / "fsdp-trainer.pt")
        dist.barrier()

    def load(self, directory: Path) -> None:
        if not (directory / "fsdp-trainer.pt").exists():
            raise FileNotFoundError(f"no fsdp checkpoint in {directory}")
        state = self._state()
        state_dict_loader.load(state, checkpoint_id=str(directory / "fsdp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        extra = torch.load(directory / "fsdp-trainer.pt", weights_only=True)
        self.schedule.load_state_dict(extra["schedule"])
        reapply(self.schedule, self.settings)
        self.version = int(extra["version"])

    def save_pretrained(self, directory: Path) -> None:
        """Rank 0 writes the full model (gathered from every rank: a collective call)."""
        if self.lora is not None:
            named = self._full_weights()
            if self.rank == 0:
                save_merged(self.model_dir, lora.merged(named, self.lora), directory)
                lora.save_adapter(named, self.lora, self.model_dir, directory / "adapter")
            return
        weights = dict(self._full_weights())
        if self.rank == 0:
            model = load_model(self.model_dir, "float32")
            model.load_state_dict(weights, strict=False)
            model.save_pretrained(str(directory), safe_serialization=True)
            copy_tokenizer(self.model_dir, directory)

    def close(self) -> None:
        self.__dict__.pop("model", None)
        self.__dict__.pop("optimizer", None)
