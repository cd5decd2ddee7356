"""The main job on a Ray cluster (``launcher: ray``): two Ray nodes on this machine's loopback,
the store sharded over them, the hf engines and a tiny model; worker actors killed mid-run; and
the Ray instance the launcher starts itself, on loopback only."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group

import asyncflow as af
from asyncflow import checkpoint
from asyncflow import config as cfg
from asyncflow.engines.errors import EngineError
from asyncflow.launch import ray_workers
from asyncflow.launch.local import WorkerError
from asyncflow.launch.ray_cluster import RayCluster
from asyncflow.launch.ray_join import LOOPBACK, join
from asyncflow.launch.ray_wait import PlacementError
from asyncflow.launch.ray_workers import Report, Supervisor
from asyncflow.models.chatml import chatml_tokenizer
from asyncflow.progress import Reporter
from asyncflow.telemetry.trace import Tracer
from asyncflow.train import train
from asyncflow.workers.base import Context, RunState
from asyncflow.workers.trainer import Ledger
from run_outputs import metrics
from sigterm import assert_sigterm_runs_cleanup

pytestmark = [pytest.mark.ray, pytest.mark.slow]

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
            # No dashboard, and no fixed port for it: where another Ray head holds the default
            # port, Ray's check of that port leaves an unclosed socket in this process.
            head = {
                "num_cpus": 3,
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "dashboard_port": 0,
            }
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
    # A run directory relative to the job's working directory, which is not the cluster's: the
    # actors and ranks found no model there, and would have written into their own.
    monkeypatch.chdir(tmp_path)
    summary = run(
        cluster, Path(), "trainer.max_steps=2", "trainer.engine=deepspeed", "trainer.dp_size=2"
    )
    assert mid_run == [[]], "the run listens on loopback only (the cluster is on loopback)"
    assert summary["launcher"] == "ray"
    assert summary["placement"]["nodes"] == 2
    assert summary["placement"]["storage_daemons"] == 2, "one storage daemon per node"
    assert summary["engines"] == {"rollout": "hf", "trainer": "deepspeed"}
    assert [e["step"] for e in ledger(tmp_path)] == [0, 1]
    assert trained_groups(tmp_path) == list(range(2 * GROUPS)), "every group trained once"
    assert summary["samples_generated"] >= 2 * GROUPS * N
    # Every actor's timeline came back with its work on it, not only its waits.
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    roles = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    busy: dict[str, set[str]] = {}
    for e in trace:
        if e["ph"] == "X" and e["cat"] == "busy":
            busy.setdefault(roles[e["tid"]], set()).add(e["name"].split(" v")[0])
    assert {"rollout", "reward", "advantage", "trainer", "feeder"} <= set(busy), busy
    assert {"generate", "put samples"} <= busy["rollout"], busy
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


def slow_to_restart(fails: bool = False) -> Any:
    """An actor with a worker actor's surface whose restart outlasts the run: its new life never
    answers; or, ``fails``, whose restart raises (as a restarted worker does that cannot reach
    the store). (Made in a function, so that Ray sends the class itself: its workers cannot
    import this module.)"""

    class SlowToRestart:
        def __init__(self) -> None:
            if ray.get_runtime_context().was_current_actor_reconstructed:
                if fails:
                    raise ConnectionError("cannot reach the store")
                time.sleep(600)
            self.life = uuid.uuid4().hex
            self.stopped = threading.Event()

        def run(self) -> Report:
            self.stopped.wait()
            return self.report()

        def stop(self) -> None:
            self.stopped.set()

        def report(self) -> Report:
            return Report(self.life, 0, 0, 0, [], 0.0)

    return ray.remote(SlowToRestart)


def wait_until_it_answers_no_more(actor: Any, timeout: float = 120.0) -> None:
    """Until a call fails because the actor died (Ray applies ``ray.kill`` shortly after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.report.remote(), timeout=timeout)
        except RayActorError:  # ActorUnavailableError too: its restart has begun
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answered after {timeout:.0f}s")


def test_a_restart_is_counted_when_the_run_ends_before_the_new_life_answers(
    cluster: Cluster,
) -> None:
    join(cluster.address, log_to_driver=False)
    try:
        actor = slow_to_restart().options(max_restarts=1, max_concurrency=2).remote()
        ray.get(actor.report.remote(), timeout=180)
        ctx = Context(af.Store(), cfg.load(None, []), chatml_tokenizer(), Tracer(), RunState())
        supervisor = Supervisor(ctx, {"slow": actor})
        ray.kill(actor, no_restart=False)
        wait_until_it_answers_no_more(actor)
        ctx.stop.set()  # the run ends at once
        supervisor.run()
        assert supervisor.lives == {}, "no life reported to the supervisor"
        assert supervisor.restarts == {"slow": 1}
        ray.kill(actor)
    finally:
        ray.shutdown()


