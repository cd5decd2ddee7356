"""The built-in task, its tokenizer, prompt rendering, and datasets read from local files."""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import threading
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from asyncflow.cli import main
from asyncflow.config import ConfigError, DataConfig
from asyncflow.config import load as load_config
from asyncflow.models.chatml import save_chatml_tokenizer
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.tasks import gsm_synthetic
from asyncflow.tasks.arithmetic import (
    ArithmeticTask,
    LongTailAdditionTask,
    add_dropping_carries,
    has_carry,
    scratchpad,
)
from asyncflow.tasks.base import Problem
from asyncflow.tasks.dataset import read_problems
from asyncflow.tasks.loader import load_task
from asyncflow.tasks.prompts import PromptEncoder, PromptError
from asyncflow.tasks.records import DatasetError
from asyncflow.train import prompt_budget
from asyncflow.workers.reward import (
    exact_match,
    gsm8k_match,
    numeric_match,
    pack_answer,
    resolve_reward,
    unpack_answer,
)


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


def test_a_scratchpad_works_each_column_and_ends_with_the_sum_its_columns_give() -> None:
    assert scratchpad(37, 48, 2, [False, False]) == "7+8=15\n3+4+1=8\n#### 85"
    assert scratchpad(37, 48, 2, [True, False]) == "7+8=15\n3+4=7\n#### 75"
    assert scratchpad(999, 1, 3, [False] * 3) == "9+1=10\n9+0+1=10\n9+0+1=10\n#### 1000"
    assert gsm8k_match(scratchpad(999, 1, 3, [False] * 3), "1000") == 1.0


def test_the_long_tail_task_halves_each_extra_digit_and_holds_its_problems_out() -> None:
    task = LongTailAdditionTask(max_digits=6, eval_size=200)
    held_out = [tuple(map(int, p.prompt[:-1].split("+"))) for p in task.eval_set()]
    assert len({(min(a, b), max(a, b)) for a, b in held_out}) == 200
    stream = task.train_stream(seed=0)
    train = [tuple(map(int, next(stream).prompt[:-1].split("+"))) for _ in range(20000)]
    assert not {(min(a, b), max(a, b)) for a, b in train} & set(task._held)
    digits = [len(str(a)) for a, b in train]
    assert all(len(str(b)) == d for (_, b), d in zip(train, digits, strict=True))
    share = {d: digits.count(d) / len(digits) for d in range(2, 7)}
    expected = {d: 0.5 ** (d - 2) / sum(0.5**k for k in range(5)) for d in range(2, 7)}
    for d in range(2, 7):
        assert abs(share[d] - expected[d]) < 0.015, (d, share[d])
    # Responses grow with the operands: 23 tokens (with the eos) at 2 digits, 65 at 6.
    rng = random.Random(0)
    longest = task.demonstration(task.longest_prompt(), rng, 0.0)
    assert len(longest) + 1 == 65 and gsm8k_match(longest, task.longest_prompt().answer) == 1.0


def test_the_long_tail_task_needs_a_reward_that_reads_its_final_line() -> None:
    with pytest.raises(ConfigError, match=r"reward\.fn: gsm8k"):
        load_config(None, ["data.task=addition-longtail", "data.digits=6"])
    with pytest.raises(ConfigError, match=r"data\.digits of at least 3"):
        load_config(None, ["data.task=addition-longtail", "reward.fn=gsm8k"])


def test_the_built_in_tokenizer_loads_through_auto_tokenizer_with_a_chatml_template(
    tmp_path: Path,
) -> None:
    save_chatml_tokenizer(tmp_path)
    assert not (tmp_path / "asyncflow_tiny.json").exists()
    tok = load_tokenizer(tmp_path)  # AutoTokenizer, like any model's
    ids = tok.encode("37+48=")
    assert tok.decode([*ids, tok.eos_id, *tok.encode("99")]) == "37+48="
    assert tok.has_chat_template
    chat = tok.encode_chat([{"role": "user", "content": "37+48="}])
    text = tok._tok.decode(chat)
    assert text == "<|im_start|>user\n37+48=<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_id == tok._tok.convert_tokens_to_ids("<|im_end|>")


