"""A chat model whose turn ends on a token other than its tokenizer's eos (Gemma's
``<end_of_turn>``, Phi-3's ``<|end|>``, Qwen's ``<|im_end|>`` beside ``<|endoftext|>``), named in
its ``generation_config.json``: the hf engine stops there, as vLLM does, and the text ends there."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from asyncflow.engines.base import Request, Sampling
from asyncflow.engines.hf import sample
from asyncflow.engines.hf_decode import DecodeLoop
from asyncflow.models.chatml import save_chatml_tokenizer
from asyncflow.models.tokenizer import HFTokenizer, load_tokenizer


def end_of_turn_model(d: Path) -> tuple[HFTokenizer, int]:
    """A tokenizer whose eos is ``<|endoftext|>`` and whose model ends turns with
    ``<|im_end|>``, as its generation config says; and that end-of-turn id."""
    save_chatml_tokenizer(d)
    settings = json.loads((d / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|endoftext|>"
    (d / "tokenizer_config.json").write_text(json.dumps(settings))
    end = int(load_tokenizer(d)._tok.convert_tokens_to_ids("<|im_end|>"))
    eos = load_tokenizer(d).eos_id
    assert end != eos
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eos]}))
    return load_tokenizer(d), end


class Scripted(torch.nn.Module):
    """Says its script one token a call, whatever it is given."""

    def __init__(self, script: list[int], vocab: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.script, self.vocab, self.calls = script, vocab, 0

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> types.SimpleNamespace:
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e9)
        logits[:, -1, self.script[min(self.calls, len(self.script) - 1)]] = 0.0
        self.calls += 1
        return types.SimpleNamespace(logits=logits, past_key_values=None)


def test_the_stop_tokens_are_the_eos_and_the_generation_configs(tmp_path: Path) -> None:
    tok, end = end_of_turn_model(tmp_path)
    assert tok.stop_ids == {tok.eos_id, end}
    assert tok.decode([*tok.encode("4"), end, *tok.encode("more")]) == "4"


@pytest.mark.parametrize("loop", ["batched", "request-level"])
def test_the_hf_engine_stops_at_the_models_end_of_turn(tmp_path: Path, loop: str) -> None:
    tok, end = end_of_turn_model(tmp_path)
    script = [*tok.encode("4"), end, *tok.encode("\nuser: 5+5=10"), tok.eos_id]
    model = Scripted(script, len(tok))
    prompt = tok.encode("2+2=")
    sampling = Sampling(n=1, greedy=True, max_tokens=32)
    if loop == "batched":
        ((c,),) = sample(model, [prompt], sampling, tok)
        done: tuple[list[int], str, str | None] = (c.token_ids, c.text, c.finish_reason)
    else:
        decode = DecodeLoop(model, tok.stop_ids, max_num_seqs=1)
        decode.add(request := Request((0, 0), prompt, sampling))
        while not decode.step(version=0):
            pass
        done = (request.token_ids, tok.decode(request.token_ids), request.finish_reason)
    assert done == ([*tok.encode("4"), end], "4", "stop")


def test_a_generation_config_naming_no_token_id_is_refused(tmp_path: Path) -> None:
    save_chatml_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<end>"]}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        load_tokenizer(tmp_path)
