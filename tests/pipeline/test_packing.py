"""Packed micro-batches: samples end to end in rows as wide as the longest train exactly as
padded rows do, and stay within the token budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncflow import config as cfg
from asyncflow.engines.base import StepResult, TrainBatch
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.models.tiny import create_tiny_model
from asyncflow.workers.batches import (
    pack_rows,
    pack_width,
    pair_cost,
    split_micro_batches,
    to_train_batch,
)
from asyncflow.workers.steps import StepLoss, sample_lengths

TINY = [
    "model.hidden_size=32",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate_size=64",
    "rollout.n=2",
    "trainer.groups_per_step=3",
]


def samples(rng: np.random.Generator) -> dict[str, list[np.ndarray]]:
    rows = 6
    responses = [rng.integers(4, 90, int(rng.integers(1, 7))) for _ in range(rows)]
    return {
        "prompt_ids": [rng.integers(4, 90, int(rng.integers(2, 15))) for _ in range(rows)],
        "response_ids": responses,
        "behaviour_logprobs": [rng.normal(-2, 0.3, len(r)).astype(np.float32) for r in responses],
        "advantage": list(rng.normal(size=rows)),
    }


def gradients(engine: HFTrainEngine, loss: StepLoss, batch: TrainBatch) -> dict:
    engine.model.zero_grad(set_to_none=True)
    engine.forward_backward(batch, loss)
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_packed_micro_batch_has_the_gradient_of_the_padded_one(
    tmp_path: Path, aggregation: str
) -> None:
    config = cfg.load(None, [*TINY, f"algorithm.loss_aggregation={aggregation}"])
    engine = HFTrainEngine(create_tiny_model(config.model, tmp_path, seed=0), config)
    data = samples(np.random.default_rng(0))
    padded = StepLoss(config, pad_id=0)
    padded.packed = False
    packed = StepLoss(config, pad_id=0)
    assert packed.packed, "packing is the default"
    # Some rows hold several samples (each must attend only within itself).
    assert packed.batch(data).input_ids.shape[0] < len(data["prompt_ids"])
    want = gradients(engine, padded, padded.batch(data))
    got = gradients(engine, packed, packed.batch(data))
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_positions_restart_at_each_sample() -> None:
    prompts = [np.array([5, 6, 7]), np.array([8]), np.array([12])]
    responses = [np.array([9]), np.array([10, 11]), np.array([13])]
    batch = to_train_batch(
        prompts, responses, 0, per_row={"advantage": np.array([1.0, -1.0, 2.0])}, packed=True
    )
    # Rows as wide as the longest sample; the third fits beside none, so a row of its own.
    assert batch.input_ids.tolist() == [[5, 6, 7, 9], [8, 10, 11, 0], [12, 13, 0, 0]]
    # A row's unfilled end is a sequence of its own, outside every mask.
    assert batch.position_ids is not None
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch.extras["advantage"].tolist() == [[1, 1, 1, 1], [-1, -1, -1, 0], [2, 2, 0, 0]]
    assert batch.sequence_ids is not None
    assert batch.sequence_ids.tolist() == [[0, 0, 0, 0], [1, 1, 1, 0], [2, 2, 0, 0]]
    assert batch.sequences == 3 and batch.tokens == 9


def test_padded_rows_hold_each_sample_at_their_start_and_its_values_on_its_response() -> None:
    prompts = [np.array([5, 6, 7]), np.array([8]), np.array([], np.int64)]
    responses = [np.array([9]), np.array([10, 11]), np.array([13, 14])]
    batch = to_train_batch(
        prompts,
        responses,
        -1,
        per_token={"behaviour_logp": [[-0.5], [-1.0, -1.5], np.array([-2.0, -2.5])]},
        per_row={"advantage": np.array([1.0, -1.0, 2.0])},
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 9], [8, 10, 11, -1], [13, 14, -1, -1]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0]]
    assert batch.extras["behaviour_logp"].tolist() == [
        [0, 0, 0, -0.5],
        [0, -1.0, -1.5, 0],
        [-2.0, -2.5, 0, 0],
    ]
    assert batch.extras["advantage"].tolist() == [1.0, -1.0, 2.0]


def test_a_per_token_value_short_of_its_response_is_refused_naming_it() -> None:
    prompts = [np.array([5]), np.array([8])]
    responses = [np.array([9, 10]), np.array([11])]
    # One value short on the first row (it would broadcast), one over on the second.
    short_then_over = {"behaviour_logp": [[-1.0], [-1.0, -2.0]]}
    for packed in (False, True):
        with pytest.raises(ValueError, match=r"behaviour_logp of row 0: 1 values for 2 tokens"):
            to_train_batch(prompts, responses, 0, per_token=short_then_over, packed=packed)


def test_short_samples_share_rows_as_wide_as_the_longest() -> None:
    lengths = [4, 2, 9, 3, 5, 1]
    rows = pack_rows(lengths, pack_width(lengths))
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    # Longest first, each into the first row with room: 9 | 5 4 | 3 2 1 ... in rows of 9.
    assert [[lengths[i] for i in row] for row in rows] == [[9], [5, 4], [3, 2, 1]]


@pytest.mark.parametrize("seed", range(5))
def test_packed_micro_batches_hold_the_rows_they_were_counted_with(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(1, 40, 60)]
    budget = 200
    width = pack_width(lengths)
    parts = split_micro_batches(lengths, budget, packed=True, min_count=3)
    assert len(parts) >= 3
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    rows = 0
    for part in parts:
        if not part:
            continue
        batch = to_train_batch(
            [np.ones(lengths[i] - 1, np.int64) for i in part],
            [np.ones(1, np.int64) for _ in part],
            0,
            packed=True,
            width=width,
        )
        assert batch.input_ids.shape[1] <= width
        assert batch.input_ids.numel() <= budget
        rows += batch.input_ids.shape[0]
    # Laid out anew, each micro-batch's samples fall into the rows first fit made.
    assert rows == len(pack_rows(lengths, width))


def test_padded_micro_batches_count_the_padding_against_the_budget() -> None:
    lengths = [10, 9, 3, 3, 3, 2]
    parts = split_micro_batches(lengths, budget=20, packed=False)
    assert all(len(p) * max(lengths[i] for i in p) <= 20 for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(6))
    # Packed, only the tokens count: two micro-batches hold the 30 tokens.
    assert len(split_micro_batches(lengths, budget=20, packed=True)) == 2


@pytest.mark.parametrize("spread", [(13, 20), (2, 60)])
def test_packing_never_holds_more_padding_than_padding_each_row(spread: tuple[int, int]) -> None:
    # Samples close in length (the default job: none fits beside another) and far apart.
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(*spread, 512)]

    def tensor_tokens(packed: bool) -> int:
        total = 0
        for part in split_micro_batches(lengths, 4096, packed=packed):
            prompts = [np.ones(lengths[i] - 1, np.int64) for i in part]
            responses = [np.ones(1, np.int64) for _ in part]
            width = pack_width(lengths) if packed else None
            batch = to_train_batch(prompts, responses, 0, packed=packed, width=width)
            assert batch.input_ids.numel() <= 4096
            total += batch.input_ids.numel()
        return total

    assert sum(lengths) <= tensor_tokens(True) <= tensor_tokens(False)


def groups(rng: np.random.Generator, count: int, n: int, longest: int = 7) -> dict[str, list]:
    """``count`` groups of ``n`` samples, each group's samples with one prompt, in group order
    as a whole-group claim reads them."""
    prompts = [rng.integers(4, 90, int(rng.integers(3, 12))) for _ in range(count)]
    responses = [rng.integers(4, 90, int(rng.integers(1, longest))) for _ in range(count * n)]
    return {
        "prompt_ids": [prompts[i // n] for i in range(count * n)],
        "response_ids": responses,
        "behaviour_logprobs": [rng.normal(-2, 0.3, len(r)).astype(np.float32) for r in responses],
        "advantage": list(rng.normal(size=count * n)),
    }


def test_a_shared_prompt_is_laid_out_once_with_each_response_attending_to_it() -> None:
    prompts = [np.array([5, 6, 7]), np.array([5, 6, 7]), np.array([8])]
    responses = [np.array([9]), np.array([10, 11]), np.array([12])]
    batch = to_train_batch(prompts, responses, 0, packed=True, shared=True)
    # One unit of 3 + 1 + 2 tokens, then the third sample in a row of its own.
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 10, 11], [8, 12, 0, 0, 0, 0]]
    assert batch.position_ids is not None and batch.logit_source is not None
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 3, 4], [0, 1, 0, 1, 2, 3]]
    assert batch.sequence_ids is not None
    assert batch.sequence_ids.tolist() == [[0, 0, 0, 0, 1, 1], [2, 2, 0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 0, 0, 0, 0]]
    # Both responses' first tokens are predicted at the prompt's last (column 2).
    assert batch.logit_source.tolist()[0] == [0, 0, 1, 2, 2, 4]
    assert batch.shared_mask is not None
    seen = batch.shared_mask[0, 0].int().tolist()
    assert seen[4] == [1, 1, 1, 0, 1, 0]  # the second response: the prompt and itself
    assert seen[5] == [1, 1, 1, 0, 1, 1]
    assert seen[3] == [1, 1, 1, 1, 0, 0]
    assert batch.shared_mask[1, 0].int().tolist()[3] == [0, 0, 1, 1, 0, 0]  # padding: its own
    assert batch.sequences == 3 and batch.tokens == 8


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_a_micro_batch_of_shared_prompts_has_the_gradient_of_the_padded_one(
    tmp_path: Path, aggregation: str
) -> None:
    config = cfg.load(None, [*TINY, f"algorithm.loss_aggregation={aggregation}"])
    engine = HFTrainEngine(create_tiny_model(config.model, tmp_path, seed=0), config)
    data = groups(np.random.default_rng(1), count=3, n=4)
    padded = StepLoss(config, pad_id=0)
    padded.packed = False
    shared = StepLoss(config, pad_id=0, model_config=engine.model_config)
    units = shared.units(data)
    assert units == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    batch = shared.batch(data, shared=True)
    assert batch.shared_mask is not None
    assert batch.tokens < sum(sample_lengths(data))
    want, got = gradients(engine, padded, padded.batch(data)), gradients(engine, shared, batch)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    # The response tokens' log-probs are the padded rows' too.
    mine = engine.logprobs(batch)[batch.response_mask.bool()]
    theirs = engine.logprobs(padded.batch(data))[padded.batch(data).response_mask.bool()]
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


def test_prompts_are_shared_only_where_it_costs_less_and_units_stay_whole(
    tmp_path: Path,
) -> None:
    config = cfg.load(None, [*TINY, "trainer.micro_batch_tokens=200"])
    model_config = HFTrainEngine(
        create_tiny_model(config.model, tmp_path, seed=0), config
    ).model_config
    data = groups(np.random.default_rng(2), count=12, n=4)
    loss = StepLoss(config, pad_id=0, model_config=model_config)
    units = loss.units(data)
    assert units is not None and len(units) == 12
    parts = loss.parts(data, min_count=2)
    assert sorted(i for part in parts for i in part) == list(range(48))
    for part, batch in zip(parts, loss.micro_batches(data, parts, False), strict=True):
        assert batch.input_ids.numel() <= 200
        assert any(part[k : k + 4] == u for u in units for k in range(len(part)))
        assert batch.sequences == len(part)
    # Without the model's sizes, with sharing turned off, or where attention over the longer
    # rows would cost more than the prompts saved (long responses, a short prompt, a model
    # whose attention costs much against its weights), samples are laid out one by one.
    assert StepLoss(config, pad_id=0).units(data) is None
    off = cfg.load(None, [*TINY, "trainer.share_prompts=false"])
    assert StepLoss(off, pad_id=0, model_config=model_config).units(data) is None
    # Two groups of 8 samples of a 2-token prompt and 50-token responses: a shared unit is a row
    # of 402 tokens, whose attention costs more than the 14 prompts it saves.
    wide = cfg.load(None, TINY)
    long = {
        "prompt_ids": [np.array([5, 6]) if i < 8 else np.array([7, 8]) for i in range(16)],
        "response_ids": [np.full(50, 9) for _ in range(16)],
        "behaviour_logprobs": [np.zeros(50, np.float32) for _ in range(16)],
        "advantage": [0.0] * 16,
    }
    assert StepLoss(wide, pad_id=0, model_config=model_config).units(long) is None
    # The same groups with 4-token responses: the prompt is a third of each sample; shared.
    short = long | {
        "response_ids": [np.full(4, 9) for _ in range(16)],
        "behaviour_logprobs": [np.zeros(4, np.float32) for _ in range(16)],
    }
    assert StepLoss(wide, pad_id=0, model_config=model_config).units(short) == [
        list(range(8)),
        list(range(8, 16)),
    ]


class MaskIgnoringEngine(HFTrainEngine):
    """A model that ignores the attention mask it is given (attending causally within each
    row, as some attention implementations would): shared responses then see each other."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return super().logprobs(dataclasses.replace(batch, shared_mask=None))


