"""A peer on the default job: TRL's ``GRPOTrainer`` (synchronous: generate with Hugging Face
``generate``, score, one optimizer step, repeat), given the same work as ``asyncflow train``.

``python -m asyncflow.bench.trl_peer --model DIR --out DIR [key=value ...]`` takes the job's
config overrides and trains the model in ``DIR`` (a run's warm-started model) on the same
problems, in the same order, that the job's feeder issues for the seed, with the job's
settings where TRL has them:

- ``trainer.max_steps`` optimizer steps, each on ``trainer.groups_per_step`` prompts x
  ``rollout.n`` completions (``num_generations``), in one micro-batch (the whole step fits);
- the prompt as a conversation, rendered by TRL with the model's chat template (checked to give
  the job's prompt tokens exactly); completions of at most ``rollout.max_tokens`` sampled at
  ``rollout.temperature`` from the full distribution;
- the job's reward function; advantages scaled by the group's standard deviation (``grpo`` with
  ``algorithm.normalize_std``); TRL's default loss, ``dapo`` (token-level, normalised by the
  step's completion tokens: the job's ``token`` aggregation); PPO clip ``trainer.clip_eps``, KL
  ``trainer.kl_coef``, one iteration per batch;
- AdamW with the job's betas at ``trainer.lr`` on the job's schedule (``cosine_with_min_lr`` to
  ``trainer.min_lr_ratio`` for ``cosine``, ``constant_with_warmup`` for ``constant``, both over
  ``trainer.warmup_steps``; TRL's default decays linearly to zero), ``trainer.weight_decay``,
  gradient clip ``trainer.grad_clip``, float32 on the CPU;
- no gradient checkpointing (TRL's default recomputes activations to save memory; the job's
  trainer does not, and the tiny model needs no saving);
- torch's own number of threads (every core: TRL is one process), not the one thread per
  process that ``asyncflow``'s command sets for its workers; ``summary.json`` says how many.

With ``agent.enabled`` (the multi-turn ``multiply-tools`` job, ``examples/tools.yaml``) TRL runs
the trajectories with its own tool support, as its docs set it up: the tool is an ``async def``
function passed as ``tools`` (TRL awaits a completion's calls together, completion after
completion), the tokenizer's chat template renders tool calls and answers as the job's agent loop
writes them (the built-in template does), and TRL's Qwen-style response template
(``<tool_call>{json}</tool_call>``) reads the calls and answers, its turn anchor as the model's
tokenizer decodes it (see :func:`response_template`; checked before training to read an answer
back, first turn and after a call). The tool is the job's: the same calculator,
sandboxed process and latency, answering with the same text. ``max_completion_length`` is
``agent.max_tokens`` (model and tool tokens together, as the job counts them), each turn
generates at most ``rollout.max_tokens`` (``generation_kwargs``' ``max_new_tokens``),
``max_tool_calling_iterations`` is ``agent.max_turns - 1``, and the reward judges the last
assistant message's text, as the job's verifier judges the last model turn. A call TRL cannot
read ends the completion (the job answers it with an error observation): each framework's own
handling.

Everything else is TRL's default. It then scores the trained model on the held-out problems
with the job's own evaluation and rollout engine, and writes ``summary.json`` beside it:
``phase_seconds`` (``start``: building the trainer, model load included; ``rl``: ``train()``;
``eval_after``), ``accuracy_after``, ``pass_at_8_after`` and ``tokens_generated``. With
``run.eval_deferred``, as the job does, a callback keeps a copy of the weights as training
starts and every ``run.eval_every`` steps (and at the last), scored greedily after ``train()`` on
the hf engine, as the job scores its own copies: ``deferred_evaluations`` (step, seconds into
``train()``, held-out accuracy).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncflow import config as configuration
from asyncflow.agents.env import ToolEnvironment
from asyncflow.agents.evaluation import agent_view
from asyncflow.agents.parser import ToolCall
from asyncflow.agents.tools import create_tool
from asyncflow.engines.base import ADAM_BETAS
from asyncflow.engines.hf import HFRolloutEngine
from asyncflow.engines.registry import create_rollout_engine
from asyncflow.evaluation import accuracy, host_copy, pass_at_k, verifier
from asyncflow.models.tokenizer import load_tokenizer
from asyncflow.quiet import quiet_libraries
from asyncflow.tasks.loader import load_task
from asyncflow.tasks.prompts import PromptEncoder
from asyncflow.train import PASS_K, prompt_budget
from asyncflow.workers.reward import resolve_reward


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncflow.bench.trl_peer")
    parser.add_argument("--model", type=Path, required=True, help="the model to train")
    parser.add_argument("--out", type=Path, required=True, help="where to write its results")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    summary = run(args.model, args.out, configuration.load(None, args.overrides))
    print(json.dumps(summary))
    return 0


def scheduler_settings(t: configuration.TrainerConfig) -> dict[str, Any]:
    """TRL's scheduler settings for the job's learning-rate schedule (the same factor per step
    after the warm-up; TRL's warm-up starts from zero, the job's from ``1/warmup_steps``)."""
    if t.lr_schedule == "cosine":
        return {
            "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr_rate": t.min_lr_ratio},
            "warmup_steps": t.warmup_steps,
        }
    return {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": t.warmup_steps}


def trl_tools(agent: configuration.AgentConfig) -> list[Callable[..., Any]]:
    """The job's tools for TRL: ``async def`` functions with the docstrings TRL reads their
    schema from, each answering as the job's ``tools`` environment does (latency included)."""
    if agent.environment != "tools" or list(agent.tools) != ["calculator"]:
        raise ValueError("the TRL peer runs the built-in tools environment with calculator only")
    env = ToolEnvironment.from_config(agent, {"calculator": create_tool("calculator", agent)})

    async def calculator(expression: str) -> str:
        """Evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses).

        Args:
            expression: The expression, e.g. 123*4567.
        """
        text, _ = await env.run_call(ToolCall("calculator", {"expression": expression}))
        return text

    return [calculator]


