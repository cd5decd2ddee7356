"""The ``deepspeed`` train engine: a transformers model under DeepSpeed ZeRO (stage 0 to 3), fp32
or bf16, on CPU (gloo) or GPU (NCCL).

Gradient accumulation is unmanaged: a step has as many token-budget micro-batches as its samples
need (the number varies from step to step), each ``forward_backward`` accumulates, and
``optimizer_step`` is the accumulation boundary, where gradients are reduced across data-parallel
ranks, clipped, and applied. Under ZeRO-2/3 every backward also talks to the other ranks, so all
ranks run the same number of micro-batches (the trainer pads with empty ones).

The optimiser is ``torch.optim.AdamW`` and the schedule a ``LambdaLR`` (the hf engine's), so
nothing needs compiling and both engines follow the same recipe. With ``model.lora`` the model
carries LoRA adapters before DeepSpeed wraps it, only they are optimised, and the exported
weights have them merged in.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncflow.algorithms.lr_schedule import lr_factor, reapply
from asyncflow.config import Config
from asyncflow.engines import lora
from asyncflow.engines.base import ADAM_BETAS, LossFn, TrainBatch, TrainEngine, token_logprobs
from asyncflow.engines.errors import EngineStartError
from asyncflow.engines.hf import copy_tokenizer, load_model, save_merged
from asyncflow.engines.process_group import Rendezvous, init_process_group, prepare_environment

#: Checkpoint tag inside a save directory.
TAG = "trainer"


def deepspeed_config(config: Config, world_size: int) -> dict[str, Any]:
    t = config.trainer
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage == 3:
        # The default keeps every parameter under 1e5 elements whole on every rank (all of a
        # small model's); 0 shards them all.
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": config.model.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _keep_clipped_norm(engine: Any) -> None:
    """ZeRO-0 in fp32 clips with a plain optimiser and drops the norm it computed, so
    ``get_global_grad_norm()`` would stay ``None``; keep it where that call reads it."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip() -> None:
        engine._global_grad_norm = clip_grad_norm_(
            parameters=engine.module.parameters(),
            max_norm=engine.gradient_clipping(),
            mpu=engine.mpu,
        )

    engine.clip_fp32_gradients = clip


class DeepSpeedTrainEngine(TrainEngine):
    """One data-parallel rank. Every method that touches parameters is collective under ZeRO-3:
    all ranks call it, in the same order."""

    name = "deepspeed"

    def __init__(
        self, model_dir: Path, config: Config, rendezvous: Rendezvous | None = None
    ) -> None:
        super().__init__()
        prepare_environment()
        try:
            import deepspeed
        except ImportError as e:
            raise EngineStartError(
                f"deepspeed train engine: DeepSpeed is not installed ({e}); install the "
                "engines-cpu or engines-gpu dependency group, or set trainer.engine=hf"
            ) from e
        self.model_dir = model_dir
        self.temperature = config.rollout.temperature
        self.lora = config.model.lora
        self.settings = config.trainer
        rank = 0 if rendezvous is None else rendezvous.rank
        try:
            init_process_group(rendezvous, config.trainer.timeout)
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            model = lora.wrap(load_model(model_dir, "float32"), self.lora, config.run.seed)
            optimizer = torch.optim.AdamW(
                lora.trainable(model),
                lr=config.trainer.lr,
                betas=ADAM_BETAS,
                weight_decay=config.trainer.weight_decay,
            )
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(config.trainer))
            self.engine, _, _, _ = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=schedule,
                config=deepspeed_config(config, self.world_size),
            )
        except Exception as e:
            raise EngineStartError(
                f"deepspeed train engine (rank {rank}) failed to start on {model_dir}: "
                f"{type(e).__name__}: {e}"
            ) from e
        self.zero_stage = config.trainer.zero_stage
        if self.zero_stage == 0 and config.model.dtype != "bfloat16":
            _keep_clipped_norm(self.engine)

    @property
    def model_config(self) -> Any:
        return getattr(self.engine.module, "config", None)

    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        out = self.engine(**batch.model_inputs())
        return token_logprobs(out.logits, batch, self.temperature)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.engine.eval()  # no adapter dropout: the policy's own log-probs
        try:
            return self._logprobs(batch.on(self.engine.device)).float().cpu()
        finally:
            self.engine.train()

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        batch = batch.on(self.engine.device)
        loss, stats = loss_fn(self._logprobs(batch), batch)
        # ``loss`` is this rank's share of the step's loss; DeepSpeed averages gradients over
        # the ranks, so the shares are scaled back up to make the average their sum.
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
        return stats

    def optimizer_step(self) -> dict[str, float]:
        lr = float(self.engine.get_lr()[0])  # the rate this step applies
        self.engine.step()
        self.version += 1
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "lr": lr}

    def _full_weights(self) -> list[tuple[str, torch.Tensor]]:
        params = list(self.engine.module.named_parameters())
        if self.zero_stage != 3:
            return [(n, p.detach()) for n, p in params]
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            return [(n, p.detach().clone()) for n, p in params]

    @torch.no_grad()
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights (gathered from every rank under ZeRO-3: a collective call), with any
        LoRA adapters merged in."""
        return iter(lora.merged(self._full_weights(), self.lora))

    def save(self, directory: Path) -> None:
        """Every rank writes its optimiser shard (a collective call)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(
            str(directory), tag=TAG, client_state={"version": self.version}, save_latest=False
        )

    def load(self, directory: Path) -> None:
        _, client = self.engine.load_checkpoint(str(directory), tag=TAG)
        if client is None:
            raise FileNotFoundError(f"no deepspeed checkpoint in {directory}")
        reapply(self.engine.lr_scheduler, self.settings)
        self.version = int(client["version"])

    @torch.no_grad()
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
            self.engine.module.save_pretrained(
                str(directory), state_dict=weights, safe_serialization=True
            )
            copy_tokenizer(self.model_dir, directory)

    def close(self) -> None:
        self.__dict__.pop("engine", None)
