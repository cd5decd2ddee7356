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
- AdamW at ``trainer.lr`` on the job's schedule (``cosine_with_min_lr`` to
  ``trainer.min_lr_ratio`` for ``cosine``, ``constant_with_warmup`` for ``constant``, both over
  ``trainer.warmup_steps``; TRL's default decays linearly to zero), ``trainer.weight_decay``,
  gradient clip ``trainer.grad_clip``, float32 on the CPU.

Everything else is TRL's default. It then scores the trained model on the held-out problems
with the job's own evaluation and rollout engine, and writes ``summary.json`` beside it:
``phase_seconds`` (``start``: building the trainer, model load included; ``rl``: ``train()``;
``eval_after``), ``accuracy_after``, ``pass_at_8_after`` and ``tokens_generated``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from asyncflow import config as configuration
from asyncflow.engines.registry import create_rollout_engine
from asyncflow.evaluation import accuracy, pass_at_k, verifier
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
    for p, chat in zip(problems, conversations, strict=True):
        ids = tokenizer.apply_chat_template([chat], add_generation_prompt=True, tokenize=True)
        if list(ids["input_ids"][0]) != prompts.encode(p.prompt):
            raise ValueError(f"TRL would render {p.prompt!r} differently from the job")
    data = Dataset.from_dict({"prompt": conversations, "answer": [p.answer for p in problems]})
    reward = resolve_reward(c.reward.fn)
    generated = [0]

    def reward_fn(
        completions: list[Any], answer: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        generated[0] += sum(len(ids) for ids in completion_ids)
        texts = [x[-1]["content"] if isinstance(x, list) else x for x in completions]
        return [float(reward(t, a)) for t, a in zip(texts, answer, strict=True)]

    reward_fn.__name__ = c.reward.fn
    batch = c.trainer.groups_per_step * c.rollout.n
    settings = trl.GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=c.trainer.max_steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=c.rollout.n,
        max_completion_length=c.rollout.max_tokens,
        temperature=c.rollout.temperature,
        scale_rewards="group" if c.algorithm.normalize_std else "none",
        epsilon=c.trainer.clip_eps,
        beta=c.trainer.kl_coef,
        num_iterations=c.trainer.ppo_epochs,
        learning_rate=c.trainer.lr,
        **scheduler_settings(c.trainer),
        weight_decay=c.trainer.weight_decay,
        max_grad_norm=c.trainer.grad_clip,
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
    phases: dict[str, float] = {}
    since = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=settings,
        train_dataset=data,
        processing_class=tokenizer,
    )
    phases["start"] = round(time.monotonic() - since, 2)
    since = time.monotonic()
    trainer.train()
    phases["rl"] = round(time.monotonic() - since, 2)

    since = time.monotonic()
    final = out / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(final)
    scorer = create_rollout_engine(c.rollout.engine, final, c)
    verify = verifier(reward, False)
    eval_set = task.eval_set()
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
    phases["eval_after"] = round(time.monotonic() - since, 2)
    summary = {
        "peer": f"trl {trl.__version__}",
        "accuracy_after": after,
        f"pass_at_{PASS_K}_after": pass_after,
        "phase_seconds": phases,
        "tokens_generated": generated[0],
        "steps": c.trainer.max_steps,
        "train_loss": [r["loss"] for r in trainer.state.log_history if "loss" in r],
        "reward": [r["reward"] for r in trainer.state.log_history if "reward" in r],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
