"""The hf engine pair on a device (``rollout.device``, ``trainer.device``). Without CUDA: the
options are checked, and a CUDA device this machine lacks is refused naming the option, at load
(launcher local) or as the engine starts (where Ray places it). With CUDA (skipped elsewhere):
the tiny model decodes the same greedy tokens on the GPU as on the CPU, in both loops; seeded
sampling uses a generator on the GPU; weights load in place into the GPU's parameters; a train
step runs there and what it hands back (log-probs, weights, checkpoints) is read as on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from asyncflow import config as cfg
from asyncflow.config import ModelConfig
from asyncflow.engines.base import Request, Sampling, TrainBatch
from asyncflow.engines.errors import WeightLoadError
from asyncflow.engines.hf import HFRolloutEngine, HFTrainEngine, sample
from asyncflow.errors import ConfigError
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.workers.batches import to_train_batch

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+5="]
#: |log-prob| gap allowed between the GPU's fp32 kernels and the CPU's on the same tokens.
TOLERANCE = 1e-4

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(ModelConfig(), tmp_path_factory.mktemp("device") / "model", seed=0)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine as one without CUDA, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def ids(texts: list[str]) -> list[list[int]]:
    tok = chatml_tokenizer()
    return [tok.encode(t) for t in texts]


def on(device: str, *overrides: str) -> cfg.Config:
    return cfg.load(None, [f"rollout.device={device}", f"trainer.device={device}", *overrides])


# -- the options, on any machine ----------------------------------------------------------------


def test_both_engines_default_to_the_cpu(model_dir: Path) -> None:
    config = cfg.Config()
    assert (config.rollout.device, config.trainer.device) == ("cpu", "cpu")
    rollout, trainer = HFRolloutEngine(model_dir, config), HFTrainEngine(model_dir, config)
    for engine in (rollout, trainer):
        assert engine.device == torch.device("cpu")
        assert {p.device.type for p in engine.model.parameters()} == {"cpu"}


@pytest.mark.parametrize("key", ["rollout.device", "trainer.device"])
@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:-1", "cuda:x", "cuda:0:1", "mps"])
def test_a_device_other_than_cpu_cuda_or_cuda_n_is_refused_naming_the_option(
    key: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=rf"{key} must be cpu, cuda or cuda:N"):
        cfg.load(None, [f"{key}={value}"])


@pytest.mark.parametrize("key", ["rollout.device", "trainer.device"])
@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
@pytest.mark.usefixtures("no_cuda")
def test_cuda_on_a_machine_without_cuda_is_refused_at_load_naming_the_option(
    key: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=rf"{key} is '{value}' but CUDA is not available"):
        cfg.load(None, [f"{key}={value}"])


def test_a_cuda_index_beyond_the_machines_devices_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cfg.load(None, ["trainer.device=cuda:1"]).trainer.device == "cuda:1"
    with pytest.raises(ConfigError, match=r"rollout.device is 'cuda:2' but this machine has 2"):
        cfg.load(None, ["rollout.device=cuda:2"])


@pytest.mark.usefixtures("no_cuda")
def test_under_ray_each_engine_checks_its_device_where_it_starts(model_dir: Path) -> None:
    # The head may have no GPU while the engines' nodes do: the load leaves CUDA unchecked...
    config = on("cuda", "launcher=ray")
    # ...and an engine started without one refuses, naming its option.
    with pytest.raises(ConfigError, match=r"rollout.device is 'cuda' but CUDA is not available"):
        HFRolloutEngine(model_dir, config)
    with pytest.raises(ConfigError, match=r"trainer.device is 'cuda' but CUDA is not available"):
        HFTrainEngine(model_dir, config)


# -- on a GPU -----------------------------------------------------------------------------------


def greedy_calls(engine: HFRolloutEngine) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and log-probs of each prompt from the batched call (left-padded)."""
    outs = engine.generate(ids(PROMPTS), Sampling(max_tokens=8, greedy=True))
    return [g[0].token_ids for g in outs], [g[0].logprobs for g in outs]


def greedy_requests(engine: HFRolloutEngine) -> tuple[list[list[int]], list[list[float]]]:
    """The same from the request-level loop (one sequence per forward pass, its own cache)."""
    for key, prompt in enumerate(ids(PROMPTS)):
        engine.add_request(Request(key, prompt, Sampling(max_tokens=8, greedy=True)))
    done: dict[int, Request] = {}
    while engine.in_flight():
        done |= {r.key: r for r in engine.step()}
    return [done[k].token_ids for k in sorted(done)], [done[k].logprobs for k in sorted(done)]


