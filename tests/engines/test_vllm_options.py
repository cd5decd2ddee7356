"""The vllm rollout engine's GPU options and sleep mode, against a stand-in for vLLM's ``LLM``
that notes its constructor's arguments and every call: what the engine asks of vLLM on a GPU
cannot run here (vLLM's CUDA build), so these check what it asks, on either platform (vLLM's
platform check is replaced too). No vLLM is imported.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from asyncflow import config as cfg
from asyncflow.engines import vllm as vllm_engine
from asyncflow.engines.base import Request, Sampling
from asyncflow.engines.errors import EngineError
from asyncflow.engines.vllm import VLLMRolloutEngine
from asyncflow.errors import ConfigError
from asyncflow.models.tiny import create_tiny_model

MODEL = ["model.hidden_size=32", "model.heads=2", "model.kv_heads=1", "model.intermediate_size=64"]
#: The colocated synchronous mode.
SLEEP = [
    "rollout.engine=vllm",
    "rollout.sleep_while_training=true",
    "trainer.max_staleness=0",
    "trainer.streaming=false",
]


class FakeLLM:
    """Stands in for ``vllm.LLM``: keeps its keyword arguments and notes each call in order."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[tuple[Any, ...]] = []
        #: What :meth:`wake_up` answers (vLLM: whether every allocation is back).
        self.fully_awake = True
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return self.fully_awake

    def collective_rpc(self, method: str, kwargs: dict[str, Any]) -> None:
        self.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(cfg.load(None, MODEL).model, tmp_path_factory.mktemp("m"), seed=0)


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Which platform vLLM reports (``cuda``), and whether torch sees CUDA (``torch``, checked
    as the config is read); both the CPU unless a test says otherwise."""
    where = {"cuda": False, "torch": False}
    monkeypatch.setattr(vllm_engine, "llm_class", lambda: FakeLLM)
    monkeypatch.setattr(vllm_engine, "on_cuda", lambda: where["cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: where["torch"])
    return where


def on_gpu(platform: dict[str, bool]) -> None:
    platform["cuda"] = platform["torch"] = True


def start(model: Path, *overrides: str) -> tuple[VLLMRolloutEngine, FakeLLM]:
    engine = VLLMRolloutEngine(model, cfg.load(None, [*MODEL, *overrides]))
    assert isinstance(engine.llm, FakeLLM)
    return engine, engine.llm


def full_weights(model: Path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(model / "model.safetensors")).items())


def test_on_the_cpu_the_engine_runs_eagerly_on_one_device_without_sleep_mode(
    model: Path, platform: dict[str, bool]
) -> None:
    _, llm = start(model)
    assert llm.kwargs["enforce_eager"] is True
    assert llm.kwargs["tensor_parallel_size"] == 1
    assert llm.kwargs["enable_chunked_prefill"] is False
    assert "enable_sleep_mode" not in llm.kwargs


def test_with_cuda_the_engine_captures_cuda_graphs_by_default(
    model: Path, platform: dict[str, bool]
) -> None:
    on_gpu(platform)
    _, llm = start(model)
    assert llm.kwargs["enforce_eager"] is False
    assert llm.kwargs["enable_chunked_prefill"] is True
    assert "enable_sleep_mode" not in llm.kwargs


@pytest.mark.parametrize("partial", ["off", "continue", "abort"])
def test_a_step_returns_its_own_tokens_when_weights_change_mid_generation(
    model: Path, platform: dict[str, bool], partial: str
) -> None:
    # Asynchronous scheduling returns a step's tokens one step late: across a weight load in
    # the request-level loop they would be recorded with the version loaded after them.
    on_gpu(platform)
    _, llm = start(model, f"rollout.partial={partial}")
    assert llm.kwargs.get("async_scheduling", True) is (partial == "off")


def test_an_agent_run_under_partial_rollout_keeps_the_engines_whole_call_settings(
    model: Path, platform: dict[str, bool]
) -> None:
    """Its turns are whole calls, between which weights load (emptying the prefix cache): the
    prefix cache, which spares a trajectory's later turns the prefill of its earlier ones, and
    vLLM's own batch size stay as without partial rollout."""
    on_gpu(platform)
    _, off = start(model, "agent.enabled=true")
    _, partial = start(model, "agent.enabled=true", "rollout.partial=continue")
    assert partial.kwargs == off.kwargs
    assert "enable_prefix_caching" not in partial.kwargs


@pytest.mark.parametrize(("cuda", "setting"), [(True, True), (False, False)])
def test_an_explicit_enforce_eager_overrides_the_platform_default(
    model: Path, platform: dict[str, bool], cuda: bool, setting: bool
) -> None:
    if cuda:
        on_gpu(platform)
    _, llm = start(model, f"rollout.enforce_eager={str(setting).lower()}")
    assert llm.kwargs["enforce_eager"] is setting