def test_sharing_is_checked_on_the_model_and_turned_off_where_it_attends_otherwise(
    tmp_path: Path,
) -> None:
    config = cfg.load(None, TINY)
    model = create_tiny_model(config.model, tmp_path, seed=0)
    data = groups(np.random.default_rng(4), count=2, n=4)
    engine = HFTrainEngine(model, config)
    loss = StepLoss(config, pad_id=0, model_config=engine.model_config)
    gap = loss.check_sharing(engine)
    assert gap is not None and gap < 1e-5
    assert loss.pair_cost is not None and loss.units(data) is not None
    wrong = MaskIgnoringEngine(model, config)
    loss = StepLoss(config, pad_id=0, model_config=wrong.model_config)
    gap = loss.check_sharing(wrong)
    assert gap is not None and gap > 1e-2
    assert loss.pair_cost is None and loss.units(data) is None
    assert loss.check_sharing(wrong) is None  # off: nothing more to check


def test_an_empty_micro_batch_trains_nothing(tmp_path: Path) -> None:
    # What a data-parallel rank with fewer micro-batches than its peers runs: a prompt with an
    # empty response, which ends its row.
    config = cfg.load(None, TINY)
    engine = HFTrainEngine(create_tiny_model(config.model, tmp_path, seed=0), config)
    loss = StepLoss(config, pad_id=0, model_config=engine.model_config)
    batch = loss.empty_batch(with_reference=False)
    assert batch.input_ids.shape == (1, 2) and int(batch.response_mask.sum()) == 0
    grads = gradients(engine, loss, batch)
    assert grads and all(float(g.abs().max()) == 0 for g in grads.values())


