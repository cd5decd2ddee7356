"""Reward sources (functions, a local classifier, an HTTP judge), their bad input, and the
algorithm options that use rewards: dynamic sampling, overlong handling, REINFORCE++, clip-higher,
loss aggregation modes and GSPO."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from test_workflow import run

import asyncflow as af
from asyncflow import config as cfg
from asyncflow.algorithms.advantages import batch_normalised, overlong_penalty
from asyncflow.algorithms.losses import LossSettings, aggregate, policy_loss
from asyncflow.config import ConfigError, RewardHttpConfig, RewardModelConfig
from asyncflow.evaluation import verifier
from asyncflow.models.chatml import chatml_tokenizer, save_chatml_tokenizer
from asyncflow.tasks.base import Problem
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import register_tasks
from asyncflow.workers.advantage import AdvantageWorker
from asyncflow.workers.base import SAMPLES, Context, RunState, step_partition
from asyncflow.workers.feeder import EXTRA_GROUPS
from asyncflow.workers.reward import RewardModelWorker, RewardWorker, claimed_rows
from asyncflow.workers.reward_sources import (
    Failure,
    FnSource,
    HttpSource,
    ModelSource,
    RewardRow,
    RewardSet,
)


def rows(*responses: str, truth: str = "4") -> list[RewardRow]:
    return [RewardRow(10 + i, i // 2, "2+2=", r, truth) for i, r in enumerate(responses)]


# ---- fn ------------------------------------------------------------------------------------


def test_a_failing_function_is_reported_per_row_naming_row_and_source() -> None:
    def judge(response: str, truth: str) -> Any:
        if response == "boom":
            raise RuntimeError("bad row")
        if response == "nan":
            return math.nan
        if response == "text":
            return "1.0"
        return 1.0 if response == truth else 0.0

    out = FnSource(judge).score(rows("4", "boom", "nan", "text", "5"))
    assert out[0] == 1.0 and out[4] == 0.0
    failures = [o for o in out if isinstance(o, Failure)]
    assert [f.row for f in failures] == [11, 12, 13]
    assert all(f.source == "fn" for f in failures)
    assert "RuntimeError: bad row" in failures[0].reason
    assert "nan" in failures[1].reason
    assert "str, not a number" in failures[2].reason
    assert "row 11" in str(failures[0]) and "'fn'" in str(failures[0])


def test_async_functions_run_concurrently_within_the_bound() -> None:
    active = peak = 0

    async def judge(response: str, truth: str) -> float:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.01)
        active -= 1
        return float(response == truth)

    out = FnSource(judge, concurrency=3).score(rows(*["4", "5"] * 5))
    assert out == [1.0, 0.0] * 5
    assert peak == 3  # ten rows, at most three at once, and more than one at a time


def test_a_batched_function_gets_lists_once_and_a_wrong_length_fails_every_row() -> None:
    calls: list[list[str]] = []

    def judge(responses: list[str], truths: list[str]) -> list[float]:
        calls.append(responses)
        return [float(r == t) for r, t in zip(responses, truths, strict=True)]

    assert FnSource(judge, batched=True).score(rows("4", "3", "4")) == [1.0, 0.0, 1.0]
    assert calls == [["4", "3", "4"]]
    short = FnSource(lambda r, t: [1.0], batched=True).score(rows("4", "3"))
    assert all(isinstance(o, Failure) and "1 scores for 2 rows" in o.reason for o in short)


def test_weighted_sources_sum_and_a_failure_makes_the_row_nan() -> None:
    exact = FnSource(lambda r, t: float(r == t), name="exact")
    length = FnSource(lambda r, t: 1.0 if r != "x" else math.nan, name="length")
    rewards, failures = RewardSet([exact, length], [2.0, 0.5]).score(rows("4", "5", "x"))
    np.testing.assert_allclose(rewards[:2], [2.5, 0.5])
    assert math.isnan(rewards[2])
    assert [(f.row, f.source) for f in failures] == [(12, "length")]


# ---- model ---------------------------------------------------------------------------------


def tiny_classifier(directory: Path, head: bool = True, labels: int = 2) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tok = chatml_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=tok.pad_id,
        num_labels=labels,
    )
    torch.manual_seed(0)
    model = (Qwen2ForSequenceClassification if head else Qwen2ForCausalLM)(config)
    model.save_pretrained(str(directory), safe_serialization=True)
    save_chatml_tokenizer(directory)
    return directory


def test_the_model_source_scores_in_batches_as_one_row_at_a_time(tmp_path: Path) -> None:
    path = tiny_classifier(tmp_path / "rm")
    texts = ["4", "a much longer response 4", "5", "12"]
    batched = ModelSource(RewardModelConfig(path=str(path), batch_size=3, label=1))
    one = ModelSource(RewardModelConfig(path=str(path), batch_size=1, label=1))
    got = batched.score(rows(*texts))
    alone = one.score(rows(*texts))
    np.testing.assert_allclose(np.array(got, float), np.array(alone, float), atol=1e-5)
    assert len({round(float(g), 5) for g in got}) == 4  # it does read the text (random head)
    probs = ModelSource(RewardModelConfig(path=str(path), probability=True)).score(rows(*texts))
    assert all(0.0 < float(p) < 1.0 for p in probs)


def test_a_template_is_filled_in_one_pass_so_a_response_cannot_call_for_the_truth(
    tmp_path: Path,
) -> None:
    seen: list[str] = []
    source = ModelSource(
        RewardModelConfig(path=str(tiny_classifier(tmp_path / "rm")), template="{response}|{truth}")
    )
    source._forward = lambda texts: seen.extend(texts) or [0.0] * len(texts)  # type: ignore[method-assign]
    source.score([RewardRow(1, 0, "{truth}", "I say {truth} and {prompt}", "42")])
    assert seen == ["I say {truth} and {prompt}|42"]


def test_a_one_label_reward_models_probability_is_its_logits_sigmoid(tmp_path: Path) -> None:
    path = tiny_classifier(tmp_path / "rm", labels=1)
    texts = ["4", "a much longer response 4", "5"]
    logits = ModelSource(RewardModelConfig(path=str(path))).score(rows(*texts))
    probs = ModelSource(RewardModelConfig(path=str(path), probability=True)).score(rows(*texts))
    # A softmax over the one logit made every score 1.0.
    expected = 1 / (1 + np.exp(-np.array(logits, float)))
    np.testing.assert_allclose(np.array(probs, float), expected, atol=1e-6)
    assert len({round(float(p), 6) for p in probs}) == 3


def test_a_row_longer_than_the_reward_models_positions_fails_alone(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    # Learned positions (rotary ones, as Qwen2's, take any length): 32 of them.
    tok = chatml_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=32, n_layer=1, n_head=2,
        pad_token_id=tok.pad_id, num_labels=2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "rm"
    GPT2ForSequenceClassification(config).save_pretrained(str(path), safe_serialization=True)
    save_chatml_tokenizer(path)
    texts = ["4", " ".join(["word"] * 200), "5"]
    scores = ModelSource(RewardModelConfig(path=str(path), batch_size=3)).score(rows(*texts))
    assert isinstance(scores[1], Failure) and "forward pass raised" in scores[1].reason
    alone = ModelSource(RewardModelConfig(path=str(path), batch_size=1)).score(rows("4", "5"))
    np.testing.assert_allclose([scores[0], scores[2]], np.array(alone, float), atol=1e-5)


def test_reward_sources_see_every_message_of_a_chat_prompt() -> None:
    tok = chatml_tokenizer()
    system, user = "Answer briefly.", "What is 37+48?"
    prompt = tok.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": user}]
    )
    batch = SimpleNamespace(
        indexes=np.array([5]),
        groups=np.array([0]),
        read=lambda: {
            "prompt_ids": [np.array(prompt)],
            "response_ids": [np.array(tok.encode("85"))],
            "answer": [b"85"],
        },
    )
    config = cfg.load(None, [])
    (row,) = claimed_rows(batch, SimpleNamespace(tokenizer=tok), config)  # type: ignore[arg-type]
    # Decoding stopped at the system message's end of turn: a judge saw no question.
    squeezed = row.prompt.replace(" ", "")
    assert system.replace(" ", "") in squeezed and user.replace(" ", "") in squeezed
    assert row.response.replace(" ", "") == "85"


def test_a_model_directory_without_a_classification_head_is_refused(tmp_path: Path) -> None:
    path = tiny_classifier(tmp_path / "lm", head=False)
    with pytest.raises(ConfigError, match="no sequence-classification head"):
        ModelSource(RewardModelConfig(path=str(path)))
    with pytest.raises(ConfigError, match="has 2 label"):
        ModelSource(RewardModelConfig(path=str(tiny_classifier(tmp_path / "rm")), label=2))


# ---- http ----------------------------------------------------------------------------------


class Judge(BaseHTTPRequestHandler):
    """A judge that is slow, fails each text's first request, and answers some unreadably."""

    count = 0
    seen: ClassVar[set[str]] = set()
    lock = threading.Lock()
    in_flight = 0
    peak = 0

    def do_POST(self) -> None:
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        # Requests at once, but for the ones the client has given up on ("hang"). A request stops
        # counting before its answer is written: the client may send the next one as soon as it
        # has the answer.
        counted = int("hang" not in content)
        with cls.lock:
            cls.count += 1
            cls.in_flight += counted
            cls.peak = max(cls.peak, cls.in_flight)
        try:
            time.sleep(0.02)
            if "hang" in content:
                time.sleep(60.0)  # far beyond the client's timeout
            with cls.lock:
                first = content not in cls.seen
                cls.seen.add(content)
        finally:
            with cls.lock:
                cls.in_flight -= counted
        try:
            if first or "down" in content:
                self.send_response(503)
                self.end_headers()
                return
            reply = "I cannot say" if "vague" in content else f"Score: {content.count('4')}"
            data = json.dumps({"choices": [{"message": {"content": reply}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up waiting (the "hang" text)
            pass

    def log_message(self, *args: Any) -> None:
        pass


def number_of_requests() -> int:
    return Judge.count


@pytest.fixture
def judge_url() -> Iterator[str]:
    Judge.count = Judge.peak = 0
    Judge.seen = set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_the_judge_is_retried_bounded_and_its_failures_are_reported(judge_url: str) -> None:
    waits: list[float] = []
    source = HttpSource(
        RewardHttpConfig(
            url=judge_url, template="{response}", concurrency=3, timeout=5.0, retries=2
        ),
        sleep=waits.append,
    )
    texts = ["4", "44", "x", "444", "vague", "down", "hang", "4"]
    out = source.score(rows(*texts))
    assert out[:4] == [1.0, 2.0, 0.0, 3.0] and out[7] == 1.0  # retried past the 503s
    assert isinstance(out[4], Failure) and "unparseable reply 'I cannot say'" in out[4].reason
    assert isinstance(out[5], Failure) and "no answer after 3 tries: HTTP 503" in out[5].reason
    assert isinstance(out[6], Failure) and "no answer after 3 tries" in out[6].reason
    assert (out[6].row, out[6].source) == (16, "http")
    assert source.counts.failures == 3 and source.counts.retries >= 9
    assert number_of_requests() == source.counts.requests
    assert set(waits) <= {0.5, 1.0} and 1.0 in waits  # exponential backoff
    assert 1 < Judge.peak <= 3
    source.close()


# ---- the reward and advantage workers ------------------------------------------------------


def context(*overrides: str) -> Context:
    config = cfg.load(None, ["rollout.n=2", "trainer.groups_per_step=2", *overrides])
    store = af.Store()
    register_tasks(store, reference=False)
    return Context(store, config, chatml_tokenizer(), Tracer(), RunState())


def put_group(ctx: Context, group: int, responses: list[str], answer: str = "4") -> None:
    tok = ctx.tokenizer
    ctx.store.put(
        {
            "prompt_ids": [np.array(tok.encode("2+2="), np.int64)] * len(responses),
            "response_ids": [np.array(tok.encode(r), np.int64) for r in responses],
            "behaviour_logprobs": [np.zeros(len(r), np.float32) for r in responses],
            "answer": [answer.encode()] * len(responses),
        },
        partition=step_partition(0),
        groups=[group] * len(responses),
        group_size=len(responses),
    )


def test_a_failed_row_drops_its_whole_group_and_the_others_train() -> None:
    ctx = context(
        "run.poll_interval=0.05",
        "algorithm.filter_groups=true",
        "algorithm.max_extra_groups=4",
        "trainer.staleness_policy=drop",
    )

    def judge(response: str, truth: str) -> float:
        if response == "bad":
            raise ValueError("cannot judge")
        return float(response == truth)

    put_group(ctx, 0, ["4", "5"])
    put_group(ctx, 1, ["4", "bad"])
    put_group(ctx, 2, ["4", "4"])  # all equal: no signal
    reward = RewardWorker(ctx, None, RewardSet([FnSource(judge)]))
    assert reward.step()
    assert [(f.group, f.source) for f in reward.failures] == [(1, "fn")]
    assert ctx.state.reward_failures == 1
    advantage = AdvantageWorker(ctx)
    assert advantage.step()
    assert ctx.state.filtered_groups == 1
    assert ctx.state.extra_groups == {0: 2}  # groups 1 and 2 are to be replaced
    rows_ = ctx.store.claim("train", ["advantage"], 6, timeout=1, partition=step_partition(0))
    adv = dict(zip(rows_.groups.tolist(), rows_.read()["advantage"], strict=False))
    by_group: dict[int, list[float]] = {}
    for g, a in zip(rows_.groups.tolist(), rows_.read()["advantage"], strict=True):
        by_group.setdefault(g, []).append(float(a))
    assert adv
    assert sorted(by_group[0]) == pytest.approx([-1.0, 1.0], abs=1e-4)
    assert all(math.isnan(a) for a in by_group[1] + by_group[2])


def test_overlong_responses_are_filtered_or_penalised() -> None:
    np.testing.assert_allclose(
        overlong_penalty(np.array([4, 6, 7, 8]), max_tokens=8, buffer=4, penalty=1.0),
        [0.0, -0.5, -0.75, -1.0],
    )
    ctx = context("algorithm.overlong=filter", "rollout.max_tokens=3")
    eos = ctx.tokenizer.eos_id
    worker = AdvantageWorker(ctx)
    responses = [np.array([5, 6, 7]), np.array([5, 6, eos]), np.array([5]), np.array([5, 6, 7])]
    adv, _ = worker.advantages(
        np.array([1.0, 0.0, 1.0, 0.0]), np.array([0, 0, 1, 1]), {"response_ids": responses}
    )
    # Cut responses (3 tokens, no end) add no gradient; the one that ended at 3 tokens does.
    assert adv[0] == 0.0 and adv[3] == 0.0 and adv[1] < 0 < adv[2]


def test_a_trajectorys_length_bound_is_its_budget_and_tool_tokens_carry_no_kl() -> None:
    ctx = context(
        "agent.enabled=true",
        "agent.max_tokens=6",
        "rollout.max_tokens=3",
        "algorithm.overlong=filter",
        "algorithm.advantage=reinforce++",
        "algorithm.reference=true",
        "trainer.kl_coef=1",
    )
    eos = ctx.tokenizer.eos_id
    worker = AdvantageWorker(ctx)
    data = {
        # a call and its answer, then the answer with its end: longer than a turn, not cut;
        # a turn cut short; a second call that used the budget up, unanswered (its tokens as
        # an answer's); out of turns after a tool's answer. Only the rollout knew which were
        # cut, and recorded it.
        "response_ids": [
            np.array([5, eos, 9, 9, 6, eos]),
            np.array([5, 6, 7]),
            np.array([5, eos, 9, 9, 5, eos]),
            np.array([5, eos, 9]),
        ],
        "loss_mask": [
            np.array([1, 1, 0, 0, 1, 1], np.uint8),
            np.ones(3, np.uint8),
            np.array([1, 1, 0, 0, 1, 1], np.uint8),
            np.array([1, 1, 0], np.uint8),
        ],
        "agent_truncated": np.array([0, 1, 1, 0], np.uint8),
        # The tool's tokens have no behaviour log-prob (0) but a reference one: no KL there.
        "behaviour_logprobs": [np.array([-1.0, -1.0, 0, 0, -1.0, -1.0])] + [np.zeros(3)] * 3,
        "ref_logprobs": [np.array([-2.0, -1.0, -5.0, -5.0, -1.0, -1.0])] + [np.zeros(3)] * 3,
    }
    data["behaviour_logprobs"][2] = data["ref_logprobs"][2] = np.zeros(6)
    rewards = np.array([1.0, 0.0, 0.0, 0.0])
    _, cut, bound = worker.truncated(data)
    assert bound == 6 and cut.tolist() == [False, True, True, False]
    adv, _ = worker.advantages(rewards, np.array([0, 0, 1, 1]), data)
    assert adv[1] == 0.0 and adv[2] == 0.0  # cut: no gradient
    r = np.array([1.0 - 1.0, 0.0, 0.0, 0.0])  # KL 1 on the model's first token only
    np.testing.assert_allclose(adv[[0, 3]], ((r - r.mean()) / (r.std() + 1e-6))[[0, 3]], atol=1e-5)


def test_reinforce_pp_normalises_over_the_batch_with_the_kl_in_the_reward() -> None:
    np.testing.assert_allclose(batch_normalised(np.array([1.0, 3.0])), [-1.0, 1.0], atol=1e-5)
    ctx = context(
        "algorithm.advantage=reinforce++", "algorithm.reference=true", "trainer.kl_coef=1"
    )
    worker = AdvantageWorker(ctx)
    data = {
        "behaviour_logprobs": [np.array([-1.0, -1.0]), np.array([-1.0]), np.zeros(1), np.zeros(1)],
        "ref_logprobs": [np.array([-2.0, -2.0]), np.array([-1.0]), np.zeros(1), np.zeros(1)],
    }
    adv, _ = worker.advantages(np.array([1.0, 1.0, 0.0, 0.0]), np.array([0, 0, 1, 1]), data)
    # rewards less KL: [1 - 2, 1, 0, 0], normalised over all four rows, not per group
    r = np.array([-1.0, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(adv, (r - r.mean()) / (r.std() + 1e-6), atol=1e-5)


# ---- losses --------------------------------------------------------------------------------


def test_clip_higher_lets_positive_ratios_rise_further() -> None:
    logp, behaviour = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.4]]))
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    sym, _ = policy_loss(logp, behaviour, adv, mask, LossSettings(correction="none"))
    high, stats = policy_loss(
        logp, behaviour, adv, mask, LossSettings(correction="none", clip_high=0.28)
    )
    assert float(sym) == pytest.approx(-1.2) and float(high) == pytest.approx(-1.25)
    assert stats["clip_fraction"] == 0.0


def test_aggregation_modes_by_hand() -> None:
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(8 / 5)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx((4 + 4) / 2)
    packed = aggregate(
        values.reshape(1, 8),
        mask.reshape(1, 8),
        "seq-mean-token-sum",
        torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]),
    )
    assert float(packed) == pytest.approx(4.0)


