"""Replays a generation token by token under a recorded weight schedule: the reference the
partial-rollout tests hold the engines' recorded versions and log-probs against."""

from __future__ import annotations

from pathlib import Path

import torch

from asyncflow.engines.base import Request, RolloutEngine, Sampling
from asyncflow.engines.hf import load_model

TEMPERATURE = 1.0
PROMPT = [3, 4, 5, 6]
#: Tokens generated under the first version before the second is loaded.
SWITCH = 4


def replay(
    model_dir: Path,
    versions: dict[int, dict[str, torch.Tensor]],
    prompt: list[int],
    tokens: list[int],
    token_versions: list[int],
    mode: str,
) -> list[float]:
    """Each token's log-prob, recomputed with the forward passes the engine ran: one token at a
    time on the cache so far, under the version recorded for it. A version change keeps the cache
    (``continue``: the prefix's keys and values from the old weights) or prefills prompt and prefix
    anew under the new weights (``abort``)."""
    model = load_model(model_dir, "float32").eval()
    params = dict(model.named_parameters())
    cache, loaded, pending, logps = None, None, list(prompt), []
    with torch.no_grad():
        for i, (token, version) in enumerate(zip(tokens, token_versions, strict=True)):
            if version != loaded:
                for name, tensor in versions[version].items():
                    params[name].copy_(tensor)
                if mode == "abort" and loaded is not None:
                    cache, pending = None, [*prompt, *tokens[:i]]
                loaded = version
            out = model(input_ids=torch.tensor([pending]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logp = torch.log_softmax(out.logits[0, -1].float() / TEMPERATURE, -1)
            logps.append(float(logp[token]))
            pending = [token]
    return logps


def generate_with_switch(
    engine: RolloutEngine, new: dict[str, torch.Tensor], mode: str
) -> list[Request]:
    """Two long sequences; version 1 arrives after ``SWITCH`` decode steps."""
    for key in range(2):
        engine.add_request(Request(key, PROMPT, Sampling(max_tokens=16)))
    done: list[Request] = []
    for _ in range(SWITCH):
        done += engine.step()
    cut = engine.abort_requests() if mode == "abort" else []
    engine.load_weights(1, new.items())
    for request in cut:
        engine.add_request(request)
    while engine.in_flight():
        done += engine.step()
    return sorted(done, key=lambda r: r.key)


def policy_versions(model_dir: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Three policy versions: the model's own weights, and two perturbations of them."""
    base = {n: p.detach().clone() for n, p in load_model(model_dir, "float32").named_parameters()}
    out = {0: base}
    gen = torch.Generator().manual_seed(1)
    for v in (1, 2):
        out[v] = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    return out
