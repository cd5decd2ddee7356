"""LoRA on the train engines (``model.lora``): the model is wrapped with peft's adapters before
the engine shards or optimises it, only the adapters are trainable, and what each version
publishes is the base weights with the adapters merged in (``W + B·A·alpha/rank``) under the
model's own parameter names, so every rollout engine loads it in place as it loads full weights.

The merge works on named tensors, gathered or not, so the hf, DeepSpeed and FSDP engines share
it: each hands over its full parameters by peft's names and gets the model's names back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from asyncflow.config import LoraConfig
from asyncflow.errors import ConfigError

#: peft's name of the one adapter the engines train.
ADAPTER = "default"
#: What peft puts before the wrapped model's own parameter names.
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"
LORA_A = f".lora_A.{ADAPTER}.weight"
LORA_B = f".lora_B.{ADAPTER}.weight"


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last part of the name of each linear module (``q_proj``, ``down_proj``, ...)."""
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if name and isinstance(module, torch.nn.Linear)
    }


def check_targets(model: torch.nn.Module, lora: LoraConfig) -> None:
    """Refuses target modules the model has no linear module of, naming those it has."""
    linear = linear_module_names(model)
    missing = [name for name in lora.target_modules if name not in linear]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules names {missing}, which the model "
            f"({type(model).__name__}) has no linear module of; it has {sorted(linear)}"
        )


def wrap(model: Any, lora: LoraConfig | None, seed: int = 0) -> Any:
    """``model`` with LoRA adapters on ``lora.target_modules`` (only they are trainable), or
    ``model`` itself without ``lora``. The adapters' random start depends on ``seed`` alone, so
    that every data-parallel rank (each sharding its own copy) starts from the same one."""
    if lora is None:
        return model
    check_targets(model, lora)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # typed int, used as a float
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config, adapter_name=ADAPTER)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimiser steps: all, or with LoRA only the adapters'."""
    return [p for p in model.parameters() if p.requires_grad]


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged(
    named: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig | None
) -> list[tuple[str, torch.Tensor]]:
    """The full weights by the model's own names: with ``lora``, each adapted linear weight is
    ``W + B·A·alpha/rank`` (computed in fp32, given back in W's dtype) and the adapters
    themselves are left out; without, ``named`` as it is."""
    if lora is None:
        return list(named)
    tensors = dict(named)
    scale = lora.alpha / lora.rank
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors.items():
        if is_adapter(name):
            continue
        value = tensor
        if name.endswith(BASE_LAYER + ".weight"):
            module = name.removesuffix(BASE_LAYER + ".weight")
            a, b = tensors.get(module + LORA_A), tensors.get(module + LORA_B)
            if a is not None and b is not None:
                delta = (b.float() @ a.float()) * scale
                value = (tensor.float() + delta).to(tensor.dtype)
        out.append((name.removeprefix(PEFT_PREFIX).replace(BASE_LAYER + ".", "."), value))
    return out


def adapters(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter tensors by the names peft's own adapter files use (no adapter name)."""
    return {
        name.replace(f".{ADAPTER}.", "."): tensor.detach().cpu().contiguous()
        for name, tensor in named
        if is_adapter(name)
    }


def save_adapter(
    named: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig, base: Path, directory: Path
) -> None:
    """Writes the adapters as a peft adapter directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) that peft, or vLLM's LoRA support, can load over ``base``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(adapters(named), str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
