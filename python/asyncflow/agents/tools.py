"""Tools an agent may call: a name, a description, a JSON schema of the arguments, and an async
function from the arguments to the text the model reads back. Tools are found by name, like
engines: built-ins, :func:`register_tool`, or the entry-point group ``asyncflow.tools`` (an entry
point names a :class:`Tool` or a factory ``factory(agent_config) -> Tool``).

Built in: ``calculator`` (safe arithmetic, :mod:`asyncflow.agents.calculator`) and ``python``
(code run in the sandbox, :mod:`asyncflow.agents.sandbox`).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncflow.agents.calculator import CalculatorError, evaluate, format_number
from asyncflow.agents.sandbox import SandboxLimits, run_python
from asyncflow.errors import ConfigError
from asyncflow.units import parse_size

if TYPE_CHECKING:
    from asyncflow.config import AgentConfig, Config

ENTRY_POINTS = "asyncflow.tools"


class ToolError(Exception):
    """A tool could not do what was asked; the message becomes the error observation."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    #: JSON schema of the arguments (an object schema).
    parameters: Mapping[str, Any]
    #: ``fn(**arguments)`` -> the text the model reads back: an ``async def`` function, or a
    #: plain one (run in a thread of its own, so it blocks no other trajectory).
    fn: Callable[..., Awaitable[str] | str] = field(compare=False)

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates and OpenAI-style APIs describe it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


ToolFactory = Callable[["AgentConfig"], Tool]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool's schema (None when they do). Checks the subset of
    JSON schema tools use: required properties, no unknown ones, and each property's type."""
    properties: Mapping[str, Any] = tool.parameters.get("properties", {})
    missing = [name for name in tool.parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown and not tool.parameters.get("additionalProperties", False):
        return f"unknown argument(s) {', '.join(map(repr, unknown))}"
    for name, value in arguments.items():
        expected = properties.get(name, {}).get("type")
        types = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
        if types is None:
            continue
        wrong_bool = isinstance(value, bool) and expected in ("integer", "number")
        if wrong_bool or not isinstance(value, types):
            return f"argument {name!r} must be of type {expected}, not {type(value).__name__}"
    return None


def calculator_tool(config: AgentConfig | None = None) -> Tool:
    """Arithmetic on numbers. With ``agent.latency.subprocess`` the checked expression is
    computed by a sandboxed Python process, standing in for a tool that is a real service."""
    limits = sandbox_limits(config)
    in_subprocess = config is not None and config.latency.subprocess

    async def calculate(expression: str) -> str:
        try:
            value = format_number(evaluate(expression))
        except CalculatorError as e:
            raise ToolError(str(e)) from None
        if in_subprocess:  # only arithmetic reaches here: evaluate() accepted it
            # On lines of their own: a trailing comment must not swallow the parenthesis.
            result = await run_python(f"print(\n{expression.strip()}\n)", limits)
            if not result.ok:
                raise ToolError(f"the calculator process failed: {result.output.strip()[-200:]}")
        return value

    return Tool(
        "calculator",
        "Evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123*4567"}},
            "required": ["expression"],
        },
        calculate,
    )


def python_tool(config: AgentConfig | None = None) -> Tool:
    """Runs Python code in the sandbox; the model reads its output (truncated) and, when it
    failed, why."""
    limits = sandbox_limits(config)

    async def run(code: str) -> str:
        result = await run_python(code, limits)
        text = result.output
        if result.dropped_bytes:
            text += f"\n[output truncated: {result.dropped_bytes} more bytes]"
        if result.timed_out:
            raise ToolError(f"timed out after {limits.wall_seconds:g} s\n{text}".rstrip())
        if result.exit_code != 0:
            raise ToolError(f"exit status {result.exit_code}\n{text}".rstrip())
        return text

    return Tool(
        "python",
        "Runs Python 3 code in a sandbox without network access; returns what it prints.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a Python program"}},
            "required": ["code"],
        },
        run,
    )


def prompt_tools(config: Config) -> list[dict[str, Any]] | None:
    """The schemas of an agent run's tools, for the chat template to describe to the model (a
    template that ignores them, as the built-in model's does, renders the same prompt); None
    when the run is no agent run, has no tools, or ``agent.tools_in_prompt`` is off."""
    agent = config.agent
    if not (agent.enabled and agent.tools_in_prompt and agent.tools):
        return None
    return [create_tool(name, agent).schema() for name in agent.tools]


def sandbox_limits(config: AgentConfig | None) -> SandboxLimits:
    if config is None:
        return SandboxLimits()
    s = config.sandbox
    return SandboxLimits(
        cpu_seconds=s.cpu_seconds,
        memory_bytes=int(parse_size(s.memory) or SandboxLimits.memory_bytes),
        wall_seconds=s.wall_seconds,
        output_bytes=s.output_bytes,
        processes=s.processes,
        disk_bytes=int(parse_size(s.disk) or SandboxLimits.disk_bytes),
    )


_TOOLS: dict[str, ToolFactory] = {"calculator": calculator_tool, "python": python_tool}


def register_tool(name: str, tool: Tool | ToolFactory) -> None:
    """Makes ``tool`` (or a factory of it, called with the run's ``agent`` config) available
    to ``agent.tools`` by ``name``."""
    _TOOLS[name] = (lambda _config: tool) if isinstance(tool, Tool) else tool


def known_tools() -> list[str]:
    return sorted(
        {*_TOOLS, *(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS))}
    )


def create_tool(name: str, config: AgentConfig | None = None) -> Tool:
    """The tool registered as ``name``; raises ``ConfigError`` for an unknown name."""
    if name not in _TOOLS:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
            if ep.name == name:
                register_tool(name, ep.load())
    if name not in _TOOLS:
        raise ConfigError(f"unknown tool {name!r}; known: {', '.join(known_tools())}")
    tool = _TOOLS[name](config)  # type: ignore[arg-type]
    if not isinstance(tool, Tool):
        raise ConfigError(f"tool {name!r} did not give a Tool")
    return tool
