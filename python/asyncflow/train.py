"""The main job: ``asyncflow train``.

Order of a run: resolve the run directory and write the resolved config; find the model (the
built-in one is created locally) and read its tokenizer; build the task, every prompt checked and
rendered (bad rows are refused here, before anything starts); warm-start the model with a short
supervised pass; open the store; start the engines; measure held-out accuracy; then run the
asynchronous RL pipeline (feeder -> rollout -> reward -> [reference] -> advantage -> trainer, all
through the store) until ``trainer.max_steps``; measure again; write the final model,
``summary.json``, ``metrics.jsonl``, the timeline trace and the summary figure.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncflow import checkpoint, weights
from asyncflow.agents.evaluation import agent_totals, agent_view
from asyncflow.agents.loop import check_names
from asyncflow.agents.tools import prompt_tools
from asyncflow.config import Config, resolve_engine_name
from asyncflow.config import load as load_config
from asyncflow.engines.base import RolloutEngine, Sampling, StepTrainEngine, TrainEngine
from asyncflow.engines.registry import check_engine_names
from asyncflow.errors import ConfigError
from asyncflow.evaluation import accuracy, host_copy, pass_at_k, verifier
from asyncflow.launch.base import Resources, launcher
from asyncflow.launch.local import run_threads
from asyncflow.launch.rank_process import check_rank_engine
from asyncflow.models.tiny import create_tiny_model, parameter_count
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.progress import Reporter
from asyncflow.quiet import quiet_libraries
from asyncflow.store import Store
from asyncflow.tasks import Task
from asyncflow.tasks.loader import load_task
from asyncflow.tasks.prompts import PromptEncoder
from asyncflow.telemetry.figure import write_summary_png
from asyncflow.telemetry.metrics import MetricsLog
from asyncflow.telemetry.trace import Tracer
from asyncflow.warm_start import warm_start
from asyncflow.workers.absent import AbsentConsumers
from asyncflow.workers.base import PROMPTS, SAMPLES, Context, RunState
from asyncflow.workers.batches import to_train_batch
from asyncflow.workers.colocation import EngineSleep
from asyncflow.workers.critic import CriticWorker
from asyncflow.workers.feeder import Feeder
from asyncflow.workers.reward import (
    resolve_reward,
    separate_reward_model,
)
from asyncflow.workers.trainer import Ledger, Trainer

PASS_K = 8


@dataclass
class Phase:
    """Wall-clock seconds of each phase of the run."""

    seconds: dict[str, float] = field(default_factory=dict)

    def timed(self, name: str, since: float) -> None:
        self.seconds[name] = round(time.monotonic() - since, 3)


def resolve_run_dir(config: Config, run_dir: Path | None) -> Path:
    """``--run-dir``, or ``<output_dir>/<name>`` (with ``-2``, ``-3``... if that exists)."""
    if run_dir is not None:
        return run_dir
    name = Path(config.run.name)
    if not config.run.name.strip() or name.is_absolute() or ".." in name.parts or not name.parts:
        # Empty or '.', it put the run beside run.output_dir (runs-2); '..', outside it.
        raise ConfigError(
            f"run.name {config.run.name!r} must name a directory inside run.output_dir: a "
            "relative path, not '.', without '..'"
        )
    base = Path(config.run.output_dir) / name
    candidate, k = base, 2
    while candidate.exists():
        candidate, k = base.with_name(f"{base.name}-{k}"), k + 1
    return candidate


def logprob_agreement(
    rollout: RolloutEngine,
    trainer: TrainEngine,
    prompts: list[list[int]],
    config: Config,
    pad_id: int,
) -> float:
    """Largest |log-prob difference| between the rollout engine's sampled-token log-probs and the
    train engine's for the same weights and tokens."""
    sampling = Sampling(
        n=1, temperature=config.rollout.temperature, max_tokens=config.rollout.max_tokens, seed=1
    )
    outs = [group[0] for group in rollout.generate(prompts, sampling)]
    responses = [np.array(c.token_ids, np.int64) for c in outs]
    batch = to_train_batch([np.array(p, np.int64) for p in prompts], responses, pad_id)
    ours = trainer.logprobs(batch)
    worst = 0.0
    for i, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        theirs = torch.tensor(c.logprobs)
        mine = ours[i, len(p) : len(p) + len(c.token_ids)].float()
        worst = max(worst, float((theirs - mine).abs().max()))
    return worst


