"""Reference log-probs: responses -> per-token log-probs under the frozen initial policy, for the
KL penalty, in micro-batches within the trainer's token budget."""

from __future__ import annotations

import numpy as np
import torch

from asyncflow.columns import Ragged
from asyncflow.engines.base import TrainEngine
from asyncflow.workers.base import Context, Worker
from asyncflow.workers.batches import split_micro_batches, to_train_batch


class ReferenceWorker(Worker):
    role = "reference"

    def __init__(self, ctx: Context, engine: TrainEngine) -> None:
        super().__init__(ctx)
        self.engine = engine
        self.pad_id = ctx.tokenizer.pad_id

    def step(self) -> bool:
        batch = self.claim("reference", ["prompt_ids", "response_ids"], 64)
        if len(batch) == 0:
            return True
        with self.busy("reference logprobs"), self.holding(batch):
            data = batch.read()
            prompts, responses = data["prompt_ids"], data["response_ids"]
            lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
            out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(lengths)
            budget = self.config.trainer.micro_batch_tokens
            for part in split_micro_batches(lengths, budget, packed=False):
                tb = to_train_batch(
                    [prompts[i] for i in part], [responses[i] for i in part], self.pad_id
                )
                logp = self.engine.logprobs(tb).to(torch.float32).numpy()
                for row, i in enumerate(part):
                    p, r = len(prompts[i]), len(responses[i])
                    out[i] = logp[row, p : p + r]
            whole = Ragged(np.concatenate(out), [len(r) for r in responses])
            self.store.put({"ref_logprobs": whole}, indexes=batch.indexes, ack=batch)
        return True