def test_text_read_without_special_tokens_leaves_other_threads_encodings_alone(
    tmp_path: Path,
) -> None:
    # A tool's output is read as plain text in the agent loop while the feeder encodes prompts
    # with their special tokens, in another thread, through the same tokenizer.
    save_chatml_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "<|im_start|>user\n4266*1014=<|im_end|>\n"
    expected = {True: tok.encode(text), False: tok.encode(text, special=False)}
    assert len(expected[True]) < len(expected[False])  # the tokens, or their characters
    wrong: list[bool] = []

    def encode_many(special: bool) -> None:
        for _ in range(20_000):
            if tok.encode(text, special=special) != expected[special]:
                wrong.append(special)
                return

    threads = [threading.Thread(target=encode_many, args=(s,)) for s in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def encoder(tmp_path: Path, **data: object) -> PromptEncoder:
    if not (tmp_path / "tokenizer.json").exists():
        save_chatml_tokenizer(tmp_path)
    config = DataConfig(**data)  # type: ignore[arg-type]
    return PromptEncoder.for_data(load_tokenizer(tmp_path), config, config.max_prompt_length)


def test_chats_keep_every_message_and_get_the_system_prompt_only_where_none(
    tmp_path: Path,
) -> None:
    prompts = encoder(tmp_path, system_prompt="Add.")
    render = prompts.tokenizer._tok.decode  # type: ignore[attr-defined]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
    ]
    assert render(prompts.encode(chat)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(prompts.encode("3+3=")) == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n3+3=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_plain_text_is_encoded_as_it_is_when_the_template_is_off(tmp_path: Path) -> None:
    off = encoder(tmp_path, chat_template=False)
    assert off.encode("3+3=") == off.tokenizer.encode("3+3=")
    with pytest.raises(PromptError, match="is a chat"):
        off.encode([{"role": "user", "content": "3+3="}])


def test_long_prompts_are_cut_from_the_left_on_request(tmp_path: Path) -> None:
    cut = encoder(tmp_path, chat_template=False, max_prompt_length=4, truncation="truncate_left")
    assert cut.encode("12345678") == cut.tokenizer.encode("5678")


def write_rows(path: Path, rows: list[dict[str, object]]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


def sums(count: int) -> list[dict[str, object]]:
    return [
        {
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(count)
    ]


@pytest.mark.parametrize("name", ["train.parquet", "train.jsonl", "train.json"])
def test_datasets_with_verl_columns_from_parquet_and_json(tmp_path: Path, name: str) -> None:
    path = write_rows(tmp_path / name, sums(30))
    data = DataConfig(task="dataset", train_file=str(path), eval_size=10)
    task = load_task(data, encoder(tmp_path / "tok"))
    assert len(task.eval_set()) == 10
    first = next(task.train_stream(seed=0))
    assert isinstance(first.prompt, list)
    assert int(first.answer) == int(first.prompt[0]["content"][:-3]) + 1


def test_a_directory_saved_by_hugging_face_datasets_is_read(tmp_path: Path) -> None:
    # Written by datasets 5.2 (Dataset.from_list(...).save_to_disk): three rows asking 1+1=.
    saved = Path(__file__).parents[1] / "data" / "hf_save_to_disk"
    data = DataConfig(
        task="dataset", train_file=str(saved), eval_size=1, extra_keys=["extra_info.index"]
    )
    rows, too_long = read_problems(saved, data, encoder(tmp_path))
    assert [(r.answer, dict(r.extra)) for r in rows] == [
        ("2", {"extra_info.index": i}) for i in range(3)
    ]
    assert too_long == 0
    assert rows[0].prompt == [{"role": "user", "content": "1+1="}]


def test_prompts_over_the_limit_are_left_out_and_counted(tmp_path: Path) -> None:
    rows = sums(12) + [
        {"prompt": "9" * 80 + "+1=", "reward_model": {"ground_truth": "1"}} for _ in range(3)
    ]
    path = write_rows(tmp_path / "train.jsonl", rows)
    data = DataConfig(task="dataset", train_file=str(path), eval_size=2, max_prompt_length=40)
    task = load_task(data, encoder(tmp_path / "tok", max_prompt_length=40))
    assert getattr(task, "too_long", None) == {"train": 3}
    assert all(len(str(p.prompt)) < 80 for p in task.eval_set())


def test_held_out_rows_are_not_trained_on_even_when_repeated(tmp_path: Path) -> None:
    prompts = [f"{i % 12}+1=" for i in range(40)]  # every prompt appears 3 or 4 times
    rows = [{"prompt": p, "reward_model": {"ground_truth": p[:-1]}} for p in prompts]
    path = write_rows(tmp_path / "train.parquet", rows)
    task = load_task(
        DataConfig(task="parquet", train_file=str(path), eval_size=5), encoder(tmp_path / "t")
    )
    held_out = [p.prompt for p in task.eval_set()]
    stream = task.train_stream(seed=0)
    trained = {next(stream).prompt for _ in range(200)}
    assert len(set(held_out)) == 5 and held_out == sorted(held_out, key=prompts.index)
    assert trained == set(prompts) - set(held_out)


def test_the_held_out_prompts_are_drawn_from_the_whole_file_the_same_for_every_run(
    tmp_path: Path,
) -> None:
    """Not the file's first rows: a file sorted by kind would hold out its first kind only."""
    rows = [
        {"prompt": f"{kind} {i}", "reward_model": {"ground_truth": "1"}}
        for kind in ("easy", "hard")
        for i in range(50)
    ]
    path = write_rows(tmp_path / "train.jsonl", rows)
    data = DataConfig(task="dataset", train_file=str(path), eval_size=20)
    held_out = [[str(p.prompt) for p in load_task(data, encoder(tmp_path / "t")).eval_set()]]
    held_out.append([str(p.prompt) for p in load_task(data, encoder(tmp_path / "t")).eval_set()])
    assert held_out[0] == held_out[1]
    kinds = [p.split()[0] for p in held_out[0]]
    assert 0 < kinds.count("easy") < 20


def test_a_dataset_without_training_rows_left_is_refused(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}] * 2
    path = write_rows(tmp_path / "train.parquet", rows)
    with pytest.raises(ConfigError, match="no training rows left"):
        load_task(
            DataConfig(task="parquet", train_file=str(path), eval_size=1), encoder(tmp_path / "t")
        )


BAD_ROWS = {
    "no user message": (
        {"prompt": [{"role": "system", "content": "Be brief."}]},
        r"train.jsonl row 3 key 'prompt': the chat has no user message",
    ),
    "prompt of the wrong type": (
        {"prompt": 42},
        r"train.jsonl row 3 key 'prompt': a prompt is text or a list .* not int",
    ),
    "message without content": (
        {"prompt": [{"role": "user"}]},
        r"train.jsonl row 3 key 'prompt': message 0 needs a string 'role' and 'content'",
    ),
    "answer missing": (
        {"prompt": "1+1=", "reward_model": {}},
        r"train.jsonl row 3 has no 'reward_model.ground_truth'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_are_refused_naming_file_row_and_key(tmp_path: Path, case: str) -> None:
    bad, message = BAD_ROWS[case]
    rows: list[dict[str, object]] = sums(6)
    rows[3] = {"reward_model": {"ground_truth": "2"}, **bad}
    path = write_rows(tmp_path / "train.jsonl", rows)
    data = DataConfig(task="dataset", train_file=str(path), eval_size=1)
    with pytest.raises(DatasetError, match=message):
        load_task(data, encoder(tmp_path / "tok"))


def test_a_template_that_fails_to_render_is_refused_naming_the_row(tmp_path: Path) -> None:
    save_chatml_tokenizer(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tok" / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    rows = sums(4)
    rows[2]["prompt"] = [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]
    path = write_rows(tmp_path / "train.parquet", rows)
    data = DataConfig(task="dataset", train_file=str(path), eval_size=1)
    with pytest.raises(
        DatasetError,
        match=r"train.parquet row 2 key 'prompt': the chat template failed.*tool messages",
    ):
        load_task(data, encoder(tmp_path / "tok"))


def test_a_file_left_empty_by_the_length_filter_is_refused(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "train.jsonl", sums(5))
    data = DataConfig(task="dataset", train_file=str(path), eval_size=1, max_prompt_length=3)
    with pytest.raises(DatasetError, match=r"train.jsonl: no row is left once the 5 prompts"):
        load_task(data, encoder(tmp_path / "tok", max_prompt_length=3))


def test_the_reward_function_gets_the_extra_keys() -> None:
    problem = Problem("1+1=", "2", {"extra_info.index": 7})
    assert unpack_answer(pack_answer(problem, True), True) == ("2", {"extra_info.index": 7})
    assert unpack_answer(pack_answer(problem, False), False) == ("2", {})


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("so 3, then 85.", "85", 1.0),
        ("The answer is 1,234", "1,234", 1.0),
        ("The answer is 1234", "1,234", 1.0),
        ("The answer is 1,234", "1234", 1.0),
        ("it is -2.5", "-2.5", 1.0),
        ("1,234 or maybe 12", "1234", 0.0),
        ("no number", "3", 0.0),
        ("3", "three", 0.0),
        # Commas between groups of three digits only: a list of digits is no number.
        ("the digits are 2,3", "23", 0.0),
        ("the digits are 2,3", "3", 1.0),
        ("1,2345", "12345", 0.0),
        ("so 1,000,000.", "1000000", 1.0),
    ],
)
def test_numeric_match_reads_thousands_separators_on_both_sides(
    response: str, truth: str, score: float
) -> None:
    assert numeric_match(response, truth) == score


def test_gsm8k_reads_only_a_number_after_its_final_line_marker() -> None:
    assert gsm8k_match("#### 1,000", "1000") == 1.0
    assert gsm8k_match("#### 1,0", "10") == 0.0


def test_a_dataset_reads_as_its_reward_function_will_see_it(tmp_path: Path) -> None:
    """A whole number read as a float is its integer's text; extra values are what JSON holds,
    the same in held-out evaluation as in training, and one JSON cannot hold is refused."""
    rows = [{"prompt": f"{i}+1=", "answer": float(i + 1), "info": {"i": i}} for i in range(3)]
    data = DataConfig(
        task="dataset", train_file="", answer_key="answer", extra_keys=["info"], eval_size=1
    )
    problems, _ = read_problems(write_rows(tmp_path / "t.parquet", rows), data, encoder(tmp_path))
    assert [(p.answer, dict(p.extra)) for p in problems] == [
        (str(i + 1), {"info": {"i": i}}) for i in range(3)
    ]
    again = unpack_answer(pack_answer(problems[0], True), True)
    assert again == (problems[0].answer, dict(problems[0].extra))
    dated = [{"prompt": "1+1=", "answer": "2", "info": dt.date(2026, 1, 1)}]
    with pytest.raises(DatasetError, match=r"row 0 key 'info': an extra value must be"):
        read_problems(write_rows(tmp_path / "d.parquet", dated), data, encoder(tmp_path))


def test_rewards_by_name_or_import_path() -> None:
    assert exact_match(" 85 ", "85") == 1.0 and exact_match("84", "85") == 0.0
    assert numeric_match("the answer is 85", "85") == 1.0
    assert resolve_reward("asyncflow.workers.reward:numeric_match") is numeric_match
    with pytest.raises(ValueError, match="unknown reward"):
        resolve_reward("nope")


def test_gsm8k_scoring_reads_the_number_after_the_last_final_answer_mark() -> None:
    assert gsm8k_match("3*4=12. 12+5=17.\n#### 17", "17") == 1.0
    assert gsm8k_match("#### 1,234", "1234") == 1.0
    assert gsm8k_match("#### 16 ... #### 17", "17") == 1.0
    assert gsm8k_match("the answer is 17", "17") == 0.0, "no final-answer line, no credit"
    assert gsm8k_match("#### 18", "17") == 0.0
    assert resolve_reward("gsm8k") is gsm8k_match


OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}


def test_gsm_synthetic_solutions_are_right_and_the_splits_disjoint(tmp_path: Path) -> None:
    rows = gsm_synthetic.problems(seed=3, count=300)
    assert gsm_synthetic.problems(seed=3, count=300) == rows, "reproducible"
    for row in rows:
        solution, truth = row["extra_info"]["solution"], row["reward_model"]["ground_truth"]
        steps = re.findall(r"(\d+)([-+*/])(\d+)=(\d+)", solution)
        assert len(steps) >= 2
        for a, op, b, result in steps:
            assert OPERATIONS[op](int(a), int(b)) == int(result), solution
        assert gsm8k_match(solution, truth) == 1.0 and int(truth) >= 0
    assert main(["data", "make", "gsm-synthetic", "--out", str(tmp_path), "--train", "50"]) == 0
    train, test = (
        pq.read_table(tmp_path / f).to_pylist() for f in ("train.parquet", "test.parquet")
    )
    assert (len(train), len(test)) == (50, 200)
    asked = {r["prompt"][0]["content"] for r in train}
    assert not asked & {r["prompt"][0]["content"] for r in test}


def test_the_warm_start_demonstrates_a_worked_answer_column(tmp_path: Path) -> None:
    rows = gsm_synthetic.problems(seed=0, count=5)
    path = write_rows(tmp_path / "train.parquet", rows)
    data = DataConfig(task="dataset", train_file=str(path), demonstration_key="extra_info.solution")
    problems, _ = read_problems(path, data, encoder(tmp_path / "tok"))
    assert [p.demonstration for p in problems] == [r["extra_info"]["solution"] for r in rows]


def test_the_prompt_budget_is_the_tightest_bound_on_a_sample(tmp_path: Path) -> None:
    """A prompt the trainer's micro-batch could not hold with its response is left out when the
    data is read (it failed the run mid-way before), and a multimodal model's positions are read
    from its language model's section."""
    (tmp_path / "config.json").write_text('{"text_config": {"max_position_embeddings": 8192}}')
    sizes = ["model.max_positions=16384", "rollout.max_tokens=100"]
    assert prompt_budget(load_config(None, sizes), tmp_path) == 4096 - 100  # the micro-batch
    wider = [*sizes, "trainer.micro_batch_tokens=16384"]
    assert prompt_budget(load_config(None, wider), tmp_path) == 8192 - 100  # the positions
    assert prompt_budget(load_config(None, [*wider, "rollout.max_model_len=1000"]), tmp_path) == 900
    # A length of one's own may not be more: the engine would cut its responses short.
    within = [*wider, "rollout.max_model_len=1000", "data.max_prompt_length=900"]
    assert prompt_budget(load_config(None, within), tmp_path) == 900
    beyond = [*wider, "rollout.max_model_len=1000", "data.max_prompt_length=901"]
    with pytest.raises(ConfigError, match=r"max_prompt_length \(901\) .* at most 900"):
        prompt_budget(load_config(None, beyond), tmp_path)
    (tmp_path / "config.json").write_text('{"n_positions": 256}')  # GPT-2's name for it
    assert prompt_budget(load_config(None, wider), tmp_path) == 256 - 100


def test_a_prompt_with_no_tokens_is_refused_naming_its_row(tmp_path: Path) -> None:
    rows = [{**r, "prompt": f"{i}+1="} for i, r in enumerate(sums(3))]
    rows[1]["prompt"] = ""
    path = write_rows(tmp_path / "train.jsonl", rows)
    data = DataConfig(task="dataset", train_file=str(path), eval_size=1, chat_template=False)
    with pytest.raises(DatasetError, match=r"train.jsonl row 1 key 'prompt': the prompt has no"):
        load_task(data, encoder(tmp_path / "tok", chat_template=False))


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "a\x85b", "é"])
@pytest.mark.parametrize("bom", [False, True])
def test_json_lines_with_any_unicode_are_read(tmp_path: Path, text: str, bom: bool) -> None:
    """Characters that end a line for Python but not for JSON lines (written unescaped by
    ``ensure_ascii=False``), and a byte-order mark."""
    rows = [{"prompt": f"{text} {i}", "reward_model": {"ground_truth": "1"}} for i in range(2)]
    lines = "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
    path = tmp_path / "t.jsonl"
    path.write_bytes(("\ufeff" if bom else "").encode() + lines.encode())
    data = DataConfig(task="dataset", train_file=str(path), eval_size=1)
    problems, _ = read_problems(path, data, encoder(tmp_path / "tok"))
    assert [p.prompt for p in problems] == [r["prompt"] for r in rows]


