"""The main job on a Ray cluster (``launcher: ray``): two Ray nodes on this machine's loopback,
the store sharded over them, the hf engines and a tiny model; worker actors killed mid-run; and
the Ray instance the launcher starts itself, on loopback only."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

import asyncflow as af
from asyncflow import config as cfg
from asyncflow.launch.ray_cluster import RayCluster
from asyncflow.launch.ray_join import LOOPBACK
from asyncflow.progress import Reporter
from asyncflow.train import train
from asyncflow.workers.trainer import Ledger

GROUPS, N = 4, 8
FAST = [
    "launcher=ray",
    "data.digits=1",
    "data.eval_size=16",
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "warm_start.steps=20",
    "warm_start.batch_size=64",
    f"trainer.groups_per_step={GROUPS}",
    f"rollout.n={N}",
    "rollout.groups_per_call=2",
    "rollout.engine=hf",
    "run.eval_every=100",
    "run.stall_timeout=120",
    "ray.start_timeout=180",
]


def start_cluster(attempts: int = 3) -> Cluster:
    """Two Ray nodes on this machine's loopback. Ray gives a starting raylet a fixed 30 s to
    register, which a heavily loaded machine can miss: that (and only that) is tried again."""
    for attempt in range(1, attempts + 1):
        nodes = None
        try:
            head = {"num_cpus": 3, "node_ip_address": LOOPBACK}
            nodes = Cluster(initialize_head=True, head_node_args=head)
            nodes.add_node(num_cpus=3, node_ip_address=LOOPBACK)
            nodes.wait_for_nodes()
            return nodes
        except Exception as e:
            if nodes is not None:
                nodes.shutdown()
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two Ray nodes on this machine (each its own raylet, as two hosts would have)."""
    nodes = start_cluster()
    yield nodes
    nodes.shutdown()


def run(cluster: Cluster, run_dir: Path, *overrides: str) -> dict[str, Any]:
    config = cfg.load(None, [*FAST, f"ray.address={cluster.address}", *overrides])
    return train(config, run_dir=run_dir, reporter=Reporter(enabled=False))


def ledger(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def trained_groups(run_dir: Path) -> list[int]:
    return sorted(g for entry in ledger(run_dir) for g in entry["trained"])


def test_a_ray_instance_the_launcher_starts_listens_on_loopback_only(
    monkeypatch: pytest.MonkeyPatch, listeners_off_loopback: Callable[[], list[str]]
) -> None:
    """Without ``ray.address`` or ``$RAY_ADDRESS``: Ray's servers and the store daemons listen on
    loopback only, and the node's address (where daemons listen and trainer ranks meet) is it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    asks = ["ray.trainer_cpus=0.25", "ray.rollout_cpus=0.25", "ray.worker_cpus=0.25"]
    config = cfg.load(None, ["launcher=ray", "ray.start_timeout=180", *asks])
    with RayCluster(config) as cluster:
        assert [node["NodeManagerAddress"] for node in ray.nodes()] == [LOOPBACK]
        assert cluster.url.startswith(f"tcp://{LOOPBACK}:")
        assert af.connect(cluster.url, token=cluster.token).stats()["storage_daemons"] == 1
        assert listeners_off_loopback() == []
    assert not ray.is_initialized()


def test_deepspeed_ranks_train_on_a_two_node_cluster_with_the_store_on_both(
    cluster: Cluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    listeners_off_loopback: Callable[[], list[str]],
) -> None:
    mid_run: list[list[str]] = []
    write = Ledger.write

    def look_after_the_first_step(
        self: Ledger, step: int, trained: list[int], dropped: list[int]
    ) -> None:
        write(self, step, trained, dropped)
        if step == 0:  # every daemon, rank and actor is up
            mid_run.append(listeners_off_loopback())

    monkeypatch.setattr(Ledger, "write", look_after_the_first_step)
    summary = run(
        cluster, tmp_path, "trainer.max_steps=2", "trainer.engine=deepspeed", "trainer.dp_size=2"
    )
    assert mid_run == [[]], "the run listens on loopback only (the cluster is on loopback)"
    assert summary["launcher"] == "ray"
    assert summary["placement"]["nodes"] == 2
    assert summary["placement"]["storage_daemons"] == 2, "one storage daemon per node"
    assert summary["engines"] == {"rollout": "hf", "trainer": "deepspeed"}
    assert [e["step"] for e in ledger(tmp_path)] == [0, 1]
    assert trained_groups(tmp_path) == list(range(2 * GROUPS)), "every group trained once"
    assert summary["samples_generated"] >= 2 * GROUPS * N
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    roles = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert {"rollout", "reward", "advantage", "trainer", "feeder"} <= roles
    assert (tmp_path / "final" / "config.json").is_file()
    assert not ray.is_initialized(), "the job leaves the cluster when it ends"


def test_killed_worker_actors_are_restarted_and_no_group_is_lost_or_trained_twice(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 4
    killed: list[str] = []
    write = Ledger.write

    def kill_after_the_first_step(
        self: Ledger, step: int, trained: list[int], dropped: list[int]
    ) -> None:
        """Kills as the trainer records step 0, before it counts the step: the prompts of the
        last step are not issued yet, so only the restarted actors can roll them out and score
        them (however fast the pipeline runs)."""
        write(self, step, trained, dropped)
        if step == 0:
            for label in ["rollout", "reward"]:
                ray.kill(ray.get_actor(label), no_restart=False)
                killed.append(label)

    monkeypatch.setattr(Ledger, "write", kill_after_the_first_step)
    summary = run(
        cluster,
        tmp_path,
        f"trainer.max_steps={steps}",
        "trainer.engine=hf",
        "store.lease_timeout=6",
    )
    assert killed == ["rollout", "reward"]
    assert summary["placement"]["actor_restarts"] == {"rollout": 1, "reward": 1, "advantage": 0}
    assert [e["step"] for e in ledger(tmp_path)] == list(range(steps))
    assert trained_groups(tmp_path) == list(range(steps * GROUPS)), "every group trained once"


def test_resuming_is_refused_on_ray(tmp_path: Path) -> None:
    config = cfg.load(None, ["launcher=ray"])
    with pytest.raises(cfg.ConfigError, match="local launcher only"):
        train(config, resume=tmp_path, reporter=Reporter(enabled=False))


def test_a_placement_the_cluster_cannot_hold_is_an_error_naming_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    overrides = ["warm_start.enabled=false", "ray.trainer_gpus=1", "ray.start_timeout=2"]
    with pytest.raises(TimeoutError, match="no room for the trainer placement group"):
        run(cluster, tmp_path, *overrides)
    assert not ray.is_initialized(), "what was started is torn down"
