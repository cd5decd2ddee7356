"""The built-in task and parquet datasets."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncflow.config import ConfigError, DataConfig
from asyncflow.models.tokenizer import CharTokenizer
from asyncflow.tasks import load_task
from asyncflow.tasks.arithmetic import ArithmeticTask, add_dropping_carries, has_carry
from asyncflow.tasks.base import Problem
from asyncflow.workers.reward import exact_match, numeric_match, resolve_reward


def test_dropping_carries_reproduces_the_classic_mistake() -> None:
    assert add_dropping_carries(37, 48, 2, [False, False]) == 85
    assert add_dropping_carries(37, 48, 2, [True, False]) == 75
    assert add_dropping_carries(99, 99, 2, [False, True]) == 98
    assert has_carry(37, 48, 2) and not has_carry(12, 34, 2)


def test_held_out_problems_never_appear_in_training() -> None:
    task = ArithmeticTask(digits=2, eval_size=100)
    held_out = {p.prompt for p in task.eval_set()}
    stream = task.train_stream(seed=3)
    seen = {next(stream).prompt for _ in range(5000)}
    assert len(held_out) == 100 and not held_out & seen


def test_no_held_out_problem_has_its_commuted_twin_in_training() -> None:
    task = ArithmeticTask(digits=2, eval_size=500)
    train = {(a, b) for a, b in task._train}
    held_out = [tuple(map(int, p.prompt[:-1].split("+"))) for p in task.eval_set()]
    assert len(set(held_out)) == 500
    assert not [(a, b) for a, b in held_out if (a, b) in train or (b, a) in train]
    # Every other problem is trained on, in both orders.
    assert len(train) == 90 * 90 - sum(1 if a == b else 2 for a, b in held_out)


def test_training_streams_are_reproducible_and_resumable() -> None:
    task = ArithmeticTask(digits=2, eval_size=50)
    first = [next(iter_) for iter_ in [task.train_stream(seed=1)] for _ in range(20)]
    again = task.train_stream(seed=1)
    assert [next(again) for _ in range(20)] == first
    resumed = task.train_stream(seed=1, start=12)
    assert [next(resumed) for _ in range(8)] == first[12:]


def test_demonstrations_drop_carries_at_the_requested_rate() -> None:
    task = ArithmeticTask(digits=2, eval_size=50)
    # One carry (out of the units), so a demonstration is wrong exactly when it drops it.
    problem = Problem("37+48=", "85")
    rng = random.Random(0)
    wrong = sum(task.demonstration(problem, rng, 0.6) != problem.answer for _ in range(2000))
    assert 0.5 < wrong / 2000 < 0.7


def test_char_tokenizer_round_trips_and_stops_at_eos(tmp_path: Path) -> None:
    tok = CharTokenizer()
    ids = tok.encode("37+48=")
    assert tok.decode([*ids, tok.eos_id, *tok.encode("99")]) == "37+48="
    tok.save(tmp_path)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode("37+48=", add_special_tokens=False) == ids
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("x")


def test_parquet_datasets_with_verl_columns(tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(30)],
            "reward_model": [{"ground_truth": str(i + 1)} for i in range(30)],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    task = load_task(DataConfig(task="parquet", train_file=str(path), eval_size=10))
    assert len(task.eval_set()) == 10
    first = next(task.train_stream(seed=0))
    assert first.prompt.endswith("+1=") and int(first.answer) == int(first.prompt[:-3]) + 1


def test_parquet_held_out_rows_are_not_trained_on_even_when_repeated(tmp_path: Path) -> None:
    prompts = [f"{i % 12}+1=" for i in range(40)]  # every prompt appears 3 or 4 times
    table = pa.table(
        {"prompt": prompts, "reward_model": [{"ground_truth": p[:-1]} for p in prompts]}
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    task = load_task(DataConfig(task="parquet", train_file=str(path), eval_size=5))
    held_out = [p.prompt for p in task.eval_set()]
    stream = task.train_stream(seed=0)
    trained = {next(stream).prompt for _ in range(200)}
    assert held_out == [f"{i}+1=" for i in range(5)]
    assert trained == {f"{i}+1=" for i in range(5, 12)}


def test_parquet_without_training_rows_left_is_refused(tmp_path: Path) -> None:
    table = pa.table({"prompt": ["1+1=", "1+1="], "reward_model": [{"ground_truth": "2"}] * 2})
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    with pytest.raises(ConfigError, match="no training rows left"):
        load_task(DataConfig(task="parquet", train_file=str(path), eval_size=1))


def test_rewards_by_name_or_import_path() -> None:
    assert exact_match(" 85 ", "85") == 1.0 and exact_match("84", "85") == 0.0
    assert numeric_match("the answer is 85", "85") == 1.0
    assert resolve_reward("asyncflow.workers.reward:numeric_match") is numeric_match
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nope")
