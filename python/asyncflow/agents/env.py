"""Environments: what answers the model's turns. ``reset(problem)`` gives the first observation
(text appended after the prompt; empty for none), ``step(action)`` takes the model's turn text
(its special tokens kept, up to the end token) and gives ``(observation, reward, done)``.
Either may be ``async def`` (awaited) or plain (run in a thread, so a slow one never blocks the
other trajectories).

Environments are found by name, like engines: built-ins, :func:`register_environment`, or the
entry-point group ``asyncflow.environments``; a factory is called as ``factory(agent_config,
tools)`` once per trajectory.

Built in, ``tools``: each turn's tool calls (see :mod:`asyncflow.agents.parser`) run at once,
each answered in ``<tool_response>`` tags; a turn without calls is the answer and ends the
trajectory (its reward, 0 here, is left to the verifier). Every way a call can fail (unreadable,
an unknown tool, wrong arguments, a tool that raises or outlasts ``agent.tool_timeout``) becomes
an error observation and a count in ``errors``; none of them raises.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from asyncflow.agents import calls
from asyncflow.agents.parser import CallError, ToolCall, create_parser
from asyncflow.agents.sandbox import held_in_queue
from asyncflow.agents.tools import Tool, ToolError, check_arguments
from asyncflow.errors import ConfigError
from asyncflow.tasks.base import Problem

if TYPE_CHECKING:
    from asyncflow.config import AgentConfig, LatencyConfig

ENTRY_POINTS = "asyncflow.environments"


@dataclass
class Step:
    observation: str
    reward: float = 0.0
    done: bool = False
    #: Seconds spent in tools, and failures by kind (metrics).
    tool_seconds: float = 0.0
    tool_calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)


class Environment(Protocol):
    def reset(self, problem: Problem) -> Any:
        """The first observation (``str``), or an awaitable of it."""
        ...

    def step(self, action: str) -> Any:
        """A :class:`Step` or a tuple ``(observation, reward, done)``, or an awaitable of
        either."""
        ...


EnvironmentFactory = Callable[["AgentConfig", Mapping[str, Tool]], Environment]


class Latency:
    """Extra seconds before each tool answers, standing in for a sandbox or remote service:
    ``lognormal`` with the given median and log-space ``sigma``, ``fixed`` at the median, or
    ``none``. Unseeded, each environment (one per trajectory) draws its own delays."""

    def __init__(self, config: LatencyConfig | None, seed: int | None = None) -> None:
        self.kind = "none" if config is None else config.distribution
        self.median = 0.0 if config is None else config.median
        self.sigma = 0.0 if config is None else config.sigma
        self.rng = random.Random(seed)

    def draw(self) -> float:
        if self.kind == "none":
            return 0.0
        if self.kind == "fixed":
            return self.median
        return self.median * math.exp(self.rng.gauss(0.0, self.sigma))


class ToolEnvironment:
    """The built-in ``tools`` environment."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        parser: str = "hermes",
        timeout: float = 10.0,
        latency: Latency | None = None,
    ) -> None:
        self.tools = dict(tools)
        self.parser = create_parser(parser)
        self.timeout = timeout
        self.latency = latency or Latency(None)

    @classmethod
    def from_config(cls, config: AgentConfig, tools: Mapping[str, Tool]) -> ToolEnvironment:
        return cls(tools, config.parser, config.tool_timeout, Latency(config.latency))

    async def reset(self, problem: Problem) -> str:
        return ""

    async def step(self, action: str) -> Step:
        turn = self.parser.parse(action)
        if not turn.calls:
            return Step("", done=True)
        started = time.monotonic()
        results = await asyncio.gather(*(self._answer(call) for call in turn.calls))
        step = Step(
            "\n".join(text for text, _ in results),
            tool_seconds=time.monotonic() - started,
            tool_calls=len(turn.calls),
        )
        step.errors.update(kind for _, kind in results if kind is not None)
        return step

    async def _answer(self, call: ToolCall | CallError) -> tuple[str, str | None]:
        """The call's ``<tool_response>`` block, and the kind of error it was (None if none)."""
        text, kind = await self.run_call(call)
        return f"<tool_response>\n{text}\n</tool_response>", kind

    async def run_call(self, call: ToolCall | CallError) -> tuple[str, str | None]:
        """The call's answer (an ``error: ...`` text when it failed) after the configured
        latency, and the kind of error it was (None if none)."""
        if isinstance(call, CallError):
            return f"error: {call.message}", call.kind
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return f"error: unknown tool {call.name!r} (tools: {known})", "unknown_tool"
        problem = check_arguments(tool, call.arguments)
        if problem is not None:
            return f"error: {call.name}: {problem}", "bad_arguments"
        delay = self.latency.draw()
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                with held_in_queue(deadline):
                    if delay:
                        await asyncio.sleep(delay)
                    return str(await calls.call(tool.fn, **call.arguments)), None
        except TimeoutError:
            return f"error: {call.name} did not answer within {self.timeout:g} s", "tool_timeout"
        except ToolError as e:
            return f"error: {call.name}: {e}", "tool_error"
        except asyncio.CancelledError as e:
            if cancelled_by_caller():
                raise
            return f"error: {call.name} raised {type(e).__name__}", "tool_raised"
        except Exception as e:  # a tool's own bug must not end the trajectory
            return f"error: {call.name} raised {type(e).__name__}: {e}", "tool_raised"


def cancelled_by_caller() -> bool:
    """Whether the task running is being cancelled (the run stopping, a timeout), as opposed to
    a ``CancelledError`` that some code it awaited raised of its own (a tool's or an
    environment's bug, to be counted like any other)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


_ENVIRONMENTS: dict[str, EnvironmentFactory] = {"tools": ToolEnvironment.from_config}


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    _ENVIRONMENTS[name] = factory


def environment_factory(name: str) -> EnvironmentFactory:
    if name not in _ENVIRONMENTS:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
            if ep.name == name:
                _ENVIRONMENTS[name] = ep.load()
    if name not in _ENVIRONMENTS:
        known = ", ".join(sorted(_ENVIRONMENTS))
        raise ConfigError(f"unknown agent environment {name!r}; known: {known}")
    return _ENVIRONMENTS[name]
