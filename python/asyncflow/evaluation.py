"""Held-out evaluation: greedy accuracy (pass@1), and pass@k by sampling, each answer judged by
a verifier (exact match unless the run gives its reward function: see :func:`verifier`)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from asyncflow.engines.base import RolloutEngine, Sampling
from asyncflow.tasks.base import Problem
from asyncflow.tasks.prompts import PromptEncoder
from asyncflow.workers.reward import RewardFn, exact_match

CHUNK = 256
log = logging.getLogger(__name__)

#: Whether a response text solves a problem (a score of 1 does).
Verify = Callable[[str, Problem], float]


def exact(text: str, problem: Problem) -> float:
    return exact_match(text, problem.answer)


def verifier(
    reward: RewardFn, extra_keys: bool, batched: bool = False, failed: float = 0.0
) -> Verify:
    """The run's reward function as a verifier of answers: a batched one is given one-element
    lists, an ``async def`` one is awaited. An answer it cannot score (it raises, or returns
    what is not a finite number) scores ``failed``, with a warning naming the problem: 0 for
    held-out evaluation, NaN for training (its group is left out, as in single-turn runs)."""

    def verify(text: str, p: Problem) -> float:
        kwargs: dict[str, Any] = {"extra_info": dict(p.extra)} if extra_keys else {}
        try:
            if batched:
                kwargs = {k: [v] for k, v in kwargs.items()}
                value = reward([text], [p.answer], **kwargs)
            else:
                value = reward(text, p.answer, **kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            score = float(next(iter(cast(Iterable[Any], value))) if batched else value)
        except Exception as e:  # a user function
            log.warning("the reward function failed on problem %r: %s", p.key[:80], e)
            return failed
        if not math.isfinite(score):
            log.warning("the reward function gave %s on problem %r", score, p.key[:80])
            return failed
        return score

    return verify


async def _awaited(value: Any) -> Any:
    return await value


def host_copy(named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Named tensors copied to host memory: the weights of a deferred evaluation."""
    return [(name, t.detach().to("cpu", copy=True)) for name, t in named]


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
