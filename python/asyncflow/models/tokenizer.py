"""Tokenizers behind one small interface: a character-level tokenizer for the built-in task
(saved in Hugging Face format so every engine loads it offline), or a model directory's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

PAD, EOS = "<pad>", "<eos>"
CHARS = "0123456789+-*= "


class Tokenizer(Protocol):
    pad_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One token per character, plus ``<pad>`` (0) and ``<eos>`` (1)."""

    def __init__(self) -> None:
        self.vocab = [PAD, EOS, *CHARS]
        self._ids = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.eos_id = 0, 1

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        """Text up to the first ``<eos>``, without padding."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i != self.pad_id and 0 <= i < len(self.vocab):
                out.append(self.vocab[i])
        return "".join(out)

    def save(self, directory: Path) -> None:
        """Writes ``tokenizer.json`` and friends so ``AutoTokenizer`` (and vLLM) load it offline."""
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        raw = RawTokenizer(models.WordLevel(vocab=dict(self._ids), unk_token=PAD))
        raw.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        raw.decoder = decoders.Fuse()
        raw.add_special_tokens([PAD, EOS])
        fast = PreTrainedTokenizerFast(
            tokenizer_object=raw, pad_token=PAD, eos_token=EOS, bos_token=EOS, unk_token=PAD
        )
        fast.save_pretrained(str(directory))


class HFTokenizer:
    """A model directory's own tokenizer."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(directory))
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {directory} has no eos token")
        self.eos_id = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return str(self._tok.decode(ids, skip_special_tokens=True))


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The char tokenizer for models made by :mod:`asyncflow.models.tiny`, else the HF one."""
    marker = Path(model_dir) / "asyncflow_tiny.json"
    return CharTokenizer() if marker.exists() else HFTokenizer(model_dir)