def test_json_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(
        '{"prompt": "caf\xe9", "reward_model": {"ground_truth": "1"}}'.encode("latin-1")
    )
    data = DataConfig(task="dataset", train_file=str(path), eval_size=1)
    with pytest.raises(DatasetError, match=r"t.jsonl: JSON must be UTF-8"):
        read_problems(path, data, encoder(tmp_path / "tok"))


def bos_adding_tokenizer(d: Path) -> Path:
    """A tokenizer that starts every text with ``<s>`` by itself (a post-processor, as Llama's
    and Gemma's do), one character a token, and a chat template that writes the BOS itself."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate([*specials, *"0123456789+=[]/INST "])}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True) for t in specials])
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    template = "{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    template += "{% endfor %}"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=template,
    )
    fast.save_pretrained(str(d))
    return d


@pytest.mark.parametrize("chat_template", ["auto", False])
def test_a_prompt_starts_with_the_bos_its_tokenizer_adds_once(
    tmp_path: Path, chat_template: Literal["auto"] | bool
) -> None:
    """A plain-text prompt gets the BOS the model's tokenizer adds, as vLLM gives a text prompt;
    a chat rendered by a template that writes it has it once."""
    tok = load_tokenizer(bos_adding_tokenizer(tmp_path))
    data = DataConfig(chat_template=chat_template)
    ids = PromptEncoder.for_data(tok, data, None).encode("2+2=")
    assert ids[0] == 1 and ids.count(1) == 1


def test_training_rows_that_ask_a_held_out_prompt_are_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train = write_rows(tmp_path / "train.jsonl", sums(10))
    test = write_rows(tmp_path / "test.jsonl", sums(10)[7:])
    data = DataConfig(task="dataset", train_file=str(train), eval_file=str(test))
    task = load_task(data, encoder(tmp_path / "tok"))
    stream = task.train_stream(seed=0)
    trained = {str(next(stream).prompt) for _ in range(100)}
    assert trained == {str(p) for p in (r["prompt"] for r in sums(7))}
    assert "3 rows of" in caplog.text


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    # The command line reports a ConfigError as invalid configuration; a ValueError as a
    # traceback.
    with pytest.raises(ConfigError, match="holds no Hugging Face tokenizer"):
        load_tokenizer(tmp_path)
