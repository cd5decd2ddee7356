"""The ``vllm`` rollout engine: vLLM running inside this process (its CPU build on CPU machines,
its CUDA build on GPU machines).

In-process, with no engine-core subprocess, so that new weights pass from the store's zero-copy
views straight into the engine through the worker's ``reload_weights`` (the multiprocess engine
would have to pickle them or write them to a file). vLLM copies them once, into its own
parameters, which it must own; nothing else is copied. With ``rollout.tensor_parallel_size``
above 1 the shards run in vLLM's worker processes, which get each version through its message
queue.

Colocated with the trainer on one GPU (``rollout.sleep_while_training``), the engine sleeps at
vLLM's level 1 while the trainer steps: its KV cache is discarded and its weights go to host
memory, to come back as they were on waking. The engine takes no call while asleep.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from asyncflow.config import Config, no_sleep_mode_here
from asyncflow.engines.base import Completion, Request, RolloutEngine, Sampling
from asyncflow.engines.errors import EngineError, EngineStartError, WeightLoadError
from asyncflow.errors import ConfigError
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.units import parse_size


def prepare_environment() -> None:
    """vLLM reads these when it is imported, so this runs before that."""
    # In-process engine core: weights reload from tensors, no pickling, one process to watch,
    # and each engine step is the one the caller asked for. An engine core of its own would
    # decode on between the caller's steps, so a token sampled before a weight load but read
    # after it would be tagged with the new version: refused rather than mistagged.
    multiprocessing = os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if multiprocessing.strip() != "0":
        raise EngineStartError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={multiprocessing} is set: the vllm rollout engine "
            "drives vLLM's engine core in its own process (in-place weight loads, each "
            "token's policy version); unset it or set it to 0"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")


#: vLLM keeps the current forward pass's context in a module global, so two engines of one
#: process must not run the model at the same time (each still has its own weights and cache).
MODEL_LOCK = threading.Lock()

#: A tied output embedding: trainers export only the input embedding, but vLLM's reload
#: rebuilds its output head from a tensor of this name, and keeps the old one without it.
TIED = ("model.embed_tokens.weight", "lm_head.weight")


#: vLLM's sleep level while the trainer steps: 1 moves the weights to host memory and back on
#: waking, and discards the KV cache, so a version loaded before sleeping is still there after.
#: (Level 2 discards the weights too, for less host memory, but an engine woken from it must
#: load a version before it generates again.)
SLEEP_LEVEL = 1


def llm_class() -> type:
    """vLLM's ``LLM``, imported only when an engine starts (vLLM takes seconds to import)."""
    from vllm import LLM

    llm: type = LLM
    return llm


def on_cuda() -> bool:
    """Whether vLLM runs on a CUDA (or ROCm) GPU here: its CUDA build, with a device it sees.
    Its CPU build reports the CPU even on a GPU machine."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def llm_arguments(model_dir: Path, config: Config, cuda: bool) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``LLM`` for this run, on CUDA (``cuda``) or the CPU."""
    r = config.rollout
    partial: dict[str, Any] = {}
    # Agent runs generate whole calls under partial rollout too (weights load between calls,
    # which empties the prefix cache): the request-level loop's settings are not theirs.
    if r.partial != "off" and not config.agent.enabled:
        # Cached prompt blocks would carry keys and values of whichever weights computed
        # them into sequences admitted later; the loop bounds what is in flight. With
        # asynchronous scheduling (vLLM's default on CUDA) a step returns the tokens of the
        # step before while it launches the next: tokens sampled by the old weights would come
        # back after a load and be recorded with the new version.
        partial = {
            "enable_prefix_caching": False,
            "max_num_seqs": r.max_num_seqs,
            "async_scheduling": False,
        }
    # Sleep mode puts vLLM's GPU memory in an allocator of its own: only when it is asked for.
    sleep = {"enable_sleep_mode": True} if r.sleep_while_training else {}
    return {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": config.model.dtype,
        "max_model_len": r.max_model_len,
        "kv_cache_memory_bytes": parse_size(r.kv_cache_memory),
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "tensor_parallel_size": r.tensor_parallel_size,
        # CUDA graphs replay each decode step's kernels at once (on CPU there are none). They
        # outlive weight updates: vLLM's reload copies into the parameters' own storage, and
        # sleep mode gives them back at the addresses they had, which the graphs point at.
        "enforce_eager": (not cuda) if r.enforce_eager is None else r.enforce_eager,
        "seed": config.run.seed,
        # Log-probs of the distribution the tokens were drawn from (temperature applied),
        # which is what the trainer computes.
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
        # vLLM's CPU runner cannot rewind a seeded request's generator when a long prompt's
        # prefill is split over steps: there, prompts are prefilled whole.
        "enable_chunked_prefill": cuda,
        **sleep,
        **partial,
    }


