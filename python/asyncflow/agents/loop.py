"""The agent loop: many trajectories in flight at once on one asyncio event loop, each
alternating a model turn and an environment turn until the environment says done or
``agent.max_turns`` / ``agent.max_tokens`` run out.

Model turns go through :class:`TurnBatcher`: whatever turns are waiting are generated together
in one engine call (in a thread of the batcher's own, so the event loop goes on), and the turns
that become ready meanwhile make the next call. While one trajectory waits on a tool, the engine
generates the others' turns: it idles only when every trajectory is waiting on its environment.

A plain (not ``async``) environment method and the reward function run in a daemon thread per
call: one that hangs is given up at its timeout (``agent.tool_timeout`` twice over) and holds no
thread that the engine or the other trajectories need, nor the run's end (a thread cannot be
killed; it is left to finish).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from asyncflow.agents.calls import call, in_thread
from asyncflow.agents.env import Environment, Step, cancelled_by_caller, environment_factory
from asyncflow.agents.parser import create_parser
from asyncflow.agents.sandbox import held_in_queue
from asyncflow.agents.tools import Tool, create_tool
from asyncflow.agents.trajectory import Trajectory
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.engines.errors import EngineError
from asyncflow.errors import ConfigError
from asyncflow.models.tokenizer import Tokenizer
from asyncflow.tasks.base import Problem

if TYPE_CHECKING:
    from asyncflow.config import AgentConfig

log = logging.getLogger(__name__)

#: Event-loop iterations a call waits for further turns once one is ready: trajectories woken
#: together (their tools answered at once) take a few to queue their next turns.
GATHER_TICKS = 4

#: Whether an answer text solves a problem (reward.fn as the evaluation's verifier).
Verify = Callable[[str, Problem], float]

#: Characters of an observation tokenized at most per token of the trajectory's budget: the
#: tokens beyond the budget are cut anyway, and a tool that prints megabytes would otherwise
#: hold the event loop (and every trajectory on it) while they are tokenized.
CHARS_PER_TOKEN = 32


class TurnBatcher:
    """Collects model turns from many trajectories and generates them in shared engine calls.
    ``refresh``, if given, is called (in the engine's thread) before each call: it may load
    newer weights into the engine, which then generate the call's turns."""

    def __init__(
        self,
        engine: RolloutEngine,
        sampling: Sampling,
        refresh: Callable[[], object] | None = None,
    ) -> None:
        self.engine = engine
        self.refresh = refresh
        self.sampling = replace(sampling, n=1, seed=None)
        self._pending: list[tuple[list[int], asyncio.Future[tuple[Completion, int]]]] = []
        self._wake = asyncio.Event()
        #: Engine calls made, and turns they generated (how well turns were batched).
        self.calls = 0
        self.turns = 0

    async def generate(self, ids: list[int]) -> tuple[Completion, int]:
        """One turn continuing ``ids``; with the policy version that generated it."""
        future: asyncio.Future[tuple[Completion, int]] = asyncio.get_running_loop().create_future()
        self._pending.append((ids, future))
        self._wake.set()
        return await future

    async def run(self) -> None:
        """Serves turns until cancelled."""
        # The engine's own thread: a call never waits behind other work's threads.
        with ThreadPoolExecutor(1, thread_name_prefix="agent-engine") as executor:
            await self._serve(executor)

    async def _serve(self, executor: ThreadPoolExecutor) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            for _ in range(GATHER_TICKS):  # turns that become ready meanwhile join this call
                await asyncio.sleep(0)
            self._wake.clear()
            batch, self._pending = self._pending, []
            if not batch:
                continue
            call = loop.run_in_executor(executor, self._generate, [ids for ids, _ in batch])
            try:
                version, outputs = await asyncio.shield(call)
                turns = [group[0] for group in outputs]
                if len(turns) != len(batch):
                    raise EngineError(
                        f"the engine answered {len(turns)} of a call's {len(batch)} prompts"
                    )
            except asyncio.CancelledError:
                # A generation call cannot be interrupted: it is waited for without holding
                # the event loop, whose other tasks (tools, sandboxes) wind down meanwhile.
                await asyncio.wait([call])
                raise
            except Exception as e:  # the engine's failure, or an answer of the wrong shape
                if isinstance(e, IndexError):
                    e = EngineError("the engine answered a prompt with no completion")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            self.calls += 1
            self.turns += len(batch)
            for (_, future), turn in zip(batch, turns, strict=True):
                if not future.done():
                    future.set_result((turn, version))

    def _generate(self, prompts: list[list[int]]) -> tuple[int, list[list[Completion]]]:
        """One engine call, after ``refresh``; with the version that generated it."""
        if self.refresh is not None:
            self.refresh()
        version = self.engine.version
        return version, self.engine.generate(prompts, self.sampling)


#: Seconds between looks at the run's stop event while trajectories are under way.
STOP_POLL = 0.1


async def _until_set(event: threading.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(STOP_POLL)


def _as_step(result: Any) -> Step:
    """An environment's step checked: a :class:`Step` or ``(observation, reward, done)``, with
    a finite reward, and tool seconds, tool calls and error counts that are finite and not
    negative; raises ``TypeError`` or ``ValueError`` otherwise."""
    if not isinstance(result, Step):
        observation, reward, done = result
        result = Step(observation, reward, done)
    reward = float(result.reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward {reward} is not finite")
    seconds, calls = float(result.tool_seconds), int(result.tool_calls)
    if not 0.0 <= seconds < math.inf or calls < 0:
        raise ValueError(f"tool_seconds {seconds} and tool_calls {calls}: not counts")
    errors = Counter({str(kind): int(n) for kind, n in dict(result.errors).items()})
    if any(n < 0 for n in errors.values()):
        raise ValueError(f"errors {dict(errors)}: not counts")
    return Step(str(result.observation), reward, bool(result.done), seconds, calls, errors)


def check_names(config: AgentConfig) -> None:
    """Raises ``ConfigError`` naming an environment, tool-call parser or tool that is not
    registered, or an environment its factory fails to make (checked when a run starts, before
    any worker: else every trajectory would end in the error, and every group be left out)."""
    make_env = environment_factory(config.environment)
    create_parser(config.parser)
    tools = {name: create_tool(name, config) for name in config.tools}
    try:
        make_env(config, tools)
    except Exception as e:
        raise ConfigError(
            f"agent.environment {config.environment!r}: its factory, called as "
            f"factory(agent_config, tools), failed: {type(e).__name__}: {e}"
        ) from e


class AgentLoop:
    """Runs trajectories for prompts (token ids) and their problems."""

    def __init__(
        self,
        config: AgentConfig,
        tokenizer: Tokenizer,
        verify: Verify | None = None,
        tools: Mapping[str, Tool] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.verify = verify
        self.tools = (
            dict(tools)
            if tools is not None
            else {name: create_tool(name, config) for name in config.tools}
        )
        self.make_env = environment_factory(config.environment)
        # The template's own text around the observation, tokenized once (its special tokens
        # are the real ones); ``format`` unescapes ``{{``/``}}`` as it would on the whole.
        head, tail = config.observation_template.split("{observation}", 1)
        self._wrap = tokenizer.encode(head.format()), tokenizer.encode(tail.format())
        #: Whether the template's tail holds special tokens (a turn's markers, as ChatML's
        #: does): only such a tail is taken for the assistant's opening (see ``reset_ids``).
        self._tail_opens_turn = self._wrap[1] != tokenizer.encode(tail.format(), special=False)
        #: Totals over every trajectory run so far (for the run's summary).
        self.totals: Counter[str] = Counter()

    def run(
        self,
        engine: RolloutEngine,
        prompts: Sequence[list[int]],
        problems: Sequence[Problem],
        sampling: Sampling,
        stop: threading.Event | None = None,
        refresh: Callable[[], object] | None = None,
    ) -> list[list[Trajectory]] | None:
        """``sampling.n`` trajectories for each prompt, all in flight at once; None if ``stop``
        is set first (the trajectories under way are dropped, their sandboxes killed).
        ``refresh`` runs before each engine call (see :class:`TurnBatcher`)."""
        return asyncio.run(self.run_async(engine, prompts, problems, sampling, stop, refresh))

    async def run_async(
        self,
        engine: RolloutEngine,
        prompts: Sequence[list[int]],
        problems: Sequence[Problem],
        sampling: Sampling,
        stop: threading.Event | None = None,
        refresh: Callable[[], object] | None = None,
    ) -> list[list[Trajectory]] | None:
        batcher = TurnBatcher(engine, sampling, refresh)
        server = asyncio.create_task(batcher.run())
        jobs = asyncio.gather(
            *(
                self.trajectory(batcher, list(prompt), problem)
                for prompt, problem in zip(prompts, problems, strict=True)
                for _ in range(sampling.n)
            )
        )
        # The batcher too: if it ever ended, the turns waiting on it would wait for ever.
        waiting: list[asyncio.Future[Any]] = [jobs, server]
        if stop is not None:
            waiting.append(asyncio.create_task(_until_set(stop)))
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if server.done():
                server.result()  # raises what ended it
                raise EngineError("the agent loop's turn batcher ended")
            if not jobs.done():
                return None
            flat = jobs.result()
        finally:
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        for t in flat:
            self._count(t)
        self.totals["engine_calls"] += batcher.calls
        self.totals["model_turns"] += batcher.turns
        n = sampling.n
        return [flat[k * n : (k + 1) * n] for k in range(len(prompts))]

    def _count(self, t: Trajectory) -> None:
        self.totals["trajectories"] += 1
        self.totals["turns"] += t.turns
        self.totals["tool_calls"] += t.tool_calls
        self.totals["tool_milliseconds"] += round(t.tool_seconds * 1000)
        self.totals[f"finish_{t.finish_reason}"] += 1
        for kind, count in t.errors.items():
            self.totals[f"error_{kind}"] += count

    def observation_ids(self, text: str) -> list[int]:
        """The observation wrapped in the template, as ids; the observation's own text is read
        without special tokens, so a tool cannot end the turn or write one for the model."""
        head, tail = self._wrap
        return head + self._text_ids(text) + tail

    def reset_ids(self, prompt: list[int], text: str) -> tuple[list[int], list[int]]:
        """Where the observation of an environment's ``reset`` goes: ``(prompt, ids after it)``.
        A prompt that ends as the observation template does, where that tail holds special
        tokens (it opens the assistant's turn, as ChatML's does), loses that opening, and the
        ids after it are the observation, after a blank line in the prompt's last message, then
        the opening again: the model reads it in the user's turn. After another prompt, or with
        a template whose tail is plain text, the observation follows as one wrapped in the
        template."""
        tail = self._wrap[1]
        if self._tail_opens_turn and prompt[-len(tail) :] == tail:
            return prompt[: -len(tail)], self._text_ids("\n\n" + text) + tail
        return prompt, self.observation_ids(text)

    def _text_ids(self, text: str) -> list[int]:
        text = text[: CHARS_PER_TOKEN * self.config.max_tokens]
        # Text a tool or environment made from the model's output may hold lone surrogates
        # (JSON's "\ud800"), which no tokenizer encodes: replaced, not raised.
        text = text.encode("utf-8", "replace").decode("utf-8")
        return self.tokenizer.encode(text, special=False)

    async def trajectory(
        self, batcher: TurnBatcher, prompt: list[int], problem: Problem
    ) -> Trajectory:
        """One trajectory, scored. An environment that raises or hangs ends it with the error
        counted and a NaN reward: the failure is not the model's, so its group is left out of
        training, as when the reward function fails. Only the engine's failures raise (a broken
        engine is the run's failure)."""
        t = await self._play(batcher, prompt, problem)
        t.reward = math.nan if t.finish_reason == "error" else await self._reward(t, problem)
        return t

    async def _play(self, batcher: TurnBatcher, prompt: list[int], problem: Problem) -> Trajectory:
        t = Trajectory(prompt)
        budget = self.config.max_tokens
        try:
            env: Environment = self.make_env(self.config, self.tools)
        except Exception as e:
            return self._failed(t, "env_raised", e)
        ok, first = await self._env_call(t, env.reset, problem)
        if not ok:
            return self._finish(t, "error")
        if first:
            t.prompt_ids, ids = self.reset_ids(t.prompt_ids, str(first))
            t.add_observation(ids[:budget], batcher.engine.version)
        while True:
            if t.turns >= self.config.max_turns:
                return self._finish(t, "turns")
            if len(t.response_ids) >= budget:
                return self._finish(t, "length")
            completion, version = await batcher.generate(t.prompt_ids + t.response_ids)
            room = budget - len(t.response_ids)
            ids, logprobs = completion.token_ids[:room], completion.logprobs[:room]
            t.add_model_turn(ids, logprobs, [version] * len(ids))
            t.final_text = self.tokenizer.decode(ids)
            # Cut short by the turn's or the budget's end. A turn that ended is one the engine
            # stopped: on the tokenizer's end token, or on another that the model's generation
            # settings name (a chat model may have several).
            if not ids or len(completion.token_ids) > room or completion.finish_reason != "stop":
                return self._finish(t, "length")
            last = t.turns >= self.config.max_turns
            if last and self.config.reward == "verifier":
                # Nothing the environment answers would be read or counted: no tool runs.
                return self._finish(t, "turns")
            # The environment reads the turn with its special tokens (a call may be marked by
            # one, as Mistral's and Llama 3.1's are); the verifier reads it without.
            action = self.tokenizer.decode(ids, special=True)
            ok, result = await self._env_call(t, env.step, action)
            if not ok:
                return self._finish(t, "error")
            try:
                step = _as_step(result)
            except (TypeError, ValueError, OverflowError) as e:
                return self._failed(t, "env_bad_step", e)
            t.env_reward += step.reward
            t.tool_calls += step.tool_calls
            t.tool_seconds += step.tool_seconds
            t.errors.update(step.errors)
            if step.done:
                return self._finish(t, "stop")
            if last:  # its reward counted; its observation would never be read
                return self._finish(t, "turns")
            obs = self.observation_ids(step.observation)
            if len(t.response_ids) + len(obs) > budget:
                t.add_observation(obs[: budget - len(t.response_ids)])
                return self._finish(t, "length")
            t.add_observation(obs)

    async def _env_call(
        self, t: Trajectory, fn: Callable[..., Any], *args: Any
    ) -> tuple[bool, Any]:
        """``fn(*args)`` of the environment, bounded in time (its tools' waits for a sandbox
        slot not counted); a failure is counted in ``t``."""
        try:
            async with asyncio.timeout(self.config.tool_timeout * 2) as deadline:
                with held_in_queue(deadline):
                    return True, await call(fn, *args)
        except TimeoutError:
            t.errors["env_timeout"] += 1
        except asyncio.CancelledError as e:
            if cancelled_by_caller():
                raise
            log.warning("agent environment failed: %s", type(e).__name__)
            t.errors["env_raised"] += 1
        except Exception as e:
            log.warning("agent environment failed: %s: %s", type(e).__name__, e)
            t.errors["env_raised"] += 1
        return False, None

    def _failed(self, t: Trajectory, kind: str, e: Exception) -> Trajectory:
        log.warning("agent environment failed: %s: %s", type(e).__name__, e)
        t.errors[kind] += 1
        return self._finish(t, "error")

    def _finish(self, t: Trajectory, reason: str) -> Trajectory:
        t.finish_reason = reason
        return t

    async def _reward(self, t: Trajectory, problem: Problem) -> float:
        mode = self.config.reward
        score = t.env_reward if mode in ("env", "both") else 0.0
        if mode in ("verifier", "both") and self.verify is not None:
            # A user's function, off the event loop: a slow one holds up no other trajectory,
            # and an ``async def`` one gets a loop of its own there. A trajectory it failed to
            # score (NaN: it raised, gave no finite number, or hung) is left out of training.
            try:
                verified = await asyncio.wait_for(
                    in_thread(self.verify, t.final_text, problem), self.config.tool_timeout * 2
                )
            except TimeoutError:
                t.errors["reward_timeout"] += 1
                return math.nan
            except Exception as e:  # no thread to run it in (the machine's limit reached)
                log.warning("agent verifier failed: %s: %s", type(e).__name__, e)
                verified = math.nan
            if math.isnan(verified):
                t.errors["reward_failed"] += 1
            score += verified
        return score
