"""Multi-turn agents: tool-call parsing, the environment's answers to every kind of bad call,
the agent loop's token-in/token-out trajectories, and the loss mask in the trainer's loss."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterable

import numpy as np
import pytest
import torch

from asyncflow.agents.calculator import CalculatorError, evaluate
from asyncflow.agents.env import Step, ToolEnvironment, register_environment
from asyncflow.agents.loop import AgentLoop
from asyncflow.agents.parser import CallError, HermesParser, ToolCall, format_call
from asyncflow.agents.tools import Tool, ToolError, calculator_tool, check_arguments
from asyncflow.config import AgentConfig, Config, ConfigError
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.tasks.base import Problem
from asyncflow.tasks.multiply_tools import MultiplyToolsTask
from asyncflow.workers.steps import StepLoss

TOKENIZER = chatml_tokenizer()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


# -- the loss mask ---------------------------------------------------------------------------


def _masked_batch(mask: list[int]) -> tuple[StepLoss, object]:
    config = Config()
    config.agent.enabled = True
    config.trainer.packing = False
    loss = StepLoss(config, TOKENIZER.pad_id)
    data = {
        "prompt_ids": [np.array([5, 6, 7], np.int64)],
        "response_ids": [np.array([8, 9, 10, 11, 12], np.int64)],
        "behaviour_logprobs": [np.full(5, -1.0, np.float32)],
        "advantage": [1.0],
        "loss_mask": [np.array(mask, np.uint8)],
    }
    return loss, loss.batch(data)


def test_masked_tokens_contribute_zero_gradient() -> None:
    mask = [1, 0, 0, 1, 1]
    loss_fn, batch = _masked_batch(mask)
    logp = torch.full((1, 8), -1.2, requires_grad=True)
    loss, _ = loss_fn(logp, batch)  # type: ignore[arg-type]
    loss.backward()
    assert logp.grad is not None
    grad = logp.grad[0, 3:]  # the response's positions
    assert torch.all(grad[torch.tensor(mask) == 0] == 0)
    assert torch.all(grad[torch.tensor(mask) == 1] != 0)
    assert torch.all(logp.grad[0, :3] == 0)  # the prompt's


def test_the_loss_does_not_depend_on_masked_tokens_log_probs() -> None:
    loss_fn, batch = _masked_batch([1, 0, 0, 1, 1])
    a = torch.full((1, 8), -1.2)
    b = a.clone()
    b[0, 4:6] = -7.0  # the two tool tokens
    assert float(loss_fn(a, batch)[0]) == pytest.approx(float(loss_fn(b, batch)[0]))  # type: ignore[arg-type]


def test_the_trainer_reads_the_loss_mask_only_in_agent_runs() -> None:
    from asyncflow.workers.steps import sample_fields

    config = Config()
    assert "loss_mask" not in sample_fields(config)
    config.agent.enabled = True
    assert "loss_mask" in sample_fields(config)
