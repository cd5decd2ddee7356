"""Held-out evaluation: greedy accuracy (pass@1), and pass@k by sampling, each answer judged by
a verifier (exact match unless the run gives its reward function: see :func:`verifier`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncflow.engines.base import RolloutEngine, Sampling
from asyncflow.tasks.base import Problem
from asyncflow.tasks.prompts import PromptEncoder
from asyncflow.workers.reward import RewardFn, exact_match

CHUNK = 256

#: Whether a response text solves a problem (a score of 1 does).
Verify = Callable[[str, Problem], float]


def exact(text: str, problem: Problem) -> float:
    return exact_match(text, problem.answer)


def verifier(reward: RewardFn, extra_keys: bool) -> Verify:
    """The run's reward function as a verifier of held-out answers."""
    if extra_keys:
        return lambda text, p: reward(text, p.answer, extra_info=dict(p.extra))
    return lambda text, p: reward(text, p.answer)


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
    engine: RolloutEngine,
    problems: Sequence[Problem],
    prompts: PromptEncoder,
    max_tokens: int,
    verify: Verify = exact,
) -> float:
    """Fraction of problems whose greedy answer is verified right."""
    texts = _completions(
        engine, problems, prompts, Sampling(n=1, greedy=True, max_tokens=max_tokens)
    )
    hits = [verify(t[0], p) >= 1.0 for t, p in zip(texts, problems, strict=True)]
    return sum(hits) / max(len(hits), 1)


def pass_at_k(
    engine: RolloutEngine,
    problems: Sequence[Problem],
    prompts: PromptEncoder,
    k: int,
    temperature: float,
    max_tokens: int,
    seed: int = 0,
    verify: Verify = exact,
) -> float:
    """Fraction of problems solved by at least one of ``k`` sampled answers."""
    sampling = Sampling(n=k, temperature=temperature, max_tokens=max_tokens, seed=seed)
    texts = _completions(engine, problems, prompts, sampling)
    solved = [any(verify(t, p) >= 1.0 for t in ts) for ts, p in zip(texts, problems, strict=True)]
    return sum(solved) / max(len(solved), 1)
