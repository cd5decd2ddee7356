"""What the workflow needs of a task: training prompts, held-out prompts, ground truths."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Plain text, or a chat: a list of ``{"role", "content"}`` messages.
Prompt = str | list[dict[str, Any]]


@dataclass(frozen=True)
class Problem:
    prompt: Prompt
    answer: str
    #: Further columns handed to the reward function (``data.extra_keys``), by dotted path.
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: A worked answer for the warm start to demonstrate (None: the answer itself).
    demonstration: str | None = None

    @property
    def key(self) -> str:
        """The prompt as text, for telling prompts apart (held-out splits, caches)."""
        return self.prompt if isinstance(self.prompt, str) else json.dumps(self.prompt)


class Task(Protocol):
    name: str

    def train_stream(self, seed: int, start: int = 0) -> Iterator[Problem]:
        """Training problems in a reproducible order, from position ``start`` on (for resume)."""
        ...

    def eval_set(self) -> list[Problem]:
        """Held-out problems, disjoint from training ones."""
        ...
