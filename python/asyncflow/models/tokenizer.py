"""The one tokenizer every model is read through: the Hugging Face tokenizer saved in the model's
own directory (``AutoTokenizer``, offline), with its chat template when it has one. The built-in
model's tokenizer is made by :mod:`asyncflow.models.chatml` and is loaded the same way."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

#: A chat: messages with a ``role`` and a ``content``.
Messages = Sequence[Mapping[str, Any]]


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int

    def encode(self, text: str, *, special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode_chat(self, messages: Messages) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer behind the interface the workers use."""

    def __init__(self, tokenizer: Any, source: str = "tokenizer") -> None:
        self._tok = tokenizer
        self.source = source
        if tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer of {source} has no eos token")
        self.eos_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id

    @classmethod
    def from_directory(cls, directory: str | Path) -> HFTokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory))
        except (OSError, ValueError) as e:
            raise ValueError(f"{directory} holds no Hugging Face tokenizer: {e}") from e
        return cls(tok, str(directory))

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """``text``'s ids. With ``special=False`` a special token's string in it (``<|im_end|>``)
        is read as ordinary characters, never as the token: for text that no one vetted (a tool's
        output), which could otherwise end a turn or open one in the model's name."""
        tok = self._tok if special else self._plain
        return list(tok.encode(text, add_special_tokens=False, split_special_tokens=not special))

    @functools.cached_property
    def _plain(self) -> Any:
        """A copy of the tokenizer that reads special tokens' strings as text. Not the shared one
        with ``split_special_tokens``: that flips a flag of the tokenizer itself, so a prompt
        encoded meanwhile in another thread lost its special tokens."""
        plain = copy.deepcopy(self._tok)
        plain.split_special_tokens = True
        return plain

    def decode(self, ids: list[int]) -> str:
        """Text up to the first eos token, without special tokens."""
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self._tok.decode(ids, skip_special_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_chat(self, messages: Messages) -> list[int]:
        """The chat rendered by the tokenizer's template, with the assistant's turn opened."""
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
        return self.encode(str(text))


def load_tokenizer(model_dir: str | Path) -> HFTokenizer:
    """The tokenizer saved in ``model_dir`` (every model, the built-in one included)."""
    return HFTokenizer.from_directory(model_dir)