def test_gspo_clips_the_sequence_ratio_not_each_token() -> None:
    # Token ratios 2 and 0.5: each would be clipped per token; their geometric mean is 1.
    logp = torch.log(torch.tensor([[0.4, 0.1]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.2, 0.2]]))
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    settings = LossSettings(correction="none", ratio_level="sequence")
    loss, stats = policy_loss(logp, behaviour, adv, mask, settings)
    assert loss.detach().item() == pytest.approx(-1.0) and stats["clip_fraction"] == 0.0
    loss.backward()
    assert logp.grad is not None
    np.testing.assert_allclose(logp.grad.numpy(), [[-0.5, -0.5]], atol=1e-6)
    token, tstats = policy_loss(logp, behaviour, adv, mask, LossSettings(correction="none"))
    assert tstats["clip_fraction"] == 1.0 and token.detach().item() != pytest.approx(-1.0)


# ---- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.type=model"], "needs reward.model.path"),
        (["reward.type=http"], "needs reward.http.url"),
        (["reward.sources=[fn,fn]"], "names a source twice"),
        (["reward.weights=[1,2]"], "2 weights for 1 sources"),
        (
            ["reward.type=http", "reward.http.url=http://h", "reward.http.score_pattern=x"],
            "capture group",
        ),
        (["reward.type=http", "reward.http.url=http://h", "reward.http.retries=-1"], "negative"),
        (["algorithm.clip_low=1"], "below 1"),
        (["algorithm.loss_aggregation=mean"], "must be one of"),
        (["algorithm.overlong=penalty", "algorithm.overlong_buffer=99"], "cannot exceed"),
        (
            [
                "agent.enabled=true",
                "agent.max_tokens=50",
                "algorithm.overlong=penalty",
                "algorithm.overlong_buffer=60",
            ],
            "cannot exceed agent.max_tokens",
        ),
    ],
)
def test_bad_reward_and_algorithm_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg.load(None, overrides)


