"""Reference log-probs: responses -> per-token log-probs under the frozen initial policy, for the
KL penalty."""

from __future__ import annotations

import numpy as np
import torch

from asyncflow.engines.base import TrainEngine
from asyncflow.workers.base import Context, Worker
from asyncflow.workers.batches import to_train_batch


class ReferenceWorker(Worker):
    role = "reference"

    def __init__(self, ctx: Context, engine: TrainEngine) -> None:
        super().__init__(ctx)
        self.engine = engine

    def step(self) -> bool:
        batch = self.claim("reference", ["prompt_ids", "response_ids"], 64)
        if len(batch) == 0:
            return True
        with self.busy("reference logprobs"):
            data = batch.read()
            tb = to_train_batch(data["prompt_ids"], data["response_ids"], self.ctx.tokenizer.pad_id)
            logp = self.engine.logprobs(tb)
            out = []
            for i, (p, r) in enumerate(zip(data["prompt_ids"], data["response_ids"], strict=True)):
                out.append(
                    logp[i, len(p) : len(p) + len(r)].to(torch.float32).numpy().astype(np.float32)
                )
            self.store.put({"ref_logprobs": out}, indexes=batch.indexes)
        batch.ack()
        return True
