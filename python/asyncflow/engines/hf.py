"""The ``hf`` engine pair: plain transformers + torch. It is the reference implementation of both
interfaces and the worked example of a custom engine: a new engine implements the same few
methods and registers a factory under a name (see :mod:`asyncflow.engines.registry`).

Each engine's model and tensors live on its device (``rollout.device``, ``trainer.device``: the
CPU by default, or a CUDA GPU); what the engines hand back (completions, log-probs) is on the
CPU, as the workers read it.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncflow.algorithms.lr_schedule import lr_factor, reapply
from asyncflow.config import Config, check_device
from asyncflow.engines import lora
from asyncflow.engines.base import (
    ADAM_BETAS,
    Completion,
    LossFn,
    Request,
    RolloutEngine,
    Sampling,
    TrainBatch,
    TrainEngine,
    token_logprobs,
)
from asyncflow.engines.errors import WeightLoadError
from asyncflow.engines.hf_decode import DecodeLoop, model_device
from asyncflow.models.tokenizer import Tokenizer, load_tokenizer

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def _dtype(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def load_model(model_dir: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_dtype(dtype))


def engine_device(key: str, device: str) -> torch.device:
    """The device an option (``key``: ``rollout.device`` or ``trainer.device``) names, checked
    on this machine: a CUDA device it lacks is a :class:`ConfigError` naming the option."""
    check_device(key, device)
    return torch.device(device)


def save_merged(
    model_dir: Path, weights: Iterable[tuple[str, torch.Tensor]], directory: Path
) -> None:
    """Writes ``weights`` (the model's names, all of them) as a Hugging Face model directory
    beside ``model_dir``'s config and tokenizer."""
    model = load_model(model_dir, "float32")
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise ValueError(f"weights do not fit the model: missing {missing}, extra {unexpected}")
    model.save_pretrained(str(directory), safe_serialization=True)
    copy_tokenizer(model_dir, directory)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copies the tokenizer files that sit beside a model's weights."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


@torch.no_grad()
def sample(
    model: Any, prompts: list[list[int]], sampling: Sampling, tokenizer: Tokenizer
) -> list[list[Completion]]:
    """Batched decoding with a KV cache: prompts left-padded, ``sampling.n`` rows per prompt.
    Every tensor is built on the model's device; the completions come back as Python lists."""
    device = model_device(model)
    rows = [p for p in prompts for _ in range(sampling.n)]
    width = max(len(p) for p in rows)
    pad, stops = tokenizer.pad_id, tokenizer.stop_ids
    stop_tensor = torch.tensor(sorted(stops), device=device)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=device)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)

    out_ids = torch.full((len(rows), sampling.max_tokens), pad, device=device)
    out_lp = torch.zeros((len(rows), sampling.max_tokens), device=device)
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)
    lengths = torch.full((len(rows),), sampling.max_tokens, device=device)
    cache = None
    step_ids = input_ids
    for t in range(sampling.max_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        result = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        cache = result.past_key_values
        logits = result.logits[:, -1].float()
        if sampling.greedy:
            token = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1)
        else:
            logp = torch.log_softmax(logits / sampling.temperature, -1)
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        token = torch.where(done, torch.full_like(token, pad), token)
        out_ids[:, t] = token
        out_lp[:, t] = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        finished_now = ~done & torch.isin(token, stop_tensor)
        lengths = torch.where(finished_now, torch.full_like(lengths, t + 1), lengths)
        done |= finished_now
        if bool(done.all()):
            break
        step_ids = token.unsqueeze(-1)
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)

    # One copy to the host for the whole batch, not one per row.
    all_ids, all_lp, all_lengths = out_ids.tolist(), out_lp.tolist(), lengths.tolist()
    completions = []
    for i in range(len(rows)):
        ids = all_ids[i][: int(all_lengths[i])]
        text = tokenizer.decode(ids)
        reason = "stop" if ids and ids[-1] in stops else "length"
        for s in sampling.stop:
            if s in text:
                text, reason = text[: text.index(s)], "stop"
        completions.append(Completion(ids, all_lp[i][: len(ids)], text, reason))
    return [completions[k * sampling.n : (k + 1) * sampling.n] for k in range(len(prompts))]


def finish_text(
    token_ids: list[int], stop: tuple[str, ...], tokenizer: Tokenizer
) -> tuple[str, bool]:
    """The text of ``token_ids``, cut at the first stop string; and whether one was found."""
    text = tokenizer.decode(token_ids)
    for s in stop:
        if s in text:
            return text[: text.index(s)], True
    return text, False