def test_models_that_attend_within_a_window_do_not_share_prompts() -> None:
    # The shared layout's mask is used as given by every layer: a sliding window would be lost.
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    sizes = {
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    assert pair_cost(Qwen2Config(**sizes)) is not None
    assert pair_cost(MistralConfig(**sizes, sliding_window=None)) is not None
    assert pair_cost(MistralConfig(**sizes, sliding_window=12)) is None
    windowed = Qwen2Config(**sizes, use_sliding_window=True, sliding_window=12, max_window_layers=0)
    assert pair_cost(windowed) is None
    assert pair_cost(Gemma3TextConfig(**sizes, head_dim=16)) is None  # sliding and full layers


def test_the_padding_figures_count_a_shared_prompt_as_saved_not_as_padding() -> None:
    # 2 groups of 4 samples, each 10 prompt and 3 response tokens: no padding either way.
    prompts = [np.arange(10) + 4 + (i // 4) for i in range(8)]
    responses = [np.array([30, 31, 32]) for _ in range(8)]
    batch = to_train_batch(prompts, responses, 0, packed=True, shared=True)
    result = StepResult()
    result.count_batch(batch, [13] * 8)
    figures = result.padding()
    assert figures["padding_fraction_unpacked"] == 0
    assert figures["padding_fraction"] == 0  # two units of 22 tokens, a row each
    assert figures["shared_token_fraction"] == pytest.approx(1 - 44 / 104)
