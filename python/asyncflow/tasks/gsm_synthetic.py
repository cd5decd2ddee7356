"""GSM8K-style word problems generated locally: templated people, items and numbers, two to four
arithmetic steps, each with its worked solution ending in ``#### <answer>`` as GSM8K writes it.
Written as parquet with verl's columns by ``asyncflow data make gsm-synthetic --out DIR``;
verified by the ``gsm8k`` reward (:func:`asyncflow.workers.reward.gsm8k_match`).

Every answer is a whole number of at least 0, and no question of the test split is asked in the
training split.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

NAMES = ["Ava", "Ben", "Cora", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
ITEMS = ["apples", "books", "cards", "eggs", "pens", "shells", "stamps", "marbles", "cups"]
INSTRUCTION = "Solve it step by step, then give the final answer after ####."

#: (question, solution, answer) from a random generator.
Template = Callable[[random.Random], tuple[str, str, int]]


def _buy_and_give(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    have, packs, per, give = r.randint(2, 20), r.randint(2, 5), r.randint(2, 9), r.randint(1, 9)
    bought = packs * per
    total = have + bought
    answer = total - give
    question = (
        f"{name} has {have} {item}. {name} buys {packs} packs of {per} {item} each, then gives "
        f"away {give}. How many {item} does {name} have now?"
    )
    solution = (
        f"{packs}*{per}={bought}. {have}+{bought}={total}. {total}-{give}={answer}.\n#### {answer}"
    )
    return question, solution, answer


def _share(r: random.Random) -> tuple[str, str, int]:
    a, b, item = r.choice(NAMES), r.choice(NAMES), r.choice(ITEMS)
    friends, each, extra = r.randint(2, 6), r.randint(2, 9), r.randint(1, 12)
    total = friends * each + extra
    shared = friends * each
    answer = each
    question = (
        f"{a} and {b} collect {total} {item}. They keep {extra} and share the rest equally among "
        f"{friends} friends. How many {item} does each friend get?"
    )
    solution = f"{total}-{extra}={shared}. {shared}/{friends}={answer}.\n#### {answer}"
    return question, solution, answer


def _cost(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    count, price, paid_extra = r.randint(2, 9), r.randint(2, 12), r.randint(1, 20)
    cost = count * price
    paid = cost + paid_extra
    answer = paid - cost
    question = (
        f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. "
        "How much change does " + name + " get?"
    )
    solution = f"{count}*{price}={cost}. {paid}-{cost}={answer}.\n#### {answer}"
    return question, solution, answer


def _weeks(r: random.Random) -> tuple[str, str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    per_day, days, weeks, lost = r.randint(2, 9), r.randint(2, 6), r.randint(2, 4), r.randint(1, 9)
    week = per_day * days
    total = week * weeks
    answer = total - lost
    question = (
        f"{name} makes {per_day} {item} a day, {days} days a week, for {weeks} weeks, and loses "
        f"{lost} of them. How many {item} are left?"
    )
    solution = (
        f"{per_day}*{days}={week}. {week}*{weeks}={total}. {total}-{lost}={answer}.\n#### {answer}"
    )
    return question, solution, answer


TEMPLATES: list[Template] = [_buy_and_give, _share, _cost, _weeks]


def problems(seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` distinct problems as verl-style rows."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < count:
        question, solution, answer = rng.choice(TEMPLATES)(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "reward_model": {"ground_truth": str(answer)},
                "extra_info": {"index": len(rows), "solution": solution},
            }
        )
    return rows


def write(out: Path, train: int = 4000, test: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """Writes ``train.parquet`` and ``test.parquet`` (no question in both) into ``out``."""
    rows = problems(seed, train + test)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows[test:]), paths[0])
    pq.write_table(pa.Table.from_pylist(rows[:test]), paths[1])
    return paths
