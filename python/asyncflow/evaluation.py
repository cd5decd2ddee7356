"""Held-out evaluation: greedy exact match (pass@1), and pass@k by sampling."""

from __future__ import annotations

from collections.abc import Sequence

from asyncflow.engines.base import RolloutEngine, Sampling
from asyncflow.tasks.base import Problem
from asyncflow.tasks.prompts import PromptEncoder
from asyncflow.workers.reward import exact_match

CHUNK = 256


def _completions(
    engine: RolloutEngine, problems: Sequence[Problem], prompts: PromptEncoder, sampling: Sampling
) -> list[list[str]]:
    texts: list[list[str]] = []
    for start in range(0, len(problems), CHUNK):
        chunk = problems[start : start + CHUNK]
        outs = engine.generate([prompts.encode(p.prompt) for p in chunk], sampling)
        texts += [[c.text for c in group] for group in outs]
    return texts


def accuracy(
    engine: RolloutEngine, problems: Sequence[Problem], prompts: PromptEncoder, max_tokens: int
) -> float:
    """Fraction of problems whose greedy answer matches exactly."""
    texts = _completions(
        engine, problems, prompts, Sampling(n=1, greedy=True, max_tokens=max_tokens)
    )
    hits = [exact_match(t[0], p.answer) for t, p in zip(texts, problems, strict=True)]
    return sum(hits) / max(len(hits), 1)


def pass_at_k(
    engine: RolloutEngine,
    problems: Sequence[Problem],
    prompts: PromptEncoder,
    k: int,
    temperature: float,
    max_tokens: int,
    seed: int = 0,
) -> float:
    """Fraction of problems solved by at least one of ``k`` sampled answers."""
    sampling = Sampling(n=k, temperature=temperature, max_tokens=max_tokens, seed=seed)
    texts = _completions(engine, problems, prompts, sampling)
    solved = [
        any(exact_match(t, p.answer) for t in ts) for ts, p in zip(texts, problems, strict=True)
    ]
    return sum(solved) / max(len(solved), 1)
