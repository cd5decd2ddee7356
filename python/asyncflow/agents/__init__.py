"""Multi-turn agentic rollouts: environments, tools, tool-call parsing, the sandbox and the agent
loop (see docs/agents.md). Each is found by name, as engines are, so a user's own plugs in with a
``register_...`` call or an entry point."""

from asyncflow.agents.env import Environment, Step, ToolEnvironment, register_environment
from asyncflow.agents.loop import AgentLoop
from asyncflow.agents.parser import CallError, ToolCall, register_parser
from asyncflow.agents.sandbox import SandboxLimits, SandboxResult, run_python
from asyncflow.agents.tools import Tool, ToolError, create_tool, register_tool
from asyncflow.agents.trajectory import Trajectory

__all__ = [
    "AgentLoop",
    "CallError",
    "Environment",
    "SandboxLimits",
    "SandboxResult",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "Trajectory",
    "create_tool",
    "register_environment",
    "register_parser",
    "register_tool",
    "run_python",
]
