"""Whether vLLM's own LoRA support (``enable_lora`` and a ``LoRARequest`` over a peft adapter
directory) runs on the vLLM build installed, and how close its log-probs are to the trainer's
(agreement, not speed: nothing here is timed).
The job does not use it (it publishes merged weights, see docs/lora.md); this records what it
would take.

    python benches/lora_vllm.py [--dir DIR] [--seeds 0 1 2]

Per seed: the built-in tiny model, two hf-engine LoRA steps raising one target's likelihood,
the adapters written as peft's adapter directory; one vLLM engine (started with
``enable_lora``) samples the same prompts with and without the adapter, and the largest
|log-prob| difference from the trainer's (adapted) log-probs on the sampled tokens is printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

from asyncflow.engines import lora
from asyncflow.engines.hf import HFTrainEngine
from asyncflow.workers.batches import to_train_batch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engines"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("bench-out/lora-vllm"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()

    import test_lora as t  # noqa: PLC0415 - found through the sys.path entry above
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    model_dir = t.create_tiny_model(t.CONFIG.model, args.dir / "base", seed=3)
    assert t.CONFIG.model.lora is not None
    llm = LLM(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        enable_lora=True,
        # vLLM takes only some ranks here (1, 8, 16, ...): the smallest that holds the adapter's.
        max_lora_rank=next(r for r in (1, 8, 16, 32, 64) if r >= t.CONFIG.model.lora.rank),
        max_loras=1,
        kv_cache_memory_bytes=64 << 20,
        gpu_memory_utilization=0.1,
        logprobs_mode="processed_logprobs",
        enable_chunked_prefill=False,
    )
    prompts = t.ids(t.PROMPTS)
    params = SamplingParams(
        temperature=1.0, max_tokens=6, seed=1, logprobs=0, flat_logprobs=True, detokenize=False
    )
    print("| seed | gap with the adapter | gap on the base weights |")
    print("|---|---|---|")
    for seed in args.seeds:
        config = t.cfg.load(None, [*t.OVERRIDES, f"run.seed={seed}"])
        trainer = HFTrainEngine(model_dir, config)
        for _ in range(2):
            t.train_step(trainer)
        named = [(n, p.detach()) for n, p in trainer.model.named_parameters()]
        adapter = args.dir / f"adapter-{seed}"
        assert config.model.lora is not None
        lora.save_adapter(named, config.model.lora, model_dir, adapter)
        gaps = []
        for request in (LoRARequest(f"seed-{seed}", seed + 1, str(adapter)), None):
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                params,
                lora_request=request,
                use_tqdm=False,
            )
            responses = [np.array(o.outputs[0].token_ids, np.int64) for o in outs]
            batch = to_train_batch([np.array(p, np.int64) for p in prompts], responses, 0)
            mine = trainer.logprobs(batch)
            worst = 0.0
            for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
                theirs = torch.tensor([float(x) for x in o.outputs[0].logprobs.logprobs])
                ours = mine[i, len(p) : len(p) + len(theirs)]
                worst = max(worst, float((theirs - ours).abs().max()))
            gaps.append(worst)
        print(f"| {seed} | {gaps[0]:.2e} | {gaps[1]:.2e} |")


if __name__ == "__main__":
    main()
