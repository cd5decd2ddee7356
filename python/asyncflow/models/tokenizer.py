"""The one tokenizer every model is read through: the Hugging Face tokenizer saved in the model's
own directory (``AutoTokenizer``, offline), with its chat template when it has one. The built-in
model's tokenizer is made by :mod:`asyncflow.models.chatml` and is loaded the same way."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncflow.errors import ConfigError

#: A chat: messages with a ``role`` and a ``content``.
Messages = Sequence[Mapping[str, Any]]
#: Tools as a chat template reads them: ``{"type": "function", "function": {...}}`` each.
Tools = Sequence[Mapping[str, Any]]


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int
    #: The tokens that end a response: ``eos_id`` and any other end of turn the model names.
    stop_ids: frozenset[int]

    def encode(self, text: str, *, special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], *, special: bool = False) -> str: ...

    def text(self, ids: list[int]) -> str: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer behind the interface the workers use."""

    def __init__(
        self, tokenizer: Any, source: str = "tokenizer", stop_ids: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer
        self.source = source
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer of {source} has no eos token")
        self.eos_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.stop_ids = frozenset({self.eos_id, *map(int, stop_ids)})

    @classmethod
    def from_directory(cls, directory: str | Path) -> HFTokenizer:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(directory))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{directory} holds no Hugging Face tokenizer: {e}") from e
        return cls(tok, str(directory), generation_stop_ids(Path(directory)))

    def __len__(self) -> int:
        return len(self._tok)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """``text``'s ids. With ``special=False`` a special token's string in it (``<|im_end|>``)
        is read as ordinary characters, never as the token: for text that no one vetted (a tool's
        output), which could otherwise end a turn or open one in the model's name."""
        tok = self._tok if special else self._plain
        return list(tok.encode(text, add_special_tokens=False, split_special_tokens=not special))

    def encode_prompt(self, text: str) -> list[int]:
        """A plain-text prompt as the model's tokenizer encodes one by itself: with the special
        tokens it adds (a base model's BOS), as vLLM does with a text prompt."""
        return list(self._tok.encode(text, add_special_tokens=True))

    @functools.cached_property
    def _plain(self) -> Any:
        """A copy of the tokenizer that reads special tokens' strings as text. Not the shared one
        with ``split_special_tokens``: that flips a flag of the tokenizer itself, so a prompt
        encoded meanwhile in another thread lost its special tokens."""
        plain = copy.deepcopy(self._tok)
        plain.split_special_tokens = True
        return plain

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        """Text up to the first stop token, without special tokens; with ``special`` the others
        are kept as their strings (a tool-call format may mark a call with one)."""
        end = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        if special:
            return str(self._tok.decode(ids[:end], skip_special_tokens=False))
        return self.text(ids[:end])

    def text(self, ids: list[int]) -> str:
        """All of ``ids`` as text, without special tokens: a chat prompt's every message (its
        turns end with stop tokens)."""
        return str(self._tok.decode(ids, skip_special_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_chat(self, messages: Messages, tools: Tools | None = None) -> list[int]:
        """The chat rendered by the tokenizer's template, with the assistant's turn opened;
        ``tools`` (schemas, as OpenAI-style APIs write them) for a template that describes them."""
        text = self._tok.apply_chat_template(
            [dict(m) for m in messages], tools=tools, tokenize=False, add_generation_prompt=True
        )
        return self.encode(str(text))


def generation_stop_ids(model_dir: Path) -> list[int]:
    """The end tokens a model's ``generation_config.json`` names (``eos_token_id``: one or a
    list), which a chat model may end its turn with rather than its tokenizer's eos (Gemma's
    ``<end_of_turn>``, Phi-3's ``<|end|>``); vLLM stops on them too."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        named = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path} is not a generation config: {e}") from e
    ids = named if isinstance(named, list) else [] if named is None else [named]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them: {named!r}")
    return ids


def load_tokenizer(model_dir: str | Path) -> HFTokenizer:
    """The tokenizer saved in ``model_dir`` (every model, the built-in one included)."""
    return HFTokenizer.from_directory(model_dir)