def _quiet_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """Every reload warns that the rotary embedding got no weights: it has none (its cos/sin
    table is computed, and kept), so the warning is noise."""
    return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def checkpoint_names(model_dir: Path) -> set[str]:
    """The parameter names a full reload must cover: those of the model's own checkpoint, less
    a tied output embedding (it is the input embedding)."""
    names: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    if is_tied(model_dir):
        names.discard(TIED[1])
    return names


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the model's own checkpoint."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def is_tied(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def _finish_reason(vllm_reason: str | None) -> str:
    """``"stop"`` only where the policy ended the sequence (its end token or a stop string);
    every other vLLM reason (``length``, and ``abort``, ``error`` or ``repetition`` where vLLM cut
    it on its own) is a cut response, ``"length"``: training it as one the policy chose to end
    would reward an ending the policy never sampled."""
    return "stop" if vllm_reason == "stop" else "length"


class VLLMRolloutEngine(RolloutEngine):
    """Generation with vLLM; weights swap in place, the engine is never restarted. Whole calls
    (:meth:`generate`), or request by request, one engine step at a time (:meth:`add_request`,
    :meth:`step`): between two steps new weights may be loaded while requests are in flight."""

    name = "vllm"
    supports_requests = True

    def __init__(self, model_dir: Path, config: Config, label: str = "rollout") -> None:
        super().__init__()
        prepare_environment()
        self.label = label
        #: Sleeping (``rollout.sleep_while_training``): no call but :meth:`wake_up` is taken.
        self.asleep = False
        try:
            LLM = llm_class()  # noqa: N806 - vLLM's class
            cuda = on_cuda()
        except ImportError as e:
            raise EngineStartError(
                f"vllm rollout engine {label!r}: vLLM is not installed ({e}); install the "
                "engines-cpu or engines-gpu dependency group, or set rollout.engine=hf"
            ) from e
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _quiet_rotary_reload_warning
        )
        if config.rollout.sleep_while_training and not cuda:
            raise ConfigError(no_sleep_mode_here("vLLM runs on the CPU"))
        try:
            self.tokenizer = load_tokenizer(model_dir)
            self.expected_names = checkpoint_names(model_dir)
            self.expected_shapes = checkpoint_shapes(model_dir)
            self.tied = is_tied(model_dir)
            #: The request-level loop, in flight by vLLM request id.
            self._requests: dict[str, Request] = {}
            self._next_id = 0
            self.llm = LLM(**llm_arguments(model_dir, config, cuda))
        except Exception as e:
            raise EngineStartError(
                f"vllm rollout engine {label!r} failed to start on {model_dir}: "
                f"{type(e).__name__}: {e}"
            ) from e

    def _params(self, sampling: Sampling, **overrides: Any) -> Any:
        from vllm import SamplingParams

        settings: dict[str, Any] = {
            "n": 1 if sampling.greedy else sampling.n,
            "temperature": 0.0 if sampling.greedy else sampling.temperature,
            "max_tokens": sampling.max_tokens,
            "stop": list(sampling.stop) or None,
            # Stop strings need vLLM to detokenize; otherwise our tokenizer decodes, faster.
            "detokenize": bool(sampling.stop),
            "seed": sampling.seed,
            "logprobs": 0,
            "flat_logprobs": True,
        }
        return SamplingParams(**(settings | overrides))

    def _check_awake(self, doing: str) -> None:
        if self.asleep:
            raise EngineError(
                f"vllm rollout engine {self.label!r} is asleep (the trainer is stepping) and "
                f"cannot {doing}; wake_up() first"
            )

    def sleep(self) -> None:
        """Frees the GPU for the trainer: vLLM's sleep level 1 discards the KV cache and moves
        the weights to host memory. Nothing may be in flight."""
        if self.asleep:
            return
        if self._requests:
            raise EngineError(
                f"vllm rollout engine {self.label!r} cannot sleep with {len(self._requests)} "
                "requests in flight: sleeping discards their KV cache"
            )
        try:
            with MODEL_LOCK:
                self.llm.sleep(level=SLEEP_LEVEL)
        except Exception as e:
            raise EngineError(
                f"vllm rollout engine {self.label!r} failed to go to sleep: {type(e).__name__}: {e}"
            ) from e
        self.asleep = True

    def wake_up(self) -> None:
        """Takes the GPU back: the weights it slept with (``version``) return from host memory
        and a new KV cache is allocated. A version published meanwhile is loaded after this."""
        if not self.asleep:
            return
        try:
            with MODEL_LOCK:
                awake = self.llm.wake_up()
        except Exception as e:
            raise EngineError(
                f"vllm rollout engine {self.label!r} failed to wake up: {type(e).__name__}: {e}"
            ) from e
        if awake is False:  # (a vLLM whose wake_up returns nothing is taken at its word)
            raise EngineError(
                f"vllm rollout engine {self.label!r} woke up only partly: some of its GPU "
                "memory is still released"
            )
        self.asleep = False

    def add_request(self, request: Request) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # Each step returns the tokens it added, so each gets the version that sampled it.
        params = self._params(
            request.sampling, n=1, max_tokens=request.remaining, output_kind=RequestOutputKind.DELTA
        )
        self._check_awake("take a request")
        rid = f"partial-{self._next_id}"  # apart from the ids of whole calls
        self._next_id += 1
        prompt = TokensPrompt(prompt_token_ids=[*request.prompt, *request.token_ids])
        try:
            with MODEL_LOCK:
                self.llm.llm_engine.add_request(rid, prompt, params)
        except Exception as e:
            raise EngineError(
                f"vllm rollout engine {self.label!r} refused a request: {type(e).__name__}: {e}"
            ) from e
        self._requests[rid] = request

    def step(self) -> list[Request]:
        self._check_awake("run a decode step")
        try:
            with MODEL_LOCK:
                outputs = self.llm.llm_engine.step()
        except Exception as e:
            raise EngineError(
                f"vllm rollout engine {self.label!r} failed in a decode step with "
                f"{len(self._requests)} requests in flight: {type(e).__name__}: {e}"
            ) from e
        finished = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue
            for piece in out.outputs:
                request.token_ids += list(piece.token_ids)
                if piece.logprobs is not None:
                    request.logprobs += [float(x) for x in piece.logprobs.logprobs]
                request.versions += [self.version] * len(piece.token_ids)
                if out.finished:
                    request.finish_reason = _finish_reason(piece.finish_reason)
            if out.finished:
                request.finish_reason = request.finish_reason or "stop"
                del self._requests[out.request_id]
                finished.append(request)
        return finished

    def abort_requests(self, keys: Collection[Any] | None = None) -> list[Request]:
        ids = [i for i, r in self._requests.items() if keys is None or r.key in keys]
        if ids:
            with MODEL_LOCK:
                self.llm.llm_engine.abort_request(ids)
        return [self._requests.pop(i) for i in ids]

    def in_flight(self) -> int:
        return len(self._requests)

    def finish_text(self, request: Request) -> Completion:
        text = self.tokenizer.decode(request.token_ids)
        completion = request.completion(text)
        for s in request.sampling.stop:
            if s in text:
                completion.text = text[: text.index(s)]
        return completion

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        self._check_awake("generate")
        from vllm.inputs import TokensPrompt

        # A whole call steps the engine until nothing is unfinished and returns every request
        # that finished: sequences a stopped request-level loop left in flight would be among
        # them, so they go first.
        self.abort_requests()
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
        return Completion(ids, logprobs, text, _finish_reason(output.finish_reason))

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads the full set of weights in place. A partial set is refused: vLLM would leave
        the missing tensors (and some it rebuilds from them) silently stale."""
        # Its parameters live in host memory while it sleeps, and waking would restore the old.
        self._check_awake(f"load weights v{version}")
        tensors = list(weights)  # names and views only; no tensor data is copied
        names = {name for name, _ in tensors}
        missing = self.expected_names - names
        if missing:
            raise WeightLoadError(
                f"vllm rollout engine {self.label!r} needs the full weights; v{version} is "
                f"missing {sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}; "
                f"still on v{self.version}"
            )
        # vLLM copies tensor by tensor: one of the wrong shape would leave it half-loaded.
        for name, tensor in tensors:
            shape = self.expected_shapes.get(name)
            if shape is not None and tuple(tensor.shape) != shape:
                raise WeightLoadError(
                    f"vllm rollout engine {self.label!r}: weights v{version} give {name} the "
                    f"shape {tuple(tensor.shape)}, the model has {shape}; still on v{self.version}"
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
