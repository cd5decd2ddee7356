"""The hf engine's request-level loop: sequences decoded one step at a time, each with its own KV
cache, up to ``max_num_seqs`` in flight and queued ones admitted as others finish.

Each sequence runs as a batch of one (no padding, positions from its own cache), so a token's
log-prob depends only on its own sequence and on the weights of each forward pass: a replay of
the same forward passes under the same weight schedule gives the same figures, bit for bit on a
CPU. Between two steps the weights may be replaced; the caches are kept, so a sequence goes on
attending to keys and values the old weights computed (``rollout.partial: continue``).

Inputs, caches and seeded generators live on the model's device; each token and its log-prob
come back to the host as Python numbers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow.engines.base import Request


def model_device(model: Any) -> torch.device:
    """Where ``model``'s parameters live."""
    return next(iter(model.parameters())).device  # type: ignore[no-any-return]


@dataclass
class _Running:
    request: Request
    #: Tokens the next forward pass feeds: the prompt and any prefix at admission, then the last
    #: sampled token.
    pending: list[int]
    cache: Any = None
    generator: torch.Generator | None = None


class DecodeLoop:
    """Continuous batching of requests over one transformers model."""

    def __init__(self, model: Any, stop_ids: frozenset[int], max_num_seqs: int) -> None:
        self.model = model
        self.device = model_device(model)
        self.stop_ids = stop_ids
        self.max_num_seqs = max_num_seqs
        self.queued: deque[Request] = deque()
        self.running: list[_Running] = []

    def add(self, request: Request) -> None:
        self.queued.append(request)

    def __len__(self) -> int:
        return len(self.queued) + len(self.running)

    def abort(self, keys: Collection[Any] | None = None) -> list[Request]:
        """The requests whose key is in ``keys`` (default: every one), running ones first, with
        their prefix; their caches are dropped."""

        def cut(request: Request) -> bool:
            return keys is None or request.key in keys

        running = [r.request for r in self.running if cut(r.request)]
        queued = [r for r in self.queued if cut(r)]
        self.running = [r for r in self.running if not cut(r.request)]
        self.queued = deque(r for r in self.queued if not cut(r))
        return running + queued

    def step(self, version: int) -> list[Request]:
        """Admits queued requests while there is room, then samples one token of each running
        one under the weights the model holds now (``version``); returns those that finished."""
        while self.queued and len(self.running) < self.max_num_seqs:
            request = self.queued.popleft()
            generator = None
            if request.sampling.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
            self.running.append(
                _Running(request, [*request.prompt, *request.token_ids], generator=generator)
            )
        finished: list[Request] = []
        for seq in self.running:
            self._advance(seq, version)
            if seq.request.finish_reason is not None:
                finished.append(seq.request)
        if finished:
            self.running = [s for s in self.running if s.request.finish_reason is None]
        return finished

    @torch.no_grad()
    def _advance(self, seq: _Running, version: int) -> None:
        request = seq.request
        if request.remaining <= 0:  # re-admitted with nothing left to generate
            request.finish_reason = "length"
            return
        out = self.model(
            input_ids=torch.tensor([seq.pending], device=self.device),
            past_key_values=seq.cache,
            use_cache=True,
        )
        seq.cache = out.past_key_values
        token, logprob = pick(out.logits[0, -1], request, seq.generator)
        request.token_ids.append(token)
        request.logprobs.append(logprob)
        request.versions.append(version)
        seq.pending = [token]
        if token in self.stop_ids:
            request.finish_reason = "stop"
        elif request.remaining <= 0:
            request.finish_reason = "length"


def pick(
    logits: torch.Tensor, request: Request, generator: torch.Generator | None
) -> tuple[int, float]:
    """The next token from one position's ``logits``, and its log-prob under the sampling
    distribution (temperature applied; greedy: the plain distribution)."""
    s = request.sampling
    logits = logits.float()
    if s.greedy:
        logp = torch.log_softmax(logits, -1)
        token = int(logits.argmax(-1))
    else:
        logp = torch.log_softmax(logits / s.temperature, -1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return token, float(logp[token])
