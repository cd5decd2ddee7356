"""The rollout worker in agent mode (``agent.enabled``): the same claims, staleness rule and
routing as :class:`~asyncflow.workers.rollout.Rollout`, with each call's prompt groups run as
multi-turn trajectories by the :class:`~asyncflow.agents.loop.AgentLoop` (all of a call's
trajectories in flight at once). A trajectory is one sample row: ``response_ids`` holds model and
environment tokens in order, ``loss_mask`` tells which the model wrote, ``agent_reward`` is
its reward (the reward worker passes it on) and ``agent_truncated`` whether a budget cut it;
``agent_turns``, ``tool_seconds`` and ``agent_errors`` (failures of every kind) are the figures the
trainer reports per step, with ``agent_truncated``, as means over the trajectories it trained."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from asyncflow.agents.loop import AgentLoop
from asyncflow.agents.trajectory import Trajectory, TrajectoryCompletion
from asyncflow.batch import Batch
from asyncflow.engines.base import Completion, RolloutEngine
from asyncflow.evaluation import verifier
from asyncflow.tasks.base import Problem
from asyncflow.workers.base import Context, step_partition
from asyncflow.workers.reward import packed_prompt, resolve_reward, unpack_answer
from asyncflow.workers.rollout import PromptGroups, Rollout
from asyncflow.workers.routing import Dispatcher


def agent_loop_for(ctx: Context) -> AgentLoop:
    """The run's agent loop, judging answers with ``reward.fn`` as held-out evaluation does,
    but an answer it fails to score is NaN: the trajectory's group is left out of training."""
    c = ctx.config
    extra = bool(c.data.extra_keys)
    verify = verifier(resolve_reward(c.reward.fn, extra), extra, c.reward.batched, math.nan)
    return AgentLoop(c.agent, ctx.tokenizer, verify)


class AgentRollout(Rollout):
    def __init__(
        self,
        ctx: Context,
        engine: RolloutEngine,
        name: str = "rollout",
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__(ctx, engine, name, dispatcher)
        self.loop = agent_loop_for(ctx)

    @property
    def agent_counts(self) -> Counter[str]:
        """Turns, tool calls and failures by kind, over the trajectories run so far."""
        return self.loop.totals

    def _problems(self, work: PromptGroups) -> list[Problem]:
        extra = bool(self.config.data.extra_keys)
        problems = []
        for prompt, packed in zip(work.prompts, work.answers, strict=True):
            truth, info = unpack_answer(bytes(packed), extra, with_prompt=True)
            text = packed_prompt(bytes(packed))
            if text is None:  # a row of an older checkpoint: its ids decoded, as then
                text = self.ctx.tokenizer.decode(prompt.tolist())
            problems.append(Problem(text, truth, info))
        return problems

    def _generate(self, work: PromptGroups, version: int) -> list[list[Completion]] | None:
        """Each prompt's trajectories, as completions whose tokens carry their own masks; None
        when the run stopped first (trajectories wait on tools for long: not for them)."""
        # Under rollout.partial, newer weights are loaded between engine calls: a trajectory's
        # later turns may be a newer policy's (each turn's context prefilled by the weights that
        # generate it). Traced inside this span, not as spans of their own.
        partial = self.config.rollout.partial != "off"
        with self.busy(f"agent trajectories v{version}"):
            runs = self.loop.run(
                self.engine,
                [p.tolist() for p in work.prompts],
                self._problems(work),
                self.sampling,
                stop=self.ctx.stop,
                refresh=(lambda: self.sync_weights_in_flight(traced=False)) if partial else None,
            )
        if runs is None:
            return None
        return [[TrajectoryCompletion.of(t) for t in g] for g in runs]

    def _put_samples(
        self,
        work: PromptGroups,
        version: int,
        outputs: list[list[Completion]],
        ack: Batch | None = None,
    ) -> None:
        columns: dict[str, list[object]] = {
            name: []
            for name in [
                "prompt_ids",
                "response_ids",
                "behaviour_logprobs",
                "token_versions",
                "loss_mask",
                "answer",
            ]
        }
        rewards, turns, tool_seconds, cut, errors, rows_group = [], [], [], [], [], []
        oldest, spans = [], []
        tokens = 0
        for prompt, answer, group, completions in zip(
            work.prompts, work.answers, work.groups, outputs, strict=True
        ):
            for c in completions:
                assert isinstance(c, TrajectoryCompletion) and c.trajectory is not None
                t: Trajectory = c.trajectory
                # The prompt as the trajectory has it (an environment's first observation may
                # have taken its assistant opening: see ``AgentLoop.reset_ids``).
                columns["prompt_ids"].append(np.asarray(t.prompt_ids, prompt.dtype))
                columns["response_ids"].append(np.array(t.response_ids, np.int64))
                columns["behaviour_logprobs"].append(np.array(t.logprobs, np.float32))
                columns["token_versions"].append(np.array(t.versions, np.int64))
                columns["loss_mask"].append(np.array(t.loss_mask, np.uint8))
                columns["answer"].append(answer)
                rewards.append(t.reward)
                turns.append(t.turns)
                tool_seconds.append(t.tool_seconds)
                errors.append(sum(t.errors.values()))
                rows_group.append(int(group))
                # Cut by a budget (the turn's or the trajectory's): only the loop knows, a
                # call left unanswered at the budget's end looks like an answer's end.
                cut.append(t.finish_reason == "length")
                tokens += sum(t.loss_mask)
                # Its age is that of the tokens it trains, the model's: an environment's first
                # observation carries the version the call began with, older after a load.
                trained = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
                first, last = min(trained, default=version), max(trained, default=version)
                oldest.append(first)
                spans.append(last - first)
        with self.busy("put samples"):
            self.store.put(
                {
                    **columns,
                    "agent_reward": np.array(rewards, np.float32),
                    "agent_turns": np.array(turns, np.int32),
                    "tool_seconds": np.array(tool_seconds, np.float32),
                    "agent_truncated": np.array(cut, np.uint8),
                    "agent_errors": np.array(errors, np.int32),
                },
                partition=step_partition(work.target),
                groups=np.array(rows_group),
                group_size=self.sampling.n,
                # A trajectory is as old as its oldest model token.
                version=np.array(oldest, np.uint64),
                ack=ack,
            )
        self.ctx.state.add(
            generated_tokens=tokens,
            generated_samples=len(rewards),
            truncated_responses=sum(cut),
        )
        self.ctx.state.note_version_spans(spans)
