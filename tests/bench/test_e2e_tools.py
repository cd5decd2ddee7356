"""The tools cases of the e2e suite: TRL's tool support gets the job's conversation format,
tools and answers; the suite's time-to-accuracy arithmetic."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncflow.agents.env import ToolEnvironment
from asyncflow.agents.parser import ToolCall, format_call
from asyncflow.agents.tools import create_tool
from asyncflow.bench import e2e_suite
from asyncflow.bench.e2e_suite import ToolsResult
from asyncflow.bench.records import Report
from asyncflow.bench.trl_peer import (
    check_answers_read,
    last_answer,
    response_template,
    trl_tools,
)
from asyncflow.cli import main
from asyncflow.config import AgentConfig, ModelConfig, load
from asyncflow.daemon import TOKEN_ENV
from asyncflow.models.chatml import _fast_tokenizer
from asyncflow.models.tiny import create_tiny_model
from asyncflow.tasks.base import Problem
from asyncflow.tasks.multiply_tools import MultiplyToolsTask

CALL = {
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "12*34"}},
}


def test_the_builtin_template_renders_a_tool_exchange_as_the_agent_loop_writes_it() -> None:
    tokenizer = _fast_tokenizer()
    prompt = [{"role": "user", "content": "12*34="}]
    chat = [
        *prompt,
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    opened = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    # A faultless demonstration of the task (call, the tool's answer, the answer copied) is
    # what the agent loop's trajectory of it reads.
    task = MultiplyToolsTask(eval_size=1)
    demonstration = task.demonstration(Problem("12*34=", "408"), random.Random(0), 0.0)
    assert rendered == opened + demonstration + "<|im_end|>\n"
    # Arguments given as a JSON string (OpenAI's form) are written as they are.
    as_string = {"type": "function", "function": {**CALL["function"], "arguments": '{"a":1}'}}
    call = tokenizer.apply_chat_template(
        [{"role": "assistant", "content": "", "tool_calls": [as_string]}], tokenize=False
    )
    assert '"arguments":{"a":1}}</tool_call>' in call


def test_the_builtin_template_renders_plain_messages_as_chatml_with_or_without_tools() -> None:
    tokenizer = _fast_tokenizer()
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": ""},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1=<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    for offered in (None, tools):
        assert tokenizer.apply_chat_template(chat, tools=offered, tokenize=False) == expected
        opened = tokenizer.apply_chat_template(
            chat, tools=offered, tokenize=False, add_generation_prompt=True
        )
        assert opened == expected + "<|im_start|>assistant\n"


def _tokenizer_as_runs_load_it(directory: Path) -> Any:
    """The built-in model's tokenizer as transformers loads it from a model directory (not as
    it is built in memory: for a Qwen2 model transformers reads it as a Qwen2 tokenizer)."""
    from transformers import AutoTokenizer

    create_tiny_model(ModelConfig(), directory, seed=0)
    return AutoTokenizer.from_pretrained(directory)


# TRL 1.16 warns about vLLM 0.32, which this test does not use.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM")
def test_trl_accepts_the_template_and_continues_a_call_with_the_jobs_observation_tokens(
    tmp_path: Path,
) -> None:
    # Imported here: importing TRL takes seconds.
    from trl import GRPOTrainer  # noqa: PLC0415
    from trl.chat_template_utils import (  # noqa: PLC0415
        is_chat_template_prefix_preserving,
        parse_response,
        supports_tool_calling,
    )

    tokenizer = _tokenizer_as_runs_load_it(tmp_path)
    assert supports_tool_calling(tokenizer) and is_chat_template_prefix_preserving(tokenizer)
    # The tokens TRL appends after a call's eos, computed as its trainer computes them.
    trainer = SimpleNamespace(
        processing_class=tokenizer,
        chat_template=None,
        chat_template_kwargs={},
        _is_vlm=False,
        _tokenizer=tokenizer,
    )
    tool = [{"role": "tool", "name": "calculator", "content": "408"}]
    suffix = GRPOTrainer._get_tool_suffix_ids(trainer, tool)
    template = AgentConfig().observation_template
    observation = template.format(observation="<tool_response>\n408\n</tool_response>")
    assert suffix == tokenizer.encode(observation, add_special_tokens=False)
    # TRL reads the job's call format with its Qwen-style response template.
    tokenizer.response_template = response_template(tokenizer)
    text = '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'
    ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12*34="}], add_generation_prompt=True, return_dict=False
    )
    assert parse_response(tokenizer, ids, prefix=prefix)["tool_calls"] == [CALL]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM")
def test_trl_reads_an_answer_back_only_with_the_anchor_as_the_tokenizer_decodes_it(
    tmp_path: Path,
) -> None:
    from trl.chat_template_utils import qwen3_template  # noqa: PLC0415

    tokenizer = _tokenizer_as_runs_load_it(tmp_path)
    (calculator,) = trl_tools(load(None, e2e_suite.TOOLS).agent)
    chat = [{"role": "user", "content": "12*34="}]
    # TRL's own template looks for the anchor's newline, which this tokenizer does not decode:
    # it would read the turn's header into the answer, and every reward would be 0.
    tokenizer.response_template = qwen3_template
    with pytest.raises(ValueError, match=re.escape("first turn as '<|im_start|>assistant2'")):
        check_answers_read(tokenizer, [calculator], chat)
    tokenizer.response_template = response_template(tokenizer)
    assert tokenizer.response_template["start_anchor"] == "<|im_start|>assistant"
    check_answers_read(tokenizer, [calculator], chat)


def test_trls_calculator_answers_as_the_jobs_environment_with_its_sandboxed_process() -> None:
    agent = load(None, e2e_suite.TOOLS).agent
    # The delay left out; the calculator still computes in a sandboxed process.
    latency = dataclasses.replace(agent.latency, distribution="none")
    agent = dataclasses.replace(agent, latency=latency)
    assert agent.latency.subprocess
    (calculator,) = trl_tools(agent)
    env = ToolEnvironment.from_config(agent, {"calculator": create_tool("calculator", agent)})
    for expression in ("12*34", "1/0", "import os"):
        # The job's observation of the call, and TRL's (its template around the answer).
        step = asyncio.run(
            env.step(format_call(ToolCall("calculator", {"expression": expression})))
        )
        answer = asyncio.run(calculator(expression))
        assert step.observation == f"<tool_response>\n{answer}\n</tool_response>"
    assert asyncio.run(calculator("12*34")) == "408"
    assert asyncio.run(calculator("1/0")).startswith("error: calculator:")


def test_the_trl_peer_refuses_tools_it_does_not_have() -> None:
    with pytest.raises(ValueError, match="calculator only"):
        trl_tools(AgentConfig(tools=["calculator", "python"]))


def test_trl_is_judged_on_its_last_assistant_message() -> None:
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "calculator", "content": "408"},
        {"role": "assistant", "content": "408"},
    ]
    assert last_answer(completion) == "408"
    assert last_answer(completion[:2]) == ""  # ended on a call: no answer
    assert last_answer("408") == "408"


def _run(case: str, seed: int, final: float, curve: list[tuple[float, float]]) -> ToolsResult:
    assert curve[-1][1] == final
    rl = curve[-1][0] + 10.0
    return ToolsResult(seed, case, rl, 1.0, 0.5, final, tuple(curve))


def test_a_run_reaches_an_accuracy_at_its_first_evaluation_within_two_points() -> None:
    run = _run("tools-staleness-1", 0, 0.8, [(10.0, 0.70), (20.0, 0.781), (30.0, 0.80)])
    assert run.time_to(0.80) == 20.0  # 0.781 is within 2 points
    assert run.time_to(0.75) == 20.0
    assert run.time_to(0.60) == 10.0
    assert run.time_to(0.85) is None


def test_the_tools_report_compares_with_the_sync_run_and_trl_seed_by_seed() -> None:
    runs = []
    for seed, (sync_final, trl_final) in enumerate([(0.8, 0.9), (0.6, 0.5)]):
        runs += [
            _run("tools-staleness-0", seed, sync_final, [(50.0, 0.5), (100.0, sync_final)]),
            _run("tools-staleness-1", seed, 0.8, [(20.0, 0.8), (40.0, 0.8)]),
            _run("tools-staleness-2", seed, 0.8, [(30.0, 0.8)]),
            ToolsResult(seed, "tools-trl", 200.0, 1.0, 0.5, trl_final, ((200.0, trl_final),)),
        ]
    report = Report("e2e")
    e2e_suite._add_tools(report, runs)
    got = {(r.case, r.metric): r for r in report.records}
    # Async-1 reaches the sync finals (0.8, then 0.6) at 20 s on both seeds; the sync runs take
    # 110 s each in all.
    to_sync = got["tools-staleness-1", "time_to_sync_final_s"]
    assert (to_sync.value, to_sync.baseline_value) == (20.0, 110.0)
    assert got["tools-staleness-1", "reached_sync_final"].value == 1.0
    # TRL's 0.9 on seed 0 is never reached (all 50 s of RL count); its 0.5 on seed 1 at 20 s.
    to_trl = got["tools-staleness-1", "time_to_trl_final_s"]
    assert (to_trl.value, to_trl.baseline_value) == ((50.0 + 20.0) / 2, 200.0)
    assert got["tools-staleness-1", "reached_trl_final"].value == 0.5
    assert got["tools-trl", "final_accuracy"].value == pytest.approx(0.7)
    assert got["tools-staleness-0", "final_accuracy_min"].value == 0.6


def test_bad_e2e_options_are_refused_before_anything_is_set_up(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A suite's runs take the store token from the environment; an option refused must leave it
    # unset (later daemons in this process would otherwise find a token nobody gave them).
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for options, message in (
        (["--task", "tools", "--cases", "staleness"], "--task tools runs the tools cases"),
        (["--seeds", "0,one"], "--seeds takes comma-separated seeds"),
    ):
        with pytest.raises(SystemExit) as stopped:
            main(["bench", "e2e", *options])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err
        assert TOKEN_ENV not in os.environ


def test_a_seed_run_alone_keeps_the_order_it_has_in_the_full_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[tuple[int, str]] = []

    def job(run_dir: Path, overrides: list[str], quick: bool) -> None:
        order.append((int(run_dir.parent.name[5:]), run_dir.name))

    def result(run_dir: Path, seed: int, case: str) -> ToolsResult:
        return ToolsResult(seed, case, 1.0, 1.0, 0.5, 0.5, ((1.0, 0.5),))

    monkeypatch.setattr(e2e_suite, "train", job)
    monkeypatch.setattr(e2e_suite, "trl", lambda model, out, overrides, quick: job(out, [], quick))
    monkeypatch.setattr(e2e_suite, "copy_warm_start", lambda first, run_dir: None)
    monkeypatch.setattr(e2e_suite, "_tools_result", result)
    e2e_suite.run(Report("e2e"), cases=("tools",))
    full = [case for seed, case in order if seed == 1]
    assert full[1] == "tools-trl" and len(set(full)) == 4
    assert full != [case for seed, case in order if seed == 0]  # the order rotates by seed
    order.clear()
    e2e_suite.run(Report("e2e"), cases=("tools",), seeds=(1,))
    assert [case for _, case in order] == full
    with pytest.raises(ValueError, match="seeds are some of"):
        e2e_suite.run(Report("e2e"), cases=("tools",), seeds=(3,))
