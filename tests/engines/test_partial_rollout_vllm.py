"""Partial rollout on the vllm engine (its CPU build here): weights loaded between two engine
steps while requests are in flight. Each token's recorded version and log-prob must match a
replay of the same weight schedule, within fp32 tolerance (vLLM's kernels are not the replay's).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncflow import config as cfg
from asyncflow.engines.base import Request, Sampling
from asyncflow.engines.errors import WeightLoadError
from asyncflow.engines.vllm import VLLMRolloutEngine
from asyncflow.models.tiny import create_tiny_model
from partial_replay import PROMPT, SWITCH, generate_with_switch, policy_versions, replay

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONFIG = cfg.load(None, ["rollout.partial=continue", "rollout.max_num_seqs=4"])
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(CONFIG.model, tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VLLMRolloutEngine]:
    e = VLLMRolloutEngine(model_dir, CONFIG)
    yield e
    e.close()


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(7)


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_each_token_carries_the_version_and_log_prob_it_was_sampled_with(
    engine: VLLMRolloutEngine, model_dir: Path, mode: str
) -> None:
    versions = policy_versions(model_dir)
    engine.load_weights(0, versions[0].items())
    done = generate_with_switch(engine, versions[1], mode)
    spanning = [r for r in done if len(r.token_ids) > SWITCH]
    assert spanning, "a sequence outlived the switch"
    for r in done:
        n = len(r.token_ids)
        assert r.versions == [0] * min(n, SWITCH) + [1] * max(0, n - SWITCH)
        expected = replay(model_dir, versions, PROMPT, r.token_ids, r.versions, mode)
        assert r.logprobs == pytest.approx(expected, abs=TOLERANCE)
    other = "abort" if mode == "continue" else "continue"
    r = spanning[0]
    wrong = replay(model_dir, versions, PROMPT, r.token_ids, r.versions, other)
    assert max(abs(a - b) for a, b in zip(r.logprobs, wrong, strict=True)) > 10 * TOLERANCE


def test_weights_of_the_wrong_shape_are_refused_before_any_is_loaded(
    engine: VLLMRolloutEngine, model_dir: Path
) -> None:
    versions = policy_versions(model_dir)
    engine.load_weights(0, versions[0].items())
    before = [r.token_ids for r in greedy_pair(engine)]
    name = next(iter(versions[2]))
    broken = {**versions[2], name: versions[2][name][:5]}
    with pytest.raises(WeightLoadError, match="v7 give"):
        engine.load_weights(7, broken.items())
    assert engine.version == 0
    assert [r.token_ids for r in greedy_pair(engine)] == before


def test_requests_cut_by_key_leave_the_others_decoding(engine: VLLMRolloutEngine) -> None:
    for key in range(3):
        engine.add_request(Request(key, PROMPT, Sampling(max_tokens=6, greedy=True)))
    engine.step()
    (cut,) = engine.abort_requests({1})
    assert cut.key == 1 and len(cut.token_ids) == 1
    done = []
    while engine.in_flight():
        done += engine.step()
    assert sorted(r.key for r in done) == [0, 2]


def greedy_pair(engine: VLLMRolloutEngine) -> list[Request]:
    for key in range(2):
        engine.add_request(Request(key, PROMPT, Sampling(max_tokens=6, greedy=True)))
    done = []
    while engine.in_flight():
        done += engine.step()
    return sorted(done, key=lambda r: r.key)


def test_a_whole_call_after_the_loop_stopped_returns_only_its_own_completions(
    engine: VLLMRolloutEngine,
) -> None:
    engine.add_request(Request("left", PROMPT, Sampling(max_tokens=12)))
    engine.step()  # the loop stops here, its sequence still in flight
    outs = engine.generate([PROMPT, PROMPT[:2]], Sampling(n=2, max_tokens=4))
    assert [len(group) for group in outs] == [2, 2]
    assert all(len(c.token_ids) <= 4 for group in outs for c in group)
    assert engine.in_flight() == 0