def test_an_actor_dead_for_good_ends_the_run_with_rays_count_of_its_deaths(
    cluster: Cluster,
) -> None:
    """Killed once, its restart failing: two deaths, whatever the calls made to it since (each
    failed too, and was counted as a death of its own)."""
    join(cluster.address, log_to_driver=False)
    try:
        actor = slow_to_restart(fails=True).options(max_restarts=3, max_concurrency=2).remote()
        ray.get(actor.report.remote(), timeout=180)
        ctx = Context(af.Store(), cfg.load(None, []), chatml_tokenizer(), Tracer(), RunState())
        supervisor = Supervisor(ctx, {"flaky": actor})
        ray.kill(actor, no_restart=False)

        def supervise() -> None:
            for _ in range(1000):  # each step waits up to 0.5 s on the actor
                supervisor.step()

        with pytest.raises(WorkerError, match=r"flaky actor died 2 times .* no more"):
            supervise()
    finally:
        ray.shutdown()


def test_a_killed_ray_job_resumes_with_no_group_lost_or_trained_twice(
    cluster: Cluster, tmp_path: Path
) -> None:
    """As the local launcher's: the job SIGKILLed once a checkpoint exists, its actors busy with
    rows they claimed (Ray ends them, and the store, with their job), then resumed on the same
    cluster from the checkpoint."""
    steps, run_dir = 4, tmp_path / "killed"
    cli = [sys.executable, "-m", "asyncflow.cli", "train"]
    args = [*FAST, f"ray.address={cluster.address}", f"trainer.max_steps={steps}"]
    args += ["trainer.engine=hf", "run.checkpoint_every=2", "run.progress=false"]
    ckpt = run_dir / "checkpoints" / "step-000002"
    with (tmp_path / "killed.log").open("w") as log:
        job = subprocess.Popen([*cli, "--run-dir", str(run_dir), *args], stderr=log)
        try:
            deadline = time.monotonic() + 600
            while not ckpt.is_dir():
                assert job.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no checkpoint appeared"
                time.sleep(0.2)
        finally:
            job.send_signal(signal.SIGKILL)
            job.wait()
    assert not (run_dir / "summary.json").exists(), "the job was killed before it finished"
    # Groups of the steps left were issued before the kill: only the checkpoint has them.
    saved = checkpoint.read_state(ckpt)
    assert saved["issued_groups"] > 2 * GROUPS and saved["rows"] > 0, saved

    resumed = subprocess.run(
        [*cli, "--resume", str(run_dir), "run.progress=true"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step-000002" in resumed.stderr
    assert [entry["step"] for entry in ledger(run_dir)] == list(range(steps))
    assert trained_groups(run_dir) == list(range(steps * GROUPS)), "every group trained once"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["launcher"] == "ray"
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1)), "one per step"


def test_a_placement_the_cluster_cannot_hold_is_an_error_naming_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Fails at once (not at ``ray.start_timeout``), naming what is asked and what there is."""
    overrides = ["warm_start.enabled=false", "ray.trainer_gpus=1", "ray.start_timeout=600"]
    with pytest.raises(PlacementError, match=r"trainer placement group's bundle \{CPU: 1, GPU: 1"):
        run(cluster, tmp_path, *overrides)
    assert not ray.is_initialized(), "what was started is torn down"
    overrides = ["warm_start.enabled=false", "trainer.dp_size=2", "ray.trainer_cpus=3"]
    with pytest.raises(PlacementError, match=r"needs \{CPU: 9\} in all .* has \{CPU: 6"):
        run(cluster, tmp_path, *overrides)
    assert not ray.is_initialized()
    # A cluster that adds nodes on demand may hold it later: the run waits for them.
    later = [*overrides, "ray.autoscaling=true", "ray.start_timeout=3"]
    with pytest.raises(TimeoutError, match=r"found no room: waited 3s"):
        run(cluster, tmp_path, *later)
    assert not ray.is_initialized()
    # As the local launcher refuses it: ranks of the hf engine failed only once they started.
    overrides = ["warm_start.enabled=false", "trainer.dp_size=2", "trainer.engine=hf"]
    with pytest.raises(cfg.ConfigError, match=r"dp_size > 1 needs trainer.engine deepspeed"):
        run(cluster, tmp_path, *overrides)
    assert not ray.is_initialized()


def test_a_placement_that_fits_but_finds_no_room_now_waits_saying_so_then_fails(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Another job holds every CPU: the run waits (up to ``ray.start_timeout``), then fails
    naming the group that found no room and what was free."""
    join(cluster.address, log_to_driver=False)
    try:
        hog = placement_group([{"CPU": 3.0}, {"CPU": 3.0}], strategy="SPREAD")
        ray.get(hog.ready(), timeout=60)
        overrides = ["warm_start.enabled=false", "ray.start_timeout=3"]
        config = cfg.load(None, [*FAST, *overrides])
        with (
            pytest.raises(TimeoutError, match=r"found no room: waited 3s .* trainer placement"),
            RayCluster(config),
        ):
            pass
        remove_placement_group(hog)
    finally:
        ray.shutdown()