@needs_cuda
def test_greedy_tokens_on_cuda_are_those_on_the_cpu(model_dir: Path) -> None:
    cpu, gpu = HFRolloutEngine(model_dir, on("cpu")), HFRolloutEngine(model_dir, on("cuda"))
    assert {p.device.type for p in gpu.model.parameters()} == {"cuda"}
    for decode in (greedy_calls, greedy_requests):
        (cpu_tokens, cpu_logps), (gpu_tokens, gpu_logps) = decode(cpu), decode(gpu)
        assert gpu_tokens == cpu_tokens, decode.__name__
        gap = max(
            abs(a - b)
            for x, y in zip(cpu_logps, gpu_logps, strict=True)
            for a, b in zip(x, y, strict=True)
        )
        assert gap < TOLERANCE, decode.__name__


@needs_cuda
def test_seeded_sampling_on_cuda_repeats_itself_in_both_loops(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir, on("cuda"))
    sampling = Sampling(n=4, max_tokens=8, seed=5)
    first = sample(engine.model, ids(PROMPTS), sampling, engine.tokenizer)
    again = sample(engine.model, ids(PROMPTS), sampling, engine.tokenizer)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]

    def requests() -> list[int]:
        engine.add_request(Request(0, ids(PROMPTS)[0], sampling))
        while engine.in_flight():
            finished = engine.step()
        return finished[0].token_ids

    assert requests() == requests()


def moved_weights(engine: HFRolloutEngine, devices: tuple[str, str]) -> dict[str, torch.Tensor]:
    """Every parameter moved by a seeded random step, alternately on each of ``devices``."""
    generator = torch.Generator().manual_seed(1)
    return {
        name: (p.detach().cpu() + torch.randn(p.shape, generator=generator)).to(devices[i % 2])
        for i, (name, p) in enumerate(engine.model.named_parameters())
    }


@needs_cuda
def test_load_weights_on_cuda_copies_host_and_gpu_tensors_in_place(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir, on("cuda"))
    where = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    weights = moved_weights(engine, ("cpu", "cuda"))
    assert {t.device.type for t in weights.values()} == {"cpu", "cuda"}
    engine.load_weights(1, weights.items())
    assert engine.version == 1
    for name, param in engine.model.named_parameters():
        assert param.device.type == "cuda" and param.data_ptr() == where[name], name
        assert torch.equal(param, weights[name].to(param.device)), name
    # A set with one tensor of the wrong shape is refused before anything is copied.
    bad = moved_weights(engine, ("cpu", "cuda"))
    first = next(iter(bad))
    bad[first] = bad[first][:1]
    with pytest.raises(WeightLoadError, match=first):
        engine.load_weights(2, bad.items())
    assert engine.version == 1
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, weights[name].to(param.device)), name


def sft_loss(logp: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = batch.response_mask.float()
    loss = -(logp * mask).sum() / mask.sum()
    return loss, {"loss": float(loss.detach())}


def target_batch() -> TrainBatch:
    """``12+34=46``, its last three tokens the response a step makes likelier."""
    (tokens,) = ids(["12+34=46"])
    return to_train_batch([np.array(tokens[:-3], np.int64)], [np.array(tokens[-3:], np.int64)], 0)


@needs_cuda
def test_a_train_step_on_cuda_changes_the_weights_and_hands_back_what_the_cpu_reads(
    model_dir: Path, tmp_path: Path
) -> None:
    config = on("cuda", "trainer.lr=0.01")
    engine, reference = HFTrainEngine(model_dir, config), HFTrainEngine(model_dir, on("cpu"))
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
    batch = target_batch()  # on the host, as the workers build it
    logp = engine.logprobs(batch)
    assert logp.device.type == "cpu"
    assert (logp - reference.logprobs(batch)).abs().max() < TOLERANCE
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    stats = engine.forward_backward(batch, sft_loss)
    figures = engine.optimizer_step()
    assert np.isfinite(stats["loss"]) and np.isfinite(figures["grad_norm"])
    changed = [n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    assert engine.logprobs(batch)[0, -3:].sum() > logp[0, -3:].sum()  # the target likelier
    # The exported weights load into an engine on the CPU, bit for bit.
    rollout = HFRolloutEngine(model_dir, on("cpu"))
    exported = dict(engine.export_weights())
    rollout.load_weights(engine.version, exported.items())
    for name, param in rollout.model.named_parameters():
        assert torch.equal(param, exported[name].cpu()), name
    # A checkpoint written from the GPU resumes on the CPU.
    engine.save(tmp_path / "ckpt")
    reference.load(tmp_path / "ckpt")
    assert reference.version == 1
    for name, param in reference.model.named_parameters():
        assert torch.equal(param, exported[name].cpu()), name