class HFRolloutEngine(RolloutEngine):
    """Generation with a transformers model and a KV cache: whole calls (:meth:`generate`), or
    request by request, step by step (:meth:`add_request`, :meth:`step`)."""

    name = "hf"
    supports_requests = True

    def __init__(self, model_dir: Path, config: Config) -> None:
        super().__init__()
        self.device = engine_device("rollout.device", config.rollout.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, config.model.dtype).to(self.device).eval()
        self.loop = DecodeLoop(self.model, self.tokenizer.stop_ids, config.rollout.max_num_seqs)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        return sample(self.model, prompts, sampling, self.tokenizer)

    def add_request(self, request: Request) -> None:
        self.loop.add(request)

    def step(self) -> list[Request]:
        return self.loop.step(self.version)

    def abort_requests(self, keys: Collection[Any] | None = None) -> list[Request]:
        return self.loop.abort(keys)

    def in_flight(self) -> int:
        return len(self.loop)

    def finish_text(self, request: Request) -> Completion:
        text, stopped = finish_text(request.token_ids, request.sampling.stop, self.tokenizer)
        completion = request.completion(text)
        if stopped:
            completion.finish_reason = "stop"
        return completion

    @torch.no_grad()
    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checks every tensor before copying any: a set that lacks a parameter or has one of
        another shape raises :class:`WeightLoadError` and leaves the weights as they were. The
        tensors may live anywhere (the store's host memory, the trainer's GPU): each is copied
        into the engine's own parameter, in place, on the engine's device and in its dtype."""
        params = dict(self.model.named_parameters())
        incoming = {name: tensor for name, tensor in weights if name in params}
        missing = sorted(set(params) - set(incoming))
        if missing:
            raise WeightLoadError(
                f"hf rollout engine: weights v{version} lack {len(missing)} tensors "
                f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); "
                f"still on v{self.version}"
            )
        for name, tensor in incoming.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise WeightLoadError(
                    f"hf rollout engine: weights v{version} give {name} the shape "
                    f"{tuple(tensor.shape)}, the model has {tuple(params[name].shape)}; "
                    f"still on v{self.version}"
                )
        for name, tensor in incoming.items():
            params[name].copy_(tensor)
        self.version = version


class HFTrainEngine(TrainEngine):
    """AdamW on a transformers model, one process, on ``trainer.device``. With ``model.lora``
    the model carries LoRA adapters, only they are optimised, and the exported weights have them
    merged in."""

    name = "hf"

    def __init__(self, model_dir: Path, config: Config) -> None:
        super().__init__()
        self.device = engine_device("trainer.device", config.trainer.device)
        self.model_dir = model_dir
        self.temperature = config.rollout.temperature
        self.grad_clip = config.trainer.grad_clip
        self.settings = config.trainer
        self.lora = config.model.lora
        self.model = (
            lora.wrap(load_model(model_dir, config.model.dtype), self.lora, config.run.seed)
            .to(self.device)
            .train()
        )
        self.optimizer = torch.optim.AdamW(
            lora.trainable(self.model),
            lr=config.trainer.lr,
            betas=ADAM_BETAS,
            weight_decay=config.trainer.weight_decay,
        )
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config.trainer))

    @property
    def model_config(self) -> Any:
        return getattr(self.model, "config", None)

    def _logprobs(self, batch: TrainBatch) -> torch.Tensor:
        logits = self.model(**batch.model_inputs()).logits
        return token_logprobs(logits, batch, self.temperature)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token log-probs ``[batch, length]``, on the CPU wherever the model is."""
        self.model.eval()  # no adapter dropout: the policy's own log-probs
        try:
            return self._logprobs(batch.on(self.device)).cpu()
        finally:
            self.model.train()

    def forward_backward(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        batch = batch.on(self.device)
        loss, stats = loss_fn(self._logprobs(batch), batch)
        loss.backward()
        return stats

    def optimizer_step(self) -> dict[str, float]:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": float(norm), "lr": lr}

    @torch.no_grad()
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights on the engine's device, as DeepSpeed's and FSDP's are on theirs: the
        store's publication copies them to the host, a rollout engine copies them in place."""
        named = ((name, param.detach()) for name, param in self.model.named_parameters())
        return iter(lora.merged(named, self.lora))

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "version": self.version,
        }
        torch.save(state, directory / "trainer.pt")

    def load(self, directory: Path) -> None:
        # Read on the host whichever device wrote it: loading copies the weights onto this
        # engine's device, and the optimiser puts its state beside them (its step counts stay
        # on the host, as torch keeps them).
        state = torch.load(directory / "trainer.pt", weights_only=True, map_location="cpu")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "schedule" in state:  # checkpoints written before schedules existed have none
            self.schedule.load_state_dict(state["schedule"])
        reapply(self.schedule, self.settings)
        self.version = int(state["version"])

    def save_pretrained(self, directory: Path) -> None:
        if self.lora is None:
            self.model.save_pretrained(str(directory), safe_serialization=True)
            copy_tokenizer(self.model_dir, directory)
            return
        named = [(n, p.detach()) for n, p in self.model.named_parameters()]
        save_merged(self.model_dir, lora.merged(named, self.lora), directory)
        lora.save_adapter(named, self.lora, self.model_dir, directory / "adapter")
