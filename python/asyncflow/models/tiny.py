"""The built-in model: a tiny Qwen2-architecture causal LM created locally, saved as a Hugging
Face directory (config, safetensors weights, and its ChatML tokenizer) that every engine loads
offline, as it loads any other model's."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from asyncflow.config import ModelConfig
from asyncflow.models.chatml import chatml_tokenizer, save_chatml_tokenizer


def create_tiny_model(config: ModelConfig, directory: Path, seed: int) -> Path:
    """Creates and saves the model; returns its directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = chatml_tokenizer()
    hf_config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_id,
        eos_token_id=tok.eos_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(hf_config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    save_chatml_tokenizer(directory)
    return directory


def parameter_count(directory: Path) -> int:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