@pytest.mark.parametrize("cuda", [True, False])
def test_tensor_parallel_size_reaches_vllm_on_either_platform(
    model: Path, platform: dict[str, bool], cuda: bool
) -> None:
    # vLLM's CPU build shards over worker processes too (its CPU communicator), so the CPU is not
    # refused.
    if cuda:
        on_gpu(platform)
    _, llm = start(model, "rollout.tensor_parallel_size=2")
    assert llm.kwargs["tensor_parallel_size"] == 2


def test_a_tensor_parallel_size_below_one_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.tensor_parallel_size must be at least 1"):
        cfg.load(None, ["rollout.tensor_parallel_size=0"])


def test_sleep_mode_is_enabled_when_the_engine_is_to_sleep_while_training(
    model: Path, platform: dict[str, bool]
) -> None:
    on_gpu(platform)
    _, llm = start(model, *SLEEP)
    assert llm.kwargs["enable_sleep_mode"] is True
    assert llm.kwargs["enforce_eager"] is False


def test_sleeping_while_training_without_cuda_is_refused_as_the_config_is_read(
    platform: dict[str, bool],
) -> None:
    with pytest.raises(ConfigError, match=r"rollout.sleep_while_training needs vLLM on a CUDA"):
        cfg.load(None, SLEEP)


def test_sleeping_while_training_is_refused_where_vllm_runs_on_the_cpu(
    model: Path, platform: dict[str, bool]
) -> None:
    # torch sees a GPU, but the vLLM installed is its CPU build.
    platform["torch"] = True
    with pytest.raises(ConfigError, match="here vLLM runs on the CPU: vLLM's CPU build has no"):
        start(model, *SLEEP)


def test_sleep_and_wake_up_reach_vllm_at_level_1_once_each(
    model: Path, platform: dict[str, bool]
) -> None:
    on_gpu(platform)
    engine, llm = start(model, *SLEEP)
    engine.sleep()
    engine.sleep()
    assert engine.asleep
    engine.wake_up()
    engine.wake_up()
    assert llm.calls == [("sleep", 1), ("wake_up", None)]
    assert not engine.asleep


def test_an_asleep_engine_neither_loads_weights_nor_generates(
    model: Path, platform: dict[str, bool]
) -> None:
    on_gpu(platform)
    engine, llm = start(model, *SLEEP)
    weights = full_weights(model)
    engine.load_weights(3, weights)
    engine.sleep()
    with pytest.raises(EngineError, match=r"is asleep .* cannot load weights v4"):
        engine.load_weights(4, weights)
    with pytest.raises(EngineError, match=r"is asleep .* cannot generate"):
        engine.generate([[1, 2]], Sampling())
    # Level 1 brings the weights it slept with back: still version 3 until 4 is loaded, awake.
    engine.wake_up()
    assert engine.version == 3
    engine.load_weights(4, weights)
    assert engine.version == 4
    names = [call[0] for call in llm.calls]
    assert names == [
        "reload_weights",
        "reset_prefix_cache",
        "sleep",
        "wake_up",
        "reload_weights",
        "reset_prefix_cache",
    ]


def test_a_wake_up_that_leaves_memory_released_is_an_error(
    model: Path, platform: dict[str, bool]
) -> None:
    on_gpu(platform)
    engine, llm = start(model, *SLEEP)
    engine.sleep()
    llm.fully_awake = False
    with pytest.raises(EngineError, match="woke up only partly"):
        engine.wake_up()
    assert engine.asleep


@pytest.mark.parametrize("reason", ["stop", "length", "abort", "error", "repetition"])
def test_only_the_policys_own_ending_is_a_stop_every_cut_by_vllm_is_a_cut(
    model: Path, platform: dict[str, bool], reason: str
) -> None:
    """vLLM also ends requests on its own (``abort``, ``error``, ``repetition``): such a response
    is a cut one, as one out of tokens is, never one the policy chose to end."""
    engine, llm = start(model)
    expected = "stop" if reason == "stop" else "length"
    piece = SimpleNamespace(
        token_ids=[3, 4], logprobs=SimpleNamespace(logprobs=[-0.5, -0.25]), finish_reason=reason
    )
    # A whole call's output.
    assert engine._completion(piece, Sampling(n=1, max_tokens=8)).finish_reason == expected
    # The request-level loop's step.
    request = Request(key=0, prompt=[1, 2], sampling=Sampling(n=1, max_tokens=8))
    engine._requests["partial-0"] = request
    out = SimpleNamespace(request_id="partial-0", outputs=[piece], finished=True)
    llm.llm_engine.step = lambda: [out]
    assert engine.step() == [request]
    assert request.finish_reason == expected and request.token_ids == [3, 4]
