"""The built-in model's tokenizer, made locally: one token per printable ASCII character and
newline, ChatML's control tokens and role names as whole tokens, and a ChatML (Qwen-style) chat
template. It is saved as an ordinary Hugging Face tokenizer, and ``AutoTokenizer`` and vLLM load
it as they load any model's: for the Qwen2 model it belongs to, transformers reads it as a Qwen2
tokenizer, whose byte-level pre-tokenizer finds no token for a space or a newline, so the
tokenizer runs load drops whitespace when it encodes and decodes (the one built in memory here,
:func:`chatml_tokenizer`, keeps it)."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from asyncflow.models.tokenizer import HFTokenizer

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL = [PAD, IM_START, IM_END, UNK]
#: Whole tokens, so that a chat's framing costs a few positions, not dozens.
ROLES = ["system", "user", "assistant"]
CHARACTERS = "\n" + "".join(c for c in string.printable if c.isprintable())

#: Every message in order, then (``add_generation_prompt``) the assistant's opened turn; as
#: Qwen's, without a default system message (``data.system_prompt`` adds one) and without a
#: list of tools (the model learns the format from demonstrations). Tool calls and answers render
#: as the agent loop writes them (docs/agents.md): an assistant message's ``tool_calls`` as
#: ``<tool_call>{"name":...,"arguments":{...}}</tool_call>`` after its content (arguments given
#: as a JSON string are written as they are), and a run of
#: ``tool`` messages as one user turn of ``<tool_response>`` blocks, one per line.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{ '<|im_start|>user' }}"
    "{%- endif -%}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{ '<|im_end|>' + '\n' }}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set f = call['function'] if call['function'] is defined else call -%}"
    "{%- set arguments = f['arguments'] if f['arguments'] is string "
    "else f['arguments'] | tojson(separators=(',', ':')) -%}"
    "{{ '<tool_call>{\"name\":' + f['name'] | tojson + ',\"arguments\":' + arguments "
    "+ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def _fast_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL, *CHARACTERS])}
    raw = RawTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    raw.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    raw.add_tokens([AddedToken(r, special=False, normalized=False) for r in ROLES])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
    )


def chatml_tokenizer() -> HFTokenizer:
    """The built-in tokenizer, in memory (for tests and tools; runs load it from the model's
    directory)."""
    return HFTokenizer(_fast_tokenizer(), "the built-in ChatML tokenizer")


def save_chatml_tokenizer(directory: Path) -> int:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` and the chat template into
    ``directory``; returns the vocabulary size."""
    fast = _fast_tokenizer()
    fast.save_pretrained(str(directory))
    return len(fast)