def test_a_trajectorys_overlong_buffer_may_exceed_one_turn() -> None:
    c = cfg.load(
        None,
        [
            "agent.enabled=true",
            "agent.max_tokens=200",
            "rollout.max_tokens=50",
            "algorithm.overlong=penalty",
            "algorithm.overlong_buffer=60",
        ],
    )
    assert c.algorithm.overlong_buffer == 60


def test_held_out_answers_are_judged_by_async_and_batched_functions_too() -> None:
    async def judge(response: str, truth: str) -> float:
        return float(response == truth)

    def judge_lists(responses: list[str], truths: list[str]) -> list[float]:
        return [float(r == t) for r, t in zip(responses, truths, strict=True)]

    problem = Problem("2+2=", "4")
    assert verifier(judge, False)("4", problem) == 1.0
    assert verifier(judge_lists, False, batched=True)("4", problem) == 1.0
    assert verifier(judge_lists, False, batched=True)("5", problem) == 0.0
    assert verifier(lambda r, t: math.nan, False)("4", problem) == 0.0
    assert verifier(lambda r, t: 1 / 0, False)("4", problem) == 0.0


def test_groups_are_filtered_on_their_rewards_before_the_length_penalty() -> None:
    ctx = context(
        "algorithm.filter_groups=true",
        "algorithm.overlong=penalty",
        "rollout.max_tokens=4",
        "algorithm.overlong_buffer=2",
    )
    worker = AdvantageWorker(ctx)
    responses = [np.array([5]), np.array([5, 6, 7, 8]), np.array([5]), np.array([5, 6, 7, 8])]
    adv, filtered = worker.advantages(
        np.array([1.0, 1.0, 1.0, 0.0]), np.array([0, 0, 1, 1]), {"response_ids": responses}
    )
    # Group 0 is all right: the penalty alone would make its rewards differ, but it is dropped.
    assert filtered == 1 and np.isnan(adv[:2]).all() and adv[2] > 0 > adv[3]


