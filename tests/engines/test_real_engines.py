"""End to end with the real engines on CPU: ``asyncflow train`` with vLLM rollout and DeepSpeed
training, as a user runs it (a subprocess, so vLLM and DeepSpeed set up their process as they
would there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncflow.config import ModelConfig
from asyncflow.models.tiny import create_tiny_model
from run_outputs import busy_spans, metrics, trained_groups

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow]

EXAMPLES = Path(__file__).parents[2] / "examples"

#: 1-digit addition, as in test_workflow, with a model vLLM's CPU attention supports.
SMALL = [
    "data.digits=1",
    "data.eval_size=20",  # of the 45 unordered 1-digit pairs, fewer than half may be held out
    "model.intermediate_size=256",
    "warm_start.steps=200",
    "warm_start.batch_size=128",
    "trainer.groups_per_step=16",
    "rollout.n=16",
    "run.eval_every=100",
    "run.progress=false",
    "rollout.engine=vllm",
    "trainer.engine=deepspeed",
]


def train(run_dir: Path, *overrides: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "asyncflow.cli", "train", "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*command, *SMALL, *overrides], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads((run_dir / "summary.json").read_text()))


def test_vllm_and_deepspeed_raise_the_reward_and_agree_on_logprobs(tmp_path: Path) -> None:
    summary = train(tmp_path, "trainer.max_steps=12")
    assert summary["engines"] == {"rollout": "vllm", "trainer": "deepspeed"}
    assert summary["logprob_max_abs_diff"] < 1e-2
    rewards = [r["reward_mean"] for r in metrics(tmp_path)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards
    assert trained_groups(tmp_path) == list(range(12 * 16)), "every group trained exactly once"


@pytest.mark.timeout(900)
def test_two_routed_vllm_engines_feed_two_zero2_ranks_with_checkpoints(tmp_path: Path) -> None:
    summary = train(
        tmp_path,
        "trainer.max_steps=4",
        "warm_start.steps=20",
        "rollout.engines=2",
        "trainer.dp_size=2",
        "trainer.zero_stage=2",
        "run.checkpoint_every=2",
    )
    assert summary["engines"] == {"rollout": "vllm", "trainer": "deepspeed"}
    assert summary["logprob_max_abs_diff"] < 1e-2
    assert trained_groups(tmp_path) == list(range(4 * 16)), "every group trained exactly once"
    busy = busy_spans(tmp_path)
    assert "router" in busy
    for engine in ("rollout-0", "rollout-1"):  # each generated samples and put them in
        assert {"generate", "put samples"} <= busy[engine], busy
    assert (tmp_path / "checkpoints" / "step-000002" / "trainer").is_dir()
    assert (tmp_path / "final" / "model.safetensors").is_file()


def chat_parquet(path: Path, rows: range, system: bool) -> None:
    """Chat-form addition problems with verl's columns; a few far too long to keep."""
    records = []
    for i in rows:
        a, b = i % 10, (i * 7) % 10
        chat = [{"role": "user", "content": f"{a}+{b}="}]
        if system and i % 2:
            chat.insert(0, {"role": "system", "content": "Answer with the number."})
        records.append(
            {
                "prompt": chat,
                "reward_model": {"ground_truth": str(a + b)},
                "extra_info": {"index": i},
            }
        )
    if system:  # longer than data.max_prompt_length: left out and counted
        long = [{"role": "user", "content": "1+" * 40 + "1="}]
        records += [{**records[0], "prompt": long}] * 3
    pq.write_table(pa.Table.from_pylist(records), path)


def test_the_dataset_example_runs_on_a_local_chat_model_and_chat_parquet(tmp_path: Path) -> None:
    model = create_tiny_model(
        ModelConfig(intermediate_size=256, max_positions=128),  # head size 32: vLLM CPU has kernels
        tmp_path / "chat-model",
        seed=0,
    )
    chat_parquet(tmp_path / "train.parquet", range(40), system=True)
    chat_parquet(tmp_path / "test.parquet", range(40, 48), system=False)
    budget = 160
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "asyncflow.cli", "train", "--config"]
    overrides = [
        f"model.path={model}",
        f"data.train_file={tmp_path / 'train.parquet'}",
        f"data.eval_file={tmp_path / 'test.parquet'}",
        "data.max_prompt_length=48",
        "data.extra_keys=[extra_info.index]",
        "rollout.max_tokens=4",
        "rollout.n=4",
        "trainer.groups_per_step=4",
        "trainer.max_steps=2",
        f"trainer.micro_batch_tokens={budget}",
        "run.progress=false",
    ]
    done = subprocess.run(
        [*command, str(EXAMPLES / "parquet.yaml"), "--run-dir", str(run_dir), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engines"] == {"rollout": "vllm", "trainer": "deepspeed"}
    assert summary["prompts_too_long"] == {"train": 3, "eval": 0}
    assert summary["samples_generated"] == 2 * 4 * 4
    # Responses of at most 4 tokens from an untrained model: most run into the cap.
    assert 0 < summary["responses_truncated"] <= summary["samples_generated"]
    steps = metrics(run_dir)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0 < r["micro_batch_tokens_max"] <= budget for r in steps)
