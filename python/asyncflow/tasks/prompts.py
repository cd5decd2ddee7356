"""How a prompt becomes the token ids a policy reads: chats keep every message (a configured
system prompt goes first where none is), rendered by the tokenizer's chat template with the
assistant's turn opened; plain text is one user message when the template is used, else encoded
as it is. Prompts longer than ``data.max_prompt_length`` are cut from the left on request (those
left out by the ``filter`` policy never get here: see :mod:`asyncflow.tasks.dataset`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncflow.config import DataConfig
from asyncflow.errors import ConfigError
from asyncflow.models.tokenizer import Tokenizer, Tools
from asyncflow.tasks.base import Prompt


class PromptError(ConfigError):
    """A prompt cannot be rendered; the message says why."""


@dataclass
class PromptEncoder:
    tokenizer: Tokenizer
    #: Render with the chat template: ``auto`` (when the tokenizer has one), True or False.
    chat_template: bool | str = "auto"
    system_prompt: str | None = None
    #: Longest prompt in tokens (None: no limit), and what a longer one gets.
    max_length: int | None = None
    truncation: str = "filter"
    #: The tools the chat template describes to the model (an agent run's), or None.
    tools: Tools | None = None

    @classmethod
    def for_data(
        cls,
        tokenizer: Tokenizer,
        data: DataConfig,
        max_length: int | None,
        tools: Tools | None = None,
    ) -> PromptEncoder:
        if data.chat_template is True and not tokenizer.has_chat_template:
            raise ConfigError(
                "data.chat_template: true, but the model's tokenizer has no chat template"
            )
        return cls(
            tokenizer, data.chat_template, data.system_prompt, max_length, data.truncation, tools
        )

    def __post_init__(self) -> None:
        self._cache: dict[tuple[str, str], list[int]] = {}

    @property
    def templated(self) -> bool:
        """Whether prompts go through the chat template."""
        if self.chat_template == "auto":
            return self.tokenizer.has_chat_template
        return bool(self.chat_template)

    def messages(self, prompt: Prompt) -> list[dict[str, Any]] | None:
        """The chat a prompt is rendered from; None for plain text encoded as it is."""
        if isinstance(prompt, str):
            if not self.templated:
                return None
            chat = [{"role": "user", "content": prompt}]
        else:
            check_chat(prompt)
            chat = [dict(m) for m in prompt]
            if not self.templated:
                raise PromptError(
                    "the prompt is a chat, but data.chat_template is false or the tokenizer "
                    "has no chat template to render it with"
                )
        if self.system_prompt is not None and not any(m["role"] == "system" for m in chat):
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat

    def render(self, prompt: Prompt) -> list[int]:
        """Every token of the prompt, untruncated; raises :class:`PromptError`."""
        chat = self.messages(prompt)
        if chat is None:
            assert isinstance(prompt, str)
            return self.tokenizer.encode_prompt(prompt)
        try:
            return self.tokenizer.encode_chat(chat, self.tools)
        except Exception as e:  # a template is a program: any error is the data's or its own
            raise PromptError(
                f"the chat template failed to render it: {type(e).__name__}: {e}"
            ) from e

    def fits(self, ids: list[int]) -> bool:
        return self.max_length is None or len(ids) <= self.max_length

    def encode(self, prompt: Prompt) -> list[int]:
        """The ids the policy reads: rendered, cut from the left under ``truncate_left``."""
        key = ("text", prompt) if isinstance(prompt, str) else ("chat", repr(prompt))
        ids = self._cache.get(key)
        if ids is None:
            ids = self.render(prompt)
            if self.max_length is not None and len(ids) > self.max_length:
                if self.truncation != "truncate_left":
                    raise PromptError(
                        f"the prompt has {len(ids)} tokens, more than data.max_prompt_length "
                        f"= {self.max_length}"
                    )
                ids = ids[-self.max_length :]
            if len(self._cache) < 1 << 16:
                self._cache[key] = ids
        return list(ids)


def check_chat(chat: Any) -> None:
    """A chat is a list of messages with a string role and content, one at least from the user."""
    if not isinstance(chat, list) or not chat:
        raise PromptError(f"a prompt is text or a non-empty list of messages, not {chat!r:.80}")
    for i, m in enumerate(chat):
        if not isinstance(m, Mapping):
            raise PromptError(f"message {i} is not a {{role, content}} mapping: {m!r:.80}")
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"message {i} needs a string 'role' and 'content', not {m!r:.80}")
    if not any(m["role"] == "user" for m in chat):
        raise PromptError("the chat has no user message")