def warm_starts(config: Config) -> bool:
    """Whether the run begins with the warm start (``warm_start.enabled``, or by default only
    for the built-in model)."""
    enabled = config.warm_start.enabled
    return config.model.path is None if enabled is None else enabled


#: Settings a resumed run must keep: they decide which prompts make which step and group (the
#: checkpoint's cursor and in-flight rows count in them) and which model the weights fit.
#: ``trainer.ppo_epochs``: the learning-rate schedule counts optimiser steps, that many a step.
#: ``warm_start``: a run stopped before its first checkpoint resumes from its warm start.
#: ``trainer.engine``: each engine reads only the checkpoints it writes.
RESUME_FIXED = (
    "run.seed",
    "trainer.engine",
    "rollout.n",
    "trainer.groups_per_step",
    "trainer.ppo_epochs",
    "data",
    "model",
    "warm_start",
)


def check_resumable(config: Config, run_dir: Path) -> None:
    """Refuses to resume ``run_dir`` with settings that would change what its checkpoint's rows
    and cursor mean (groups skipped or split, a model of another shape)."""
    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml there; is it a run directory?")
    for leaf, was, will in changed(config, saved_file, RESUME_FIXED):
        raise ConfigError(
            f"cannot resume {run_dir} with {leaf} changed: it was {was!r}, now {will!r} "
            "(start a new run instead)"
        )
    last = checkpoint.latest(run_dir)
    if last is not None and checkpoint.step_of(last) > config.trainer.max_steps:
        raise ConfigError(
            f"cannot resume {run_dir} with trainer.max_steps {config.trainer.max_steps}: its "
            f"checkpoint {last.name} is past it"
        )


def check_fresh(config: Config, run_dir: Path) -> None:
    """Refuses a new run in ``run_dir`` where a run trained already (their ledgers and
    checkpoints would mix), or where one stopped before training with another model or warm
    start (its built model and warm start would be taken for this run's)."""
    if (run_dir / "ledger.jsonl").exists() or checkpoint.latest(run_dir):
        raise ConfigError(
            f"{run_dir} holds a run already: resume it (--resume {run_dir}) or give another "
            "--run-dir"
        )
    saved_file = run_dir / "config.yaml"
    if saved_file.is_file():
        for leaf, was, will in changed(config, saved_file, ("run.seed", "model", "warm_start")):
            raise ConfigError(
                f"{run_dir} holds the start of a run with {leaf} {was!r}, not {will!r}: give "
                "another --run-dir"
            )


def changed(
    config: Config, saved_file: Path, keys: Sequence[str]
) -> Iterator[tuple[str, Any, Any]]:
    """``(dotted key, saved, now)`` of each setting under ``keys`` that ``config`` changes."""
    saved, now = load_config(saved_file).to_dict(), config.to_dict()
    for key in keys:
        yield from _changes(_dotted(saved, key), _dotted(now, key), key)


