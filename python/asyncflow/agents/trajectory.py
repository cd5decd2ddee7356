"""One multi-turn trajectory, kept as token ids from start to end (token in, token out): model
turns are appended as the engine sampled them, environment turns as they were tokenized once.
Nothing is ever re-tokenized, so the trainer scores exactly the tokens the policy saw and wrote.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from asyncflow.engines.base import Completion


@dataclass
class Trajectory:
    prompt_ids: list[int]
    #: Everything after the prompt: model and environment tokens in order.
    response_ids: list[int] = field(default_factory=list)
    #: Per response token: its behaviour log-prob (0 for environment tokens), 1 for a model
    #: token and 0 for an environment token, and the policy version that wrote it (that of the
    #: turn before it, for an environment token).
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_seconds: float = 0.0
    env_reward: float = 0.0
    #: The reward the trajectory is trained with (see ``agent.reward``).
    reward: float = 0.0
    #: The last model turn's text: the answer a verifier judges.
    final_text: str = ""
    #: ``stop`` (the environment ended it), ``length`` (out of tokens), ``turns`` (out of turns).
    finish_reason: str = "stop"
    #: Failures by kind (bad tool calls, tool errors, an environment that raised).
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_model_turn(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [1] * len(ids)
        self.versions += versions
        self.turns += 1

    def add_observation(self, ids: list[int], version: int | None = None) -> None:
        """Environment tokens, of the version of the turn before them (``version`` where there
        is none: the policy in force when the environment was reset)."""
        if self.versions:
            version = self.versions[-1]
        assert version is not None, "an observation before any model turn needs its version"
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [version] * len(ids)


@dataclass
class TrajectoryCompletion(Completion):
    """A trajectory where the rollout worker expects a completion: ``token_ids`` and
    ``logprobs`` are the whole response's, ``text`` is the last model turn's."""

    trajectory: Trajectory | None = None

    @classmethod
    def of(cls, t: Trajectory) -> TrajectoryCompletion:
        reason = "length" if t.finish_reason == "length" else "stop"
        return cls(
            token_ids=list(t.response_ids),
            logprobs=list(t.logprobs),
            text=t.final_text,
            finish_reason=reason,
            trajectory=t,
        )