#: The multi-turn tools job (examples/tools.yaml) small, the tool's answer computed in process.
TOOLS = [
    "launcher=ray",
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "warm_start.steps=20",
    f"trainer.groups_per_step={GROUPS}",
    "rollout.n=4",
    "rollout.groups_per_call=2",
    "data.eval_size=8",
    "rollout.engine=hf",
    "agent.latency.subprocess=false",
    "agent.latency.median=0.01",
    "run.eval_every=100",
    "run.stall_timeout=120",
    "ray.start_timeout=180",
]


def test_an_agent_run_trains_on_ray_and_counts_its_actors_trajectories(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Multi-turn trajectories generated in the rollout actors (their agent loops and tools in
    the actors' processes), trained, evaluated through an actor's engine, and counted in the
    summary as in a local run."""
    tools = Path(__file__).resolve().parents[2] / "examples" / "tools.yaml"
    config = cfg.load(tools, [*TOOLS, f"ray.address={cluster.address}", "trainer.max_steps=2"])
    summary = train(config, run_dir=tmp_path, reporter=Reporter(enabled=False))
    assert summary["launcher"] == "ray"
    assert trained_groups(tmp_path) == list(range(2 * GROUPS)), "every group trained once"
    assert all(r["agent_turns_mean"] >= 1 for r in metrics(tmp_path))
    agent = summary["agent"]
    # Every trained trajectory was counted by the actor that ran it, and took a turn at least.
    assert agent["trajectories"] >= 2 * GROUPS * 4
    assert agent["turns"] >= agent["trajectories"]
    assert agent["engine_calls"] > 0, agent
    assert 0.0 <= summary["accuracy_after"] <= 1.0


def test_the_readme_ray_command_runs_from_a_cold_start_on_a_small_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``asyncflow train --launcher ray`` with no cluster: the Ray instance the launcher starts
    holds the default placement (one rank, one engine, reward and advantage: 4 logical CPUs) on a
    machine of any size; a tiny model and two steps keep it cheap."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cheap = [o for o in FAST if not o.startswith(("launcher=", "ray."))]
    command = [sys.executable, "-m", "asyncflow.cli", "train", "--launcher", "ray"]
    command += ["--run-dir", str(tmp_path), "trainer.max_steps=2", "run.progress=false", *cheap]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["placement"]["nodes"] == 1
    assert len(ledger(tmp_path)) == 2


def test_sigterm_stops_a_ray_run_through_its_cleanup() -> None:
    # Ray's core worker replaced the command's SIGTERM handler with one that aborts the
    # process: the run died by SIGABRT, its cleanup never ran.
    script = (
        "import time\n"
        "import ray\n"
        "from asyncflow import cli\n"
        "from asyncflow.launch.ray_join import join\n"
        "cli._stop_on_sigterm()\n"
        "join(None, num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "try:\n"
        "    print('ready', flush=True)\n"
        "    while True: time.sleep(0.1)\n"
        "finally:\n"
        "    ray.shutdown()\n"
        "    print('cleaned up', flush=True)\n"
    )
    assert_sigterm_runs_cleanup(script)


class _Decoding:
    """A rollout worker that decodes until it is let go, and an engine that notes its calls."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls: list[str] = []

    def run(self) -> None:
        self.go.wait(60)

    def generate(self, prompts: list[list[int]], sampling: object) -> list[list[str]]:
        self.calls.append("generate")
        return [[]]


def test_an_evaluation_does_not_use_an_engine_whose_worker_still_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that outlived the supervisor's stop (its 60 s) still decodes with its engine:
    an evaluation through that actor is refused, naming it, rather than run beside the decode
    (nor weights loaded under it); once the worker stops, the engine is the evaluation's."""
    monkeypatch.setattr(ray_workers, "FREE_ENGINE_WAIT", 0.2)
    actor = object.__new__(ray_workers.WorkerActor)
    decoding = _Decoding()
    actor.engine, actor.worker = decoding, decoding  # type: ignore[assignment]
    decoding.label = "rollout-0"  # type: ignore[attr-defined]
    actor.idle = threading.Event()
    actor.idle.set()
    monkeypatch.setattr(actor, "report", lambda: None)
    running = threading.Thread(target=actor.run)
    running.start()
    try:
        while actor.idle.is_set():  # until the run has begun
            time.sleep(0.01)
        with pytest.raises(EngineError, match="rollout-0: its rollout worker still runs"):
            actor.generate([[1]], object())
        with pytest.raises(EngineError, match="cannot load weights"):
            actor.load_weights(3)
        assert decoding.calls == []
    finally:
        decoding.go.set()
        running.join(60)
    assert actor.generate([[1]], object()) == [[]] and decoding.calls == ["generate"]
