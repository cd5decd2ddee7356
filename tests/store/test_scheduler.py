"""The scheduler's Python surface: data-parallel partitions, micro-batches and rollout routing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncflow as af
from asyncflow.scheduler import Cost, Router, costs, micro_batches, partition

#: Long-tailed lengths: mostly short, some very long, a few empty.
LENGTHS = st.lists(
    st.one_of(st.integers(1, 2_000), st.integers(2_000, 30_000), st.just(0)),
    max_size=200,
)


def part_costs(values: np.ndarray, parts: list[list[int]]) -> list[float]:
    return [float(values[p].sum()) for p in parts]


def test_a_perfect_split_is_found_when_one_exists() -> None:
    parts = partition([8, 7, 6, 5, 4], 2)
    assert sorted(part_costs(np.array([8, 7, 6, 5, 4]), parts)) == [15, 15]


def test_the_attention_cost_isolates_a_long_row_that_token_balance_would_pair() -> None:
    lengths = [6, 3, 3, 2, 2, 2]
    assert [0] not in partition(lengths, 2)
    assert [0] in partition(lengths, 2, cost="attention", linear_weight=0.0)
    np.testing.assert_array_equal(costs([3], "attention", linear_weight=2.0), [15.0])


def test_groups_stay_on_one_part_and_equal_count_evens_part_sizes() -> None:
    groups = [1, 1, 2, 2, 3, 3, 4, 4]
    parts = partition([9, 9, 1, 1, 5, 5, 5, 5], 2, groups=groups, equal_count=True)
    assert [len(p) for p in parts] == [4, 4]
    for p in parts:
        assert all(groups[i] in {groups[j] for j in p} for i in p)
        assert len({groups[i] for i in p}) * 2 == len(p)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (([1, 2], 0), {}),
        (([1, -2], 2), {}),
        (([1, 2], 2), {"cost": "flops"}),
        (([1, 2], 2), {"groups": [1]}),
        (([1, 1, 1], 2), {"groups": [1, 1, 2], "equal_count": True}),
        (([1, 2], 2), {"method": "magic"}),
    ],
)
def test_bad_partition_requests_raise_bad_request(args: tuple, kwargs: dict) -> None:
    with pytest.raises(af.BadRequestError):
        partition(*args, **kwargs)


@settings(max_examples=150, deadline=None)
@given(lengths=LENGTHS, k=st.integers(1, 40), equal_count=st.booleans())
def test_every_partition_is_a_permutation_of_its_input(
    lengths: list[int], k: int, equal_count: bool
) -> None:
    parts = partition(lengths, k, equal_count=equal_count)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    if equal_count:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=150, deadline=None)
@given(
    lengths=LENGTHS,
    k=st.integers(1, 40),
    equal_count=st.booleans(),
    cost=st.sampled_from(["tokens", "attention"]),
)
def test_the_default_method_is_never_worse_than_greedy_lpt(
    lengths: list[int], k: int, equal_count: bool, cost: Cost
) -> None:
    values = costs(lengths, cost)
    ours = max(part_costs(values, partition(lengths, k, cost, equal_count=equal_count)))
    lpt = partition(lengths, k, cost, equal_count=equal_count, method="lpt")
    assert ours <= max(part_costs(values, lpt))
    lower_bound = max([values.sum() / k, *values]) if lengths else 0.0
    assert ours >= lower_bound * (1 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), max_size=50),
    k=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_of_a_group_always_share_a_part(sizes: list[int], k: int, seed: int) -> None:
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    lengths = np.random.default_rng(seed).integers(0, 5_000, len(groups))
    parts = partition(lengths, k, groups=groups)
    part_of = {i: n for n, p in enumerate(parts) for i in p}
    for g in set(groups):
        assert len({part_of[i] for i, x in enumerate(groups) if x == g}) == 1


def test_micro_batches_fit_the_budget_and_come_costliest_first() -> None:
    lengths = [900, 100, 500, 500, 300, 700, 200, 800]
    batches = micro_batches(lengths, 1000)
    assert len(batches) == 4
    tokens = [sum(lengths[i] for i in b) for b in batches]
    assert all(t <= 1000 for t in tokens) and tokens == sorted(tokens, reverse=True)


def test_min_count_lets_every_rank_run_the_same_number_of_micro_batches() -> None:
    assert len(micro_batches([10, 20], 1000, min_count=3)) == 3


def test_a_row_longer_than_the_budget_raises_bad_request() -> None:
    with pytest.raises(af.BadRequestError):
        micro_batches([50, 101], 100)


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 1_000), max_size=150),
    max_tokens=st.integers(1_000, 5_000),
    cost=st.sampled_from(["tokens", "attention"]),
)
def test_micro_batches_partition_the_rows_under_the_budget(
    lengths: list[int], max_tokens: int, cost: Cost
) -> None:
    batches = micro_batches(lengths, max_tokens, cost)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= max_tokens for b in batches)


def test_the_router_sends_work_to_the_least_loaded_engine() -> None:
    router = Router(["a", "b", "c"], heartbeat_timeout=5.0, now=0.0)
    router.report("a", tokens=900, requests=3, now=0.0)
    router.report("b", tokens=100, requests=9, now=0.0)
    router.report("c", tokens=500, requests=1, now=0.0)
    assert router.route(1, tokens=50, now=0.0) == "b"
    assert router.engines()[1].tokens == 150


def test_the_router_spreads_a_burst_between_reports() -> None:
    router = Router(["a", "b"], heartbeat_timeout=5.0, now=0.0)
    assert [router.route(w, tokens=100, now=0.0) for w in range(4)] == ["a", "b", "a", "b"]


def test_a_silent_engine_is_taken_out_and_its_work_rerouted() -> None:
    router = Router(["a", "b"], heartbeat_timeout=5.0, now=0.0)
    assert router.route(7, tokens=100, now=0.0) == "a"
    router.report("b", tokens=0, requests=0, now=4.0)
    moved = router.expire(now=5.0)
    assert moved == [af.scheduler.Rerouted(work=7, source="a", to="b")]
    assert router.assigned_to(7) == "b"
    assert not router.engines()[0].in_rotation
    router.report("a", tokens=0, requests=0, now=6.0)
    assert router.engines()[0].in_rotation, "a report brings it back"


def test_completing_work_frees_it_and_unknown_work_is_a_bad_request() -> None:
    router = Router(["a"], heartbeat_timeout=5.0, now=0.0)
    router.route(1, tokens=10, now=0.0)
    assert router.complete(1) == "a"
    with pytest.raises(af.BadRequestError):
        router.complete(1)
    with pytest.raises(af.BadRequestError):
        router.report("nope", tokens=0, requests=0, now=0.0)


def test_with_no_engine_live_nothing_is_routed() -> None:
    router = Router(["a"], heartbeat_timeout=1.0, now=0.0)
    assert router.route(1, tokens=10, now=2.0) is None