def test_a_run_with_a_function_and_a_failing_judge_finishes_dropping_what_fails(
    judge_url: str, tmp_path: Path
) -> None:
    summary = run(
        tmp_path,
        "trainer.max_steps=2",
        "warm_start.steps=20",
        "trainer.groups_per_step=4",
        "rollout.n=4",
        "reward.sources=[fn,http]",
        "reward.weights=[1.0,0.1]",
        f"reward.http.url={judge_url}",
        "reward.http.template='{response}'",
        "reward.http.score_pattern='Score: ([1-9])'",  # a reply of "Score: 0" cannot be read
        "reward.http.backoff=0.01",
        "reward.http.timeout=10",
        "algorithm.filter_groups=true",
        "algorithm.max_extra_groups=0",
        "algorithm.clip_high=0.28",
    )
    assert summary["reward_failures"] > 0 and Judge.count > summary["samples_generated"]
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    dropped = sum(len(step["dropped"]) for step in ledger)
    trained = sum(len(step["trained"]) for step in ledger)
    assert dropped * 4 == summary["samples_dropped"] and dropped + trained == 8
    assert summary["groups_filtered"] <= dropped


def test_the_reward_model_is_a_task_of_its_own_whose_scores_the_reward_worker_weighs(
    tmp_path: Path,
) -> None:
    path = tiny_classifier(tmp_path / "rm")
    ctx = context(
        "reward.sources=[fn,model]",
        "reward.weights=[1.0,0.5]",
        f"reward.model.path={path}",
        "run.poll_interval=0.05",
    )
    ctx.store.register_task("reward_model", partitions=[SAMPLES])
    put_group(ctx, 0, ["4", "5"])
    reward = RewardWorker(ctx, lambda r, t: float(r == t), model_worker=True)
    assert reward.step()  # no model scores yet: nothing to claim
    indexes = ctx.store.rows(partition=step_partition(0)).indexes
    assert not any("reward" in f for f in ctx.store.ready_fields(indexes))
    model = RewardModelWorker(ctx)
    assert model.step() and reward.step()
    got = ctx.store.claim("advantage", ["reward", "model_score"], 2, timeout=1)
    data = got.read()
    alone = ModelSource(RewardModelConfig(path=str(path))).score(rows("4", "5"))
    np.testing.assert_allclose(
        [float(v) for v in data["model_score"]], np.array(alone, float), atol=1e-5
    )
    np.testing.assert_allclose(
        [float(v) for v in data["reward"]],
        [1.0 + 0.5 * float(alone[0]), 0.5 * float(alone[1])],  # type: ignore[arg-type]
        atol=1e-5,
    )