def response_template(tokenizer: Any) -> dict[str, Any]:
    """TRL's Qwen-style response template, its assistant-turn anchor as ``tokenizer`` decodes
    it. TRL parses a turn from the decoded prompt and completion, starting after the prompt's
    last anchor; the built-in model's tokenizer, as transformers loads a Qwen2 directory, decodes
    without whitespace, so the anchor's newline is never found and the turn's header would be
    read into the answer."""
    from trl.chat_template_utils import qwen3_template  # noqa: PLC0415

    anchor = tokenizer.encode(qwen3_template["start_anchor"], add_special_tokens=False)
    return {**qwen3_template, "start_anchor": tokenizer.decode(anchor)}


def check_answers_read(tokenizer: Any, tools: list[Callable[..., Any]], chat: Any) -> None:
    """Raises unless TRL reads a final answer back from a completion as the reward sees it, on
    the first turn and after a tool call (``chat``: a prompt's messages)."""
    from trl.chat_template_utils import parse_response  # noqa: PLC0415

    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "1+1"}},
    }
    exchange = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": "2"},
    ]
    answer = tokenizer.encode("2" + tokenizer.eos_token, add_special_tokens=False)
    for turns in ([], exchange):
        prefix = tokenizer.apply_chat_template(
            [*chat, *turns],
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        read = last_answer([parse_response(tokenizer, answer, prefix=prefix, tools=tools)])
        if read != "2":
            after = "after a tool call" if turns else "on the first turn"
            raise ValueError(f"TRL would read the answer '2' {after} as {read!r}")


def last_answer(completion: Any) -> str:
    """The text TRL's completion is judged on: the last assistant message's (a plain
    completion is its text)."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] or "" for m in reversed(completion) if m["role"] == "assistant"), "")


#: (step, seconds since train() started, a host copy of the weights).
Copy = tuple[int, float, list[tuple[str, torch.Tensor]]]


def weight_copies(model: torch.nn.Module, c: configuration.Config) -> Any:
    """A TRL callback that keeps a host copy of the model's weights as training starts and
    after each ``run.eval_every``-th step and the last, in its ``taken`` (a list of
    :data:`Copy`); set its ``started`` as ``train()`` starts."""
    from transformers import TrainerCallback

    class WeightCopies(TrainerCallback):  # type: ignore[misc]  # transformers: untyped here
        def __init__(self) -> None:
            self.started = time.monotonic()
            # The weights training starts from: the curve's point at 0 s, as in the job.
            self.taken: list[Copy] = [(0, 0.0, host_copy(model.named_parameters()))]

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            step = state.global_step
            if step % c.run.eval_every == 0 or step == c.trainer.max_steps:
                at = time.monotonic() - self.started
                self.taken.append((step, at, host_copy(model.named_parameters())))

    return WeightCopies()


# What a launcher (or DeepSpeed's group of one, which leaves them behind) tells a rank.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def grpo_config(c: configuration.Config, out: Path, tools: bool) -> Any:
    """TRL's ``GRPOConfig`` for the job's work, trained in this one process. Without a process
    group, the rank variables an earlier group left in the environment are removed first:
    seeing them, accelerate would create a group of its own, whose store listens on every
    address of the machine."""
    import trl  # noqa: PLC0415

    if not torch.distributed.is_initialized():
        for name in _RANK_VARIABLES:
            os.environ.pop(name, None)
    return trl.GRPOConfig(**grpo_arguments(c, out, tools))


def grpo_arguments(c: configuration.Config, out: Path, tools: bool) -> dict[str, Any]:
    """``GRPOConfig``'s arguments for the job's work (see the module documentation)."""
    batch = c.trainer.groups_per_step * c.rollout.n
    if tools:
        lengths = {
            "max_completion_length": c.agent.max_tokens,
            "max_tool_calling_iterations": c.agent.max_turns - 1,
            "generation_kwargs": {"max_new_tokens": c.rollout.max_tokens},
        }
    else:
        lengths = {"max_completion_length": c.rollout.max_tokens}
    return dict(
        output_dir=str(out / "trl"),
        max_steps=c.trainer.max_steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=c.rollout.n,
        **lengths,
        temperature=c.rollout.temperature,
        scale_rewards="group" if c.algorithm.normalize_std else "none",
        epsilon=c.trainer.clip_eps,
        beta=c.trainer.kl_coef,
        num_iterations=c.trainer.ppo_epochs,
        learning_rate=c.trainer.lr,
        adam_beta1=ADAM_BETAS[0],
        adam_beta2=ADAM_BETAS[1],
        **scheduler_settings(c.trainer),
        weight_decay=c.trainer.weight_decay,
        max_grad_norm=c.trainer.grad_clip,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=c.run.seed,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
    )


def run(model_dir: Path, out: Path, c: configuration.Config) -> dict[str, Any]:
    quiet_libraries()
    # Imported here: TRL (bench dependency group) is needed by this peer only.
    import trl  # noqa: PLC0415
    from datasets import Dataset  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(c.run.seed)
    prompts = PromptEncoder.for_data(load_tokenizer(model_dir), c.data, prompt_budget(c, model_dir))
    task = load_task(c.data, prompts)
    stream = task.train_stream(c.run.seed, 0)
    problems = [next(stream) for _ in range(c.trainer.max_steps * c.trainer.groups_per_step)]
    conversations = [prompts.messages(p.prompt) for p in problems]
    if any(m is None for m in conversations):
        raise ValueError("the TRL peer needs a model with a chat template")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tools = trl_tools(c.agent) if c.agent.enabled else None
    if tools:
        tokenizer.response_template = response_template(tokenizer)
        check_answers_read(tokenizer, tools, conversations[0])
    for p, chat in zip(problems, conversations, strict=True):
        ids = tokenizer.apply_chat_template(
            [chat], tools=tools, add_generation_prompt=True, tokenize=True
        )
        if list(ids["input_ids"][0]) != prompts.encode(p.prompt):
            raise ValueError(f"TRL would render {p.prompt!r} differently from the job")
    data = Dataset.from_dict({"prompt": conversations, "answer": [p.answer for p in problems]})
    reward = resolve_reward(c.reward.fn)

    def reward_fn(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [last_answer(x) for x in completions]
        return [float(reward(t, a)) for t, a in zip(texts, answer, strict=True)]

    reward_fn.__name__ = c.reward.fn
    batch = c.trainer.groups_per_step * c.rollout.n
    settings = grpo_config(c, out, bool(tools))
    phases: dict[str, float] = {}
    since = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=settings,
        train_dataset=data,
        processing_class=tokenizer,
        tools=tools,
    )
    copies = weight_copies(model, c) if c.run.eval_deferred else None
    if copies is not None:
        trainer.add_callback(copies)
    phases["start"] = round(time.monotonic() - since, 3)
    since = time.monotonic()
    if copies is not None:
        copies.started = since
    trainer.train()
    phases["rl"] = round(time.monotonic() - since, 3)

    since = time.monotonic()
    final = out / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(final)
    verify = verifier(reward, False)
    eval_set = task.eval_set()
    deferred = []
    if copies is not None:
        # The weight copies are scored as the job scores its own: on the hf engine.
        evaluator = agent_view(c, HFRolloutEngine(final, c), eval_set, prompts)
        for step, at, copy in copies.taken:
            evaluator.load_weights(step, copy)
            acc = accuracy(evaluator, eval_set, prompts, c.rollout.max_tokens, verify=verify)
            deferred.append({"step": step, "time": round(at, 3), "eval_accuracy": acc})
    # The final model, as the job's: on its rollout engine (whole trajectories in agent runs).
    scorer = agent_view(c, create_rollout_engine(c.rollout.engine, final, c), eval_set, prompts)
    after = accuracy(scorer, eval_set, prompts, c.rollout.max_tokens, verify=verify)
    pass_after = pass_at_k(
        scorer,
        eval_set,
        prompts,
        PASS_K,
        c.rollout.temperature,
        c.rollout.max_tokens,
        verify=verify,
    )
    phases["eval_after"] = round(time.monotonic() - since, 3)
    history = trainer.state.log_history
    summary = {
        "peer": f"trl {trl.__version__}",
        "torch_threads": torch.get_num_threads(),
        "accuracy_after": after,
        f"pass_at_{PASS_K}_after": pass_after,
        "phase_seconds": phases,
        # TRL logs each step's mean completion length, the model's tokens only (tool answers
        # are not counted, as the job does not count them).
        "tokens_generated": round(
            batch * sum(r["completions/mean_length"] for r in history if "loss" in r)
        ),
        "steps": c.trainer.max_steps,
        "tools": [t.__name__ for t in tools or []],
        "train_loss": [r["loss"] for r in history if "loss" in r],
        "reward": [r["reward"] for r in history if "reward" in r],
        **({"deferred_evaluations": deferred} if deferred else {}),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
