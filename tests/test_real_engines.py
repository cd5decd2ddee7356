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

import pytest

from run_outputs import busy_spans, metrics, trained_groups

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
