"""Tool calls in the model's text. The default format is Hermes/Qwen's: each call is a JSON
object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; a turn
with no such block is the model's answer. Other formats plug in with :func:`register_parser` or
the entry-point group ``asyncflow.tool_parsers`` (a factory taking no arguments).

A block that cannot be read is not dropped: it becomes a :class:`CallError`, which the
environment answers with an error observation, so the model sees (and pays for) its mistake.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncflow.errors import ConfigError

ENTRY_POINTS = "asyncflow.tool_parsers"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallError:
    """A tool-call block that is not a valid call; ``kind`` names the metric it counts in."""

    kind: str
    message: str


@dataclass(frozen=True)
class ParsedTurn:
    #: The text outside tool-call blocks.
    content: str
    calls: list[ToolCall | CallError]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn. A
    block's JSON is read first, so a string in it may hold the closing tag; a block whose JSON
    cannot be read ends at the next closing tag."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall | CallError] = []
        content: list[str] = []
        pos = 0
        while (start := text.find(self.open_tag, pos)) >= 0:
            content.append(text[pos:start])
            body = start + len(self.open_tag)
            end = self._json_end(text, body)
            if end < 0:
                end = text.find(self.close_tag, body)
            if end < 0:  # opened, never closed
                calls.append(CallError("bad_format", f"{self.open_tag} without {self.close_tag}"))
                pos = len(text)
                break
            calls.append(self._call(text[body:end]))
            pos = end + len(self.close_tag)
        content.append(text[pos:])
        return ParsedTurn("".join(content).strip(), calls)

    def _json_end(self, text: str, at: int) -> int:
        """Where the closing tag starts if one JSON value and whitespace lie before it, else -1."""
        try:
            _, end = _DECODER.raw_decode(text, _skip_space(text, at))
        except (ValueError, RecursionError):
            return -1
        end = _skip_space(text, end)
        return end if text.startswith(self.close_tag, end) else -1

    @staticmethod
    def _call(body: str) -> ToolCall | CallError:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return CallError("bad_json", f"the tool call is not valid JSON: {e.msg} at {e.pos}")
        except (ValueError, RecursionError) as e:  # an integer too long, nesting too deep
            return CallError("bad_json", f"the tool call is not JSON this parser reads: {e}"[:200])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return CallError("bad_format", 'a tool call is an object with a string "name"')
        arguments = obj.get("arguments")
        if arguments is None:  # absent or null: a tool that takes none
            arguments = {}
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                return CallError("bad_json", "the tool call's arguments are not valid JSON")
        if not isinstance(arguments, dict):
            return CallError("bad_arguments", '"arguments" must be an object')
        return ToolCall(obj["name"], arguments)


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, at: int) -> int:
    match = _SPACE.match(text, at)
    assert match is not None  # it matches the empty string
    return match.end()


def format_call(call: ToolCall) -> str:
    """How the default format writes a call (demonstrations use it)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, separators=(",", ":"))
    return f"{HermesParser.open_tag}{body}{HermesParser.close_tag}"


_PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}


def register_parser(name: str, factory: Callable[[], ToolCallParser]) -> None:
    _PARSERS[name] = factory


def create_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
            if ep.name == name:
                _PARSERS[name] = ep.load()
    if name not in _PARSERS:
        raise ConfigError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_PARSERS))}"
        )
    return _PARSERS[name]()