def test_a_run_with_a_reward_model_worker_and_gspo_finishes(tmp_path: Path) -> None:
    path = tiny_classifier(tmp_path / "rm")
    summary = run(
        tmp_path / "run",
        "trainer.max_steps=2",
        "warm_start.steps=20",
        "trainer.groups_per_step=4",
        "rollout.n=4",
        "reward.sources=[fn,model]",
        "reward.weights=[1.0,0.1]",
        f"reward.model.path={path}",
        "algorithm.policy_loss=gspo",
        "algorithm.advantage=rloo",
        "algorithm.overlong=penalty",
        "algorithm.overlong_buffer=2",
    )
    assert summary["reward_failures"] == 0 and summary["samples_dropped"] == 0
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    # 16 rows a step: exact-match rewards alone would sum to a whole number; the classifier's
    # weighted logits make the sum fractional, so the reward came through the model's task.
    sums = [r["reward_mean"] * 16 for r in records]
    assert any(abs(x - round(x)) > 1e-3 for x in sums)
    assert any("reward_model" in r["busy"] for r in records)


def test_dynamic_sampling_replaces_left_out_groups_up_to_the_cap(tmp_path: Path) -> None:
    summary = run(
        tmp_path,
        "trainer.max_steps=3",
        "warm_start.steps=20",  # a model mostly wrong: most groups are all-zero
        "trainer.groups_per_step=4",
        "rollout.n=4",
        "algorithm.filter_groups=true",
        "algorithm.max_extra_groups=3",
        "trainer.staleness_policy=drop",
    )
    ledger = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 3
    for step in ledger:
        groups = step["trained"] + step["dropped"]
        extra = [g for g in groups if g >= EXTRA_GROUPS]
        # Each group left out asks for one in its place, three at most a step.
        assert len(extra) == min(3, len(step["dropped"]))
        assert len(groups) == 4 + len(extra)
    assert summary["groups_filtered"] >= 1 and any(
        g >= EXTRA_GROUPS for step in ledger for g in step["trained"] + step["dropped"]
    )
