"""The ``vllm`` rollout engine: vLLM running inside this process (its CPU build on CPU machines,
its CUDA build on GPU machines).

In-process, with no engine-core subprocess, so that new weights pass from the store's zero-copy
views straight into the engine through the worker's ``reload_weights`` (the multiprocess engine
would have to pickle them or write them to a file). vLLM copies them once, into its own
parameters, which it must own; nothing else is copied.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.engines.errors import EngineError, EngineStartError
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.units import parse_size


def prepare_environment() -> None:
    """vLLM reads these when it is imported, so this runs before that."""
    # In-process engine core: weights reload from tensors, no pickling, one process to watch.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")


#: vLLM keeps the current forward pass's context in a module global, so two engines of one
#: process must not run the model at the same time (each still has its own weights and cache).
MODEL_LOCK = threading.Lock()

#: A tied output embedding: trainers export only the input embedding, but vLLM's reload
#: rebuilds its output head from a tensor of this name, and keeps the old one without it.
TIED = ("model.embed_tokens.weight", "lm_head.weight")


def _quiet_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """Every reload warns that the rotary embedding got no weights: it has none (its cos/sin
    table is computed, and kept), so the warning is noise."""
    return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def checkpoint_names(model_dir: Path) -> set[str]:
    """The parameter names a full reload must cover: those of the model's own checkpoint, less
    a tied output embedding (it is the input embedding)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    if is_tied(model_dir):
        names.discard(TIED[1])
    return names


def is_tied(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


class VLLMRolloutEngine(RolloutEngine):
    """Generation with vLLM; weights swap in place, the engine is never restarted."""

    name = "vllm"

    def __init__(self, model_dir: Path, config: Config, label: str = "rollout") -> None:
        super().__init__()
        prepare_environment()
        self.label = label
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineStartError(
                f"vllm rollout engine {label!r}: vLLM is not installed ({e}); install the "
                "engines-cpu or engines-gpu dependency group, or set rollout.engine=hf"
            ) from e
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _quiet_rotary_reload_warning
        )
        r = config.rollout
        try:
            from vllm.platforms import current_platform

            self.tokenizer = load_tokenizer(model_dir)
            self.expected_names = checkpoint_names(model_dir)
            self.tied = is_tied(model_dir)
            self.llm = LLM(
                model=str(model_dir),
                tokenizer=str(model_dir),
                dtype=config.model.dtype,
                max_model_len=r.max_model_len,
                kv_cache_memory_bytes=parse_size(r.kv_cache_memory),
                gpu_memory_utilization=r.gpu_memory_utilization,
                enforce_eager=True,
                seed=config.run.seed,
                # Log-probs of the distribution the tokens were drawn from (temperature applied),
                # which is what the trainer computes.
                logprobs_mode="processed_logprobs",
                disable_log_stats=True,
                # vLLM's CPU runner cannot rewind a seeded request's generator when a long
                # prompt's prefill is split over steps: there, prompts are prefilled whole.
                enable_chunked_prefill=not current_platform.is_cpu(),
            )
        except Exception as e:
            raise EngineStartError(
                f"vllm rollout engine {label!r} failed to start on {model_dir}: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _params(self, sampling: Sampling) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=1 if sampling.greedy else sampling.n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            # Stop strings need vLLM to detokenize; otherwise our tokenizer decodes, faster.
            detokenize=bool(sampling.stop),
            seed=sampling.seed,
            logprobs=0,
            flat_logprobs=True,
        )

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        # Greedy decoding takes one sample per request, so its n copies are n requests.
        copies = sampling.n if sampling.greedy else 1
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(copies)]
        try:
            with MODEL_LOCK:
                outputs = self.llm.generate(requests, self._params(sampling), use_tqdm=False)
        except Exception as e:
            raise EngineError(
                f"vllm rollout engine {self.label!r} failed while generating for "
                f"{len(prompts)} prompts: {type(e).__name__}: {e}"
            ) from e
        flat = [self._completion(c, sampling) for out in outputs for c in out.outputs]
        return [flat[k * sampling.n : (k + 1) * sampling.n] for k in range(len(prompts))]

    def _completion(self, output: Any, sampling: Sampling) -> Completion:
        ids = list(output.token_ids)
        logprobs = [float(x) for x in output.logprobs.logprobs]
        text = self.tokenizer.decode(ids)
        for s in sampling.stop:
            if s in text:
                text = text[: text.index(s)]
        reason = "length" if output.finish_reason == "length" else "stop"
        return Completion(ids, logprobs, text, reason)

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the full set of weights in place. A partial set is refused: vLLM would leave
        the missing tensors (and some it rebuilds from them) silently stale."""
        tensors = list(weights)  # names and views only; no tensor data is copied
        names = {name for name, _ in tensors}
        missing = self.expected_names - names
        if missing:
            raise ValueError(
                f"vllm rollout engine {self.label!r} needs the full weights; missing "
                f"{sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        if self.tied and TIED[1] not in names:
            tensors.append((TIED[1], dict(tensors)[TIED[0]]))
        try:
            with MODEL_LOCK:
                self.llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": iter(tensors)}
                )
                # Cached prompt KV blocks were computed under the old weights.
                self.llm.reset_prefix_cache()
        except Exception as e:
            raise EngineError(
                f"vllm rollout engine {self.label!r} failed to load weights v{version}: "
                f"{type(e).__name__}: {e}"
            ) from e
        self.version = version

    def close(self) -> None:
        """Shuts the engine down. vLLM then also tears down this process's default
        torch.distributed group, so every other in-process user of it must be done."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