def _dotted(settings: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        settings = settings[part]
    return settings


def _changes(was: Any, will: Any, key: str) -> Iterator[tuple[str, Any, Any]]:
    """``(dotted key, was, will)`` of each setting under ``key`` that differs."""
    if isinstance(was, dict) and isinstance(will, dict):
        for name in was.keys() | will.keys():
            yield from _changes(was.get(name), will.get(name), f"{key}.{name}")
    elif was != will:
        yield key, was, will


def prompt_budget(config: Config, model_dir: Path) -> int:
    """What the tightest bound on a sample leaves for the prompt once a response is added: the
    model's positions, ``rollout.max_model_len`` and the trainer's micro-batch
    (``trainer.micro_batch_tokens``, which must hold a whole sample); ``data.max_prompt_length``
    if set, which may not be more. The response is ``rollout.max_tokens``, or in agent runs a
    whole trajectory's ``agent.max_tokens`` (model and environment turns), should it be the
    larger."""
    hf_config = json.loads((model_dir / "config.json").read_text())
    # A multimodal model's (Gemma 3, Qwen2-VL) language model says it in its own section; GPT-2
    # style configs name it n_positions.
    sections = [hf_config, hf_config.get("text_config") or {}]
    positions = next(
        (s[k] for s in sections for k in ("max_position_embeddings", "n_positions") if k in s),
        None,
    )
    bounds = {
        "the model's positions": positions,
        "rollout.max_model_len": config.rollout.max_model_len,
        "trainer.micro_batch_tokens": config.trainer.micro_batch_tokens,
    }
    bound, most = min(((k, int(v)) for k, v in bounds.items() if v is not None), key=lambda b: b[1])
    response, name = config.rollout.max_tokens, "rollout.max_tokens"
    if config.agent.enabled and config.agent.max_tokens > response:
        response, name = config.agent.max_tokens, "agent.max_tokens"
    if most <= response:
        raise ConfigError(f"{bound} ({most}) leave no room for a prompt before {name} ({response})")
    wanted = config.data.max_prompt_length
    if wanted is None:
        return most - response
    if wanted > most - response:
        # A longer prompt would have its response cut short by the engine, before
        # rollout.max_tokens, where the overlong rules do not see it.
        raise ConfigError(
            f"data.max_prompt_length ({wanted}) and {name} ({response}) are more than "
            f"{bound} ({most}): at most {most - response} for prompts"
        )
    return wanted


#: Consumers of the samples that only some runs have.
OPTIONAL_TASKS = ("reward_model", "reference", "critic", "critic_train")


def register_tasks(
    store: Store, reference: bool, reward_model: bool = False, critic: bool = False
) -> list[str]:
    """Declares the pipeline's consumers, so that rows are kept until each has acked them.
    Returns the optional ones registered on the store (by an earlier run on the same daemon)
    that this run does not have: rows wait for their acks too (see
    :class:`~asyncflow.workers.absent.AbsentConsumers`)."""
    store.register_task("rollout", partitions=[PROMPTS])
    for task in ["reward", "advantage", "train"]:
        store.register_task(task, partitions=[SAMPLES])
    if reward_model:
        store.register_task("reward_model", partitions=[SAMPLES])
    if reference:
        store.register_task("reference", partitions=[SAMPLES])
    if critic:  # scoring samples (values), and training on their returns
        for task in ["critic", "critic_train"]:
            store.register_task(task, partitions=[SAMPLES])
    mine = {
        "reward_model": reward_model,
        "reference": reference,
        "critic": critic,
        "critic_train": critic,
    }
    registered = store.stats()["tasks"]
    return [t for t in OPTIONAL_TASKS if t in registered and not mine[t]]


class Run:
    """One execution of the main job."""

    def __init__(self, config: Config, run_dir: Path, reporter: Reporter, resume: bool) -> None:
        self.config = config
        self.run_dir = run_dir
        self.reporter = reporter
        self.resume = resume
        self.phases = Phase()
        self.started = time.monotonic()
        #: Where the run's parts ran, for the summary (launcher ray).
        self.placement: dict[str, Any] = {}
        #: Prompts left out for being too long, by split.
        self.too_long: dict[str, int] = {}
        #: The critic's worker (``algorithm.advantage: gae``), for its figures in the summary.
        self.critic: CriticWorker | None = None
        #: ``rollout.sleep_while_training``: the engines' sleeps, for their cost in the summary.
        self.engine_sleep: EngineSleep | None = None

    # -- preparation --------------------------------------------------------------------------

    def base_model(self) -> Path:
        c = self.config
        if c.model.path is not None:
            return Path(c.model.path)
        base = self.run_dir / "model-init"
        if not (base / "config.json").exists():
            self.reporter.line(f"creating the built-in tiny Qwen2 model in {base}")
            with checkpoint.made_whole(base) as into:
                create_tiny_model(c.model, into, c.run.seed)
        return base

    def load_task(self, base: Path) -> tuple[Task, PromptEncoder]:
        """The task, every prompt checked against the model's tokenizer."""
        c = self.config
        resolve_reward(c.reward.fn, bool(c.data.extra_keys))  # refused now, not mid-run
        prompts = PromptEncoder.for_data(
            load_tokenizer(base), c.data, prompt_budget(c, base), prompt_tools(c)
        )
        task = load_task(c.data, prompts)
        self.too_long = dict(getattr(task, "too_long", {}))
        if any(self.too_long.values()):
            self.reporter.line(
                f"left out prompts longer than {prompts.max_length} tokens: "
                + ", ".join(f"{split} {n}" for split, n in self.too_long.items())
            )
        return task, prompts

    def prepare_model(self, task: Task, prompts: PromptEncoder, base: Path) -> Path:
        c = self.config
        warm = self.run_dir / "warm_start"
        if not warm_starts(c):
            return base
        if (warm / "config.json").exists():
            return warm
        since = time.monotonic()
        with (
            self.reporter.task("warm start", c.warm_start.steps) as advance,
            checkpoint.made_whole(warm) as into,
        ):
            warm_start(
                c, task, prompts, base, into, lambda step, loss: advance(step, f"loss {loss:.3f}")
            )
        self.phases.timed("warm_start", since)
        return warm

    # -- the run ------------------------------------------------------------------------------

    def execute(self) -> dict[str, Any]:
        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume:  # a resume's, once its checkpoint has loaded (see _run)
            (self.run_dir / "config.yaml").write_text(c.to_yaml())
        torch.manual_seed(c.run.seed)
        base = self.base_model()
        task, prompts = self.load_task(base)
        model_dir = self.prepare_model(task, prompts, base)
        with contextlib.ExitStack() as cleanup:
            since = time.monotonic()
            start = launcher(c.launcher)
            resources = start(c, model_dir, self.run_dir, cleanup, self.reporter.line)
            self.placement = resources.placement
            self.phases.timed("engine_start", since)
            return self._run(task, prompts, model_dir, resources)

    def _run(
        self, task: Task, prompts: PromptEncoder, model_dir: Path, resources: Resources
    ) -> dict[str, Any]:
        c = self.config
        store, trainer_engine = resources.store, resources.trainer
        tokenizer = prompts.tokenizer
        eval_set = task.eval_set()
        # Held-out answers are judged as the rewards judge training ones.
        verify = verifier(
            resolve_reward(c.reward.fn, bool(c.data.extra_keys)),
            bool(c.data.extra_keys),
            c.reward.batched,
        )
        # Agent runs are evaluated on whole trajectories, each judged on its last model turn.
        scored = agent_view(c, resources.scorer, eval_set, prompts)
        evaluator = agent_view(c, resources.evaluator, eval_set, prompts)
        max_tokens = c.rollout.max_tokens
        ckpt = checkpoint.latest(self.run_dir) if self.resume else None
        if ckpt is not None and c.algorithm.advantage == "gae" and not (ckpt / "critic").is_dir():
            raise ConfigError(
                f"{ckpt} has no critic state (written before critics were checkpointed): "
                "a run with algorithm.advantage gae cannot resume from it"
            )
        if ckpt is not None:
            saved = checkpoint.read_state(ckpt)
            before, pass_before = saved["accuracy_before"], saved["pass_at_k_before"]
        else:
            since = time.monotonic()
            before = accuracy(scored, eval_set, prompts, max_tokens, verify=verify)
            pass_before = pass_at_k(
                scored,
                eval_set,
                prompts,
                PASS_K,
                c.rollout.temperature,
                max_tokens,
                verify=verify,
            )
            self.phases.timed("eval_before", since)
        self.reporter.line(
            f"held-out accuracy before RL: {before:.3f} (pass@{PASS_K} {pass_before:.3f})"
        )

        if isinstance(trainer_engine, StepTrainEngine):
            # Trainer ranks still starting in processes of their own: not a part of RL.
            since = time.monotonic()
            trainer_engine.wait_started()
            self.phases.timed("trainer_start", since)
        since = time.monotonic()
        tracer = Tracer()
        state = RunState()
        # Colocated: the rollout engines sleep while the trainer steps.
        if c.rollout.sleep_while_training:
            self.engine_sleep = EngineSleep(resources.rollouts)
        ctx = Context(
            store,
            c,
            tokenizer,
            tracer,
            state,
            prompt_encoder=prompts,
            engine_sleep=self.engine_sleep,
            weight_receiver=resources.weight_receiver(),
        )
        ledger = Ledger(self.run_dir / "ledger.jsonl")
        start_group = 0
        if ckpt is not None:
            trainer_engine.load(ckpt / "trainer")
            restored = checkpoint.restore_rows(ckpt, store, c.rollout.n)
            kept = checkpoint.read_state(ckpt)
            start_group = int(kept["issued_groups"])
            state.add_counts(kept.get("counts", {}))  # the summary counts the whole run
            state.trained_steps = trainer_engine.version
            self.reporter.line(
                f"resumed from {ckpt.name}: step {trainer_engine.version}, "
                f"{restored} rows in flight"
            )
            if (self.run_dir / "summary.json").exists():
                # The last step takes no checkpoint (the final model is written instead).
                self.reporter.line(
                    f"warning: this run had finished; the steps after {ckpt.name} are trained "
                    "again from it"
                )
            if c.algorithm.filter_groups and c.algorithm.max_extra_groups > 0:
                self.reporter.line(
                    "warning: replacement prompt groups (algorithm.max_extra_groups) are not "
                    "kept across a resume: some are generated and trained again"
                )
        # The steps from here on are (re)done: a run resumed before its first checkpoint
        # starts over.
        ledger.truncate(trainer_engine.version)
        if self.resume:
            # Not before: a resume that failed (an engine that cannot load the checkpoint)
            # left its settings there, and the next plain resume failed the same way.
            (self.run_dir / "config.yaml").write_text(c.to_yaml())

        metrics = MetricsLog(
            self.run_dir,
            # Resumed before its first checkpoint: none of the records is kept.
            keep_until=trainer_engine.version if self.resume else None,
            loggers=c.run.loggers,
            config=c.shareable(),
        )
        evals = [(0, before)] + [
            (r["step"], r["eval_accuracy"]) for r in metrics.history if "eval_accuracy" in r
        ]
        figures = {"accuracy_before": before, "pass_at_k_before": pass_before}

        # run.eval_deferred: (step, RL seconds, weights) of each evaluation, scored after RL;
        # the first, the weights RL starts from (the curve's point at 0 s, on the same engine).
        deferred: list[tuple[int, float, list[tuple[str, torch.Tensor]]]] = []
        if c.run.eval_deferred:
            start = host_copy(trainer_engine.export_weights())
            deferred.append((trainer_engine.version, 0.0, start))

        def after_step(step: int) -> dict[str, Any]:
            extra: dict[str, Any] = {}
            due = step % c.run.eval_every == 0 or step == c.trainer.max_steps
            if due and c.run.eval_deferred:
                deferred.append((step, tracer.now(), host_copy(trainer_engine.export_weights())))
            elif due:
                since = time.monotonic()
                evaluator.load_weights(step, trainer_engine.export_weights())
                acc = accuracy(evaluator, eval_set, prompts, max_tokens, verify=verify)
                evals.append((step, acc))
                # The trainer waits for evaluation: time-to-accuracy figures subtract it.
                extra |= {"eval_accuracy": acc, "eval_seconds": time.monotonic() - since}
            return extra

        def after_logged(step: int) -> None:
            if step % c.run.checkpoint_every == 0 and step < c.trainer.max_steps:
                checkpoint.save(
                    self.run_dir, step, trainer_engine, store, state, figures, self.critic
                )

        absent = register_tasks(
            store,
            c.algorithm.reference,
            separate_reward_model(c),
            critic=c.algorithm.advantage == "gae",
        )
        if not isinstance(trainer_engine, StepTrainEngine):  # its ranks publish their own
            weights.publish(store, trainer_engine.version, trainer_engine.export_weights())
        middle = resources.middle(ctx)
        self.critic = next((w for w in middle if isinstance(w, CriticWorker)), None)
        if self.critic is not None and ckpt is not None:
            self.critic.engine.load(ckpt / "critic")
        trainer = Trainer(ctx, trainer_engine, metrics, ledger, after_step, after_logged)
        workers = [Feeder(ctx, task, start_group), *middle, trainer]
        if absent:
            workers.insert(-1, AbsentConsumers(ctx, absent))
        try:
            with self.reporter.steps(c.trainer.max_steps, state.trained_steps) as tick:
                run_threads(
                    workers, ctx.stop, trainer, lambda: tick(state.trained_steps, metrics.history)
                )
        except BaseException:
            metrics.finish()  # the trackers close with the run
            raise
        finally:
            metrics.close()
            tracer.write_chrome_trace(self.run_dir / "trace.json")
        self.phases.timed("rl", since)
        busy = tracer.busy_fraction()
        since = time.monotonic()
        deferred_evals = []
        for k, (step, at, copy) in enumerate(deferred):
            evaluator.load_weights(step, copy)
            acc = accuracy(evaluator, eval_set, prompts, max_tokens, verify=verify)
            if k:  # the figure's step 0 is the accuracy before RL already
                evals.append((step, acc))
            deferred_evals.append({"step": step, "time": round(at, 3), "eval_accuracy": acc})
        if deferred:
            self.phases.timed("eval_deferred", since)

        since = time.monotonic()
        version, final = ctx.weights.fetch(trainer_engine.version)
        resources.scorer.load_weights(version, final)
        after = accuracy(scored, eval_set, prompts, max_tokens, verify=verify)
        pass_after = pass_at_k(
            scored,
            eval_set,
            prompts,
            PASS_K,
            c.rollout.temperature,
            max_tokens,
            verify=verify,
        )
        probe = [prompts.encode(p.prompt) for p in eval_set[:64]]
        diff = logprob_agreement(resources.scorer, trainer_engine, probe, c, tokenizer.pad_id)
        trainer_engine.save_pretrained(self.run_dir / "final")
        self.phases.timed("eval_after", since)

        summary = self._summary(
            before,
            after,
            pass_before,
            pass_after,
            diff,
            resources.rollout_name,
            resources.train_name,
            state,
            busy,
            model_dir,
        )
        if deferred_evals:
            summary["deferred_evaluations"] = deferred_evals
        if c.agent.enabled:  # turns, tool calls and failures by kind, over training rollouts
            summary["agent"] = agent_totals(middle)
        write_summary_png(self.run_dir / "summary.png", metrics.history, evals, busy)
        metrics.finish(self.run_dir / "summary.png")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.reporter.summary(summary)
        return summary

    def _summary(
        self,
        before: float,
        after: float,
        pass_before: float,
        pass_after: float,
        diff: float,
        rollout_name: str,
        train_name: str,
        state: RunState,
        busy: dict[str, float],
        model_dir: Path,
    ) -> dict[str, Any]:
        c = self.config
        return {
            "accuracy_before": before,
            "accuracy_after": after,
            "accuracy_gain": after - before,
            f"pass_at_{PASS_K}_before": pass_before,
            f"pass_at_{PASS_K}_after": pass_after,
            "engines": {"rollout": rollout_name, "trainer": train_name},
            "logprob_max_abs_diff": diff,
            "wall_seconds": round(time.monotonic() - self.started, 2),
            "phase_seconds": self.phases.seconds,
            "steps": c.trainer.max_steps,
            "max_staleness": c.trainer.max_staleness,
            "staleness_histogram": {str(k): v for k, v in sorted(state.staleness.items())},
            "partial_rollout": c.rollout.partial,
            # Samples whose tokens come from several policy versions, and samples by span
            # (newest token's version less the oldest's).
            "multi_version_sample_share": state.multi_version_share(),
            "version_span_histogram": state.version_span_histogram(),
            "weight_load_failures": list(state.weight_failures),
            "samples_generated": state.generated_samples,
            "samples_dropped": state.dropped_samples,
            "reward_failures": state.reward_failures,
            "groups_filtered": state.filtered_groups,
            "responses_truncated": state.truncated_responses,
            "prompts_too_long": self.too_long,
            "groups_rerouted": state.rerouted_groups,
            "tokens_generated": state.generated_tokens,
            "busy_fraction": busy,
            "model_parameters": parameter_count(model_dir),
            "launcher": c.launcher,
            **({"critic": self.critic.summary()} if self.critic is not None else {}),
            # Steps the rollout engines slept through, and the seconds sleeping and waking took.
            **(
                {"rollout_sleep_while_training": self.engine_sleep.summary()}
                if self.engine_sleep is not None
                else {}
            ),
            **({"placement": self.placement} if self.placement else {}),
            "run_dir": str(self.run_dir),
        }


def train(
    config: Config,
    run_dir: Path | None = None,
    resume: Path | None = None,
    reporter: Reporter | None = None,
) -> dict[str, Any]:
    """Runs the main job; returns the summary (also written to ``summary.json``)."""
    quiet_libraries()
    # Refused now, before anything starts (the engines are made after the warm start).
    check_engine_names(config)
    check_rank_engine(config, resolve_engine_name("train", config.trainer.engine))
    if config.agent.enabled:
        check_names(config.agent)
    if resume is not None:
        if run_dir is not None and run_dir.resolve() != resume.resolve():
            raise ConfigError(f"a resumed run stays in its directory {resume}, not {run_dir}")
        check_resumable(config, resume)
    # Absolute: processes started elsewhere (a Ray cluster's actors) write into it too.
    directory = (resume if resume is not None else resolve_run_dir(config, run_dir)).absolute()
    if resume is None:
        check_fresh(config, directory)
    return Run(
        config, directory, reporter or Reporter(config.run.progress), resume is not None
    ).execute()
