"""The supervised warm start: a short pass of next-token training on demonstrations of the task,
so the policy starts RL able to solve problems sometimes (the signal GRPO needs)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import torch

from asyncflow.config import Config
from asyncflow.engines.base import ADAM_BETAS
from asyncflow.engines.hf import copy_tokenizer, load_model
from asyncflow.tasks.base import Problem, Task
from asyncflow.tasks.prompts import PromptEncoder

Progress = Callable[[int, float], None]


def _demonstration(task: Task, problem: Problem, rng: random.Random, mistake_rate: float) -> str:
    demo = getattr(task, "demonstration", None)
    if demo is not None:
        return str(demo(problem, rng, mistake_rate))
    return problem.demonstration if problem.demonstration is not None else problem.answer


def warm_start(
    config: Config,
    task: Task,
    prompts: PromptEncoder,
    model_dir: Path,
    out_dir: Path,
    progress: Progress | None = None,
) -> Path:
    """Trains the model in ``model_dir`` on demonstrations and saves it to ``out_dir``."""
    ws = config.warm_start
    torch.manual_seed(config.run.seed)
    rng = random.Random(config.run.seed)
    model = load_model(model_dir, config.model.dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=ADAM_BETAS, weight_decay=0.0)
    warmup = max(1, ws.steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * (step - warmup) / max(1, ws.steps - warmup))
        )

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    problems = task.train_stream(seed=config.run.seed + 7919)
    for step in range(ws.steps):
        batch = [next(problems) for _ in range(ws.batch_size)]
        tokenizer = prompts.tokenizer
        inputs = [prompts.encode(p.prompt) for p in batch]
        answers = [
            [*tokenizer.encode(_demonstration(task, p, rng, ws.mistake_rate)), tokenizer.eos_id]
            for p in batch
        ]
        width = max(len(p) + len(a) for p, a in zip(inputs, answers, strict=True))
        ids = torch.full((len(batch), width), tokenizer.pad_id)
        labels = torch.full((len(batch), width), -100)
        for i, (p, a) in enumerate(zip(inputs, answers, strict=True)):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if progress is not None:
            progress(step + 1, float(loss.detach()))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    copy_tokenizer(model_dir, out_dir)
    return out_dir
