"""Held-out evaluation of an agent: a rollout engine seen through the agent loop, so that the
evaluation functions of :mod:`asyncflow.evaluation` (greedy accuracy, pass@k) score whole
trajectories, each judged on its last model turn."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from asyncflow.agents.loop import AgentLoop
from asyncflow.agents.trajectory import TrajectoryCompletion
from asyncflow.config import Config
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.tasks.base import Problem
from asyncflow.tasks.prompts import PromptEncoder


class AgentEvaluator(RolloutEngine):
    """``generate`` runs trajectories: a completion's text is the trajectory's last model turn
    (the answer), its tokens the whole response."""

    def __init__(
        self,
        engine: RolloutEngine,
        loop: AgentLoop,
        problems: Sequence[Problem],
        prompts: PromptEncoder,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.loop = loop
        self.label = engine.label
        self.name = engine.name
        self._problems = {tuple(prompts.encode(p.prompt)): p for p in problems}

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        if hasattr(self, "engine"):
            self.engine.version = value

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        problems = [self._problems.get(tuple(p), Problem("", "")) for p in prompts]
        runs = self.loop.run(self.engine, prompts, problems, sampling)
        assert runs is not None  # only a stop event ends a run early
        return [[TrajectoryCompletion.of(t) for t in group] for group in runs]

    def load_weights(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(version, weights)


def agent_view(
    config: Config, engine: RolloutEngine, problems: Sequence[Problem], prompts: PromptEncoder
) -> RolloutEngine:
    """``engine`` as evaluation should see it: through the agent loop in agent runs."""
    if not config.agent.enabled:
        return engine
    return AgentEvaluator(engine, AgentLoop(config.agent, prompts.tokenizer), problems, prompts)


def agent_totals(workers: Iterable[object]) -> dict[str, int]:
    """The agent loops' counters (turns, tool calls, errors by kind) over the run's workers: those
    that have some (``agent_counts``: an agent rollout worker, the Ray actors' supervisor)."""
    totals: Counter[str] = Counter()
    for worker in workers:
        totals.update(getattr(worker, "agent_counts", {}))
    return dict(sorted(totals.items()))
