"""Weight transports: each version reaches the rollout engine bit for bit, loaded in place; a
broadcast whose peer dies fails within the group's timeout, naming the peer, and leaves the
engine on the version it had. The broadcast tests run the gloo group over loopback between
processes of this machine."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

import asyncflow as af
from asyncflow import config as cfg
from asyncflow import weights as store_weights
from asyncflow.bench import weights_suite as ws
from asyncflow.config import Config, ModelConfig
from asyncflow.daemon import DaemonProcess
from asyncflow.engines.base import Completion, RolloutEngine, Sampling
from asyncflow.engines.hf import HFRolloutEngine
from asyncflow.engines.process_group import listening
from asyncflow.errors import ConfigError
from asyncflow.models.tiny import create_tiny_model
from asyncflow.weight_sync import WeightSyncError, ipc
from asyncflow.weight_sync import broadcast as bc
from asyncflow.weight_sync.broadcast import BroadcastPublisher, BroadcastReceiver
from asyncflow.weight_sync.group import Group, GroupSpec
from asyncflow.weight_sync.ipc import IpcPublisher, IpcReceiver, check_owner, process_identity
from asyncflow.weight_sync.layout import DIRECT_BYTES, Layout, as_bytes, pack
from asyncflow.weight_sync.store_transport import StorePublisher, StoreReceiver

pytestmark = [pytest.mark.slow]

#: Small buckets, so the tiny model's versions take many (and tensors straddle their ends).
BUCKET = 16 << 10
#: The groups' timeout: generous, as the machine running the tests may be loaded.
TIMEOUT = 60.0
#: The timeout of the group whose root stalls.
FAULT_TIMEOUT = 5.0
#: How long the test waits for a process's report before failing (it only expires on failure).
REPORT_WAIT = 300.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # MLP matrices of 128 x 2048 float32, 1 MiB each: broadcast sends them unpacked.
    config = ModelConfig(intermediate_size=DIRECT_BYTES // (128 * 4))
    return create_tiny_model(config, tmp_path_factory.mktemp("model"), seed=0)


def version_weights(model_dir: Path, version: int) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights at ``version``: the model's own, moved by a seeded random step
    (so every version differs from the last in every tensor)."""
    engine = HFRolloutEngine(model_dir, Config())
    generator = torch.Generator().manual_seed(version)
    out = []
    for name, param in engine.model.named_parameters():
        step = torch.randn(param.shape, generator=generator) * 1e-2 * version
        tensor = (param.detach() + step).contiguous()
        if "up_proj" in name:  # the same values in a non-contiguous tensor: sent packed
            tensor = tensor.t().contiguous().t()
        out.append((name, tensor))
    return out


def engine_bytes(engine: HFRolloutEngine) -> dict[str, bytes]:
    return {n: as_bytes(p).numpy().tobytes() for n, p in engine.model.named_parameters()}


def assert_bit_exact(got: dict[str, bytes], weights: list[tuple[str, torch.Tensor]]) -> None:
    assert set(got) == {n for n, _ in weights}
    for name, tensor in weights:
        assert got[name] == as_bytes(tensor).numpy().tobytes(), f"{name} differs"


# -- the configuration ---------------------------------------------------------------------------


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            ["weights.transport=ipc"],
            r"ipc shares the trainer's GPU memory .* sees no CUDA",
            marks=no_cuda,
        ),
        (
            ["weights.transport=broadcast", "launcher=ray"],
            r"broadcast needs launcher: local: under Ray .*; use store",
        ),
        (
            # Replacement groups need the trainer in the job's process.
            [
                "weights.transport=broadcast",
                "algorithm.filter_groups=true",
                "algorithm.max_extra_groups=2",
                "trainer.staleness_policy=drop",
            ],
            r"max_extra_groups > 0 .* weights\.transport store",
        ),
        (["weights.transport=nccl"], r"weights\.transport must be one of"),
        (["weights.bucket_size=0"], r"weights\.bucket_size must be a positive size"),
        (["weights.timeout=0"], r"weights\.timeout must be positive"),
    ],
)
def test_weights_settings_the_job_cannot_run_are_refused(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(cfg.ConfigError, match=message):
        cfg.load(None, overrides)


@pytest.mark.parametrize(
    "ranks",
    [[], ["trainer.engine=hf"], ["trainer.engine=fsdp", "trainer.dp_size=2"]],
    ids=["default", "hf", "fsdp-x2"],
)
def test_broadcast_puts_the_trainer_in_processes_of_its_own_whatever_its_ranks(
    ranks: list[str],
) -> None:
    """One rank too: the transport needs a trainer process to send from."""
    config = cfg.load(None, ["weights.transport=broadcast", *ranks])
    assert config.weights.transport == "broadcast"
    assert not cfg.trainer_in_job_process(config)
    assert cfg.trainer_in_job_process(cfg.load(None, [*ranks[:1], "trainer.own_process=false"]))


def test_a_single_store_rank_has_a_process_of_its_own_beside_vllm_by_default() -> None:
    def in_job(*overrides: str) -> bool:
        return cfg.trainer_in_job_process(cfg.load(None, list(overrides)))

    assert in_job("rollout.engine=hf")
    assert not in_job("rollout.engine=vllm")
    assert not in_job("rollout.engine=hf", "trainer.own_process=true")
    assert in_job("rollout.engine=vllm", "trainer.own_process=false")
    # Replacing left-out groups needs the trainer in the job's process: auto keeps it there.
    replacing = ["algorithm.filter_groups=true", "algorithm.max_extra_groups=2"]
    assert in_job("rollout.engine=vllm", *replacing, "trainer.staleness_policy=drop")
    with pytest.raises(cfg.ConfigError, match="own_process false or auto"):
        in_job("trainer.own_process=true", *replacing, "trainer.staleness_policy=drop")


def test_the_store_transport_is_the_default() -> None:
    assert cfg.load(None, []).weights.transport == "store"


# -- the layout ----------------------------------------------------------------------------------


def test_layout_packs_mixed_dtypes_into_buckets_and_views_them_back_bit_exact() -> None:
    tensors = [
        ("a", torch.randn(37, 5)),
        ("b", torch.randn(301).to(torch.bfloat16)),
        ("c", torch.arange(9, dtype=torch.int64).view(3, 3)),
        ("d", torch.randn(2, 2, 3).to(torch.float16)),
        ("e", torch.tensor([True, False, True])),
    ]
    layout = Layout.from_json(Layout.of(4, tensors, bucket_size=100).to_json())
    assert layout.version == 4
    segments = layout.segments()
    # All small tensors: one run, packed, cut into buckets, from the first byte to the last
    # tensor's end.
    assert {index for _, _, index in segments} == {None}
    assert segments[0][0] == 0 and segments[-1][1] == layout.tensors[-1].offset + 3
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segments))
    assert all(end - start <= 100 for start, end, _ in segments)
    flat = torch.zeros(layout.total, dtype=torch.uint8)
    scratch = torch.empty(layout.bucket_size, dtype=torch.uint8)
    for start, end, _ in segments:
        flat[start:end] = pack(scratch, start, end, layout, [t for _, t in tensors])
    for (name, want), (got_name, got) in zip(tensors, layout.views(flat), strict=True):
        assert got_name == name and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(as_bytes(got), as_bytes(want))


def test_large_tensors_get_segments_of_their_own_and_small_runs_are_packed() -> None:
    big = DIRECT_BYTES // 4  # float32 elements
    tensors = [
        ("small-a", torch.zeros(10)),
        ("small-b", torch.zeros(20)),
        ("big", torch.zeros(big + 3)),  # just over the threshold: cut into buckets
        ("small-c", torch.zeros(5)),
    ]
    layout = Layout.of(1, tensors, bucket_size=DIRECT_BYTES // 2)
    a, _, large, c = layout.tensors
    end_of = {spec.name: spec.offset + spec.nbytes for spec in layout.tensors}
    assert layout.segments() == [
        (a.offset, end_of["small-b"], None),
        (large.offset, large.offset + DIRECT_BYTES // 2, 2),
        (large.offset + DIRECT_BYTES // 2, large.offset + DIRECT_BYTES, 2),
        (large.offset + DIRECT_BYTES, end_of["big"], 2),
        (c.offset, end_of["small-c"], None),
    ]


def test_layout_refuses_a_buffer_of_another_size() -> None:
    layout = Layout.of(0, [("a", torch.zeros(10))], bucket_size=64)
    with pytest.raises(ValueError, match="64 bytes"):
        layout.views(torch.zeros(128, dtype=torch.uint8))


# -- the store transport -------------------------------------------------------------------------


def test_store_transport_loads_each_version_in_place_bit_exact(model_dir: Path) -> None:
    store = af.Store()
    publisher, receiver = StorePublisher(store), StoreReceiver(store)
    engine = HFRolloutEngine(model_dir, Config())
    params_before = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    for version in (1, 2):
        weights = version_weights(model_dir, version)
        publisher.publish(version, weights)
        assert receiver.latest() == version
        assert receiver.load(engine) == version == engine.version
        assert_bit_exact(engine_bytes(engine), weights)
    # In place: the engine's parameters are the same tensors as before.
    assert params_before == {n: p.data_ptr() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(6, dtype=torch.float32).view(2, 3),
        torch.arange(6).to(torch.bfloat16),  # another dtype
        torch.arange(12, dtype=torch.float32).view(3, 4),  # another shape
        torch.arange(7, dtype=torch.int8),  # the store holds int8 and int16 too
        torch.tensor(2.5),
        torch.empty(0, 4, dtype=torch.bfloat16),
    ],
    ids=["float32", "bfloat16", "other-shape", "int8", "scalar", "empty"],
)
def test_the_store_transport_takes_a_tensor_of_any_dtype_and_shape_after_another_models(
    tensor: torch.Tensor,
) -> None:
    """A store field keeps its dtype and cell shape for the store's life: a later run on the same
    daemon may publish a model whose tensor of the same name is of another dtype or shape."""
    store = af.Store()
    store_weights.publish(store, 0, [("w", torch.ones(2, 2))])  # the earlier run's model
    store_weights.publish(store, 0, [("w", tensor)])
    got, [(name, back)] = store_weights.fetch(store)
    assert (got, name) == (0, "w") and back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_version_larger_than_the_daemons_largest_put_goes_in_pieces_and_comes_back_whole(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    # A version went in one put: a daemon refuses a put over its --max-frame (1 GiB by
    # default), so a model of more than about 270 M float32 parameters could not be published.
    monkeypatch.setattr(store_weights, "PIECE_BYTES", 256 << 10)
    named = [
        ("embed", torch.arange(3 << 18, dtype=torch.float32)),  # 3 MiB: in parts
        ("norm", torch.arange(5).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.empty(0, 4)),
        *((f"layer{k}", torch.full((200, 256), float(k))) for k in range(4)),  # 200 KiB each
    ]
    with DaemonProcess("--max-frame", "1MiB") as daemon:
        store = daemon.connect(transport=transport)
        with pytest.raises(af.BadRequestError, match="max-frame"):
            store.put({"x": torch.zeros(1, 3 << 18)}, partition="p")
        # Refused with a reply, on the connection that goes on (over TCP too).
        store_weights.publish(store, 1, named)
        store_weights.publish(store, 2, [(n, t + 1) for n, t in named])
        got, back = store_weights.fetch(store, 1)
        assert got == 1 and [n for n, _ in back] == [n for n, _ in named]
        for (_, want), (_, have) in zip(named, back, strict=True):
            assert have.dtype == want.dtype and torch.equal(have, want)
        assert store_weights.fetch(store)[0] == 2


def test_weights_the_store_cannot_keep_two_versions_of_are_refused_before_anything_is_put() -> None:
    # The second version's put waited for memory that never freed, and failed a minute later.
    store = af.Store(memory_limit="1MiB")
    with pytest.raises(ConfigError, match=r"store\.memory_limit: .* 2 versions"):
        store_weights.publish(store, 0, [("w", torch.zeros(200_000))])  # 800 kB
    assert not len(store.rows(partition=store_weights.PARTITION))
    store_weights.publish(store, 0, [("w", torch.zeros(100_000))])
    store_weights.publish(store, 1, [("w", torch.ones(100_000))])
    assert torch.equal(store_weights.fetch(store)[1][0][1], torch.ones(100_000))


def test_a_watcher_loading_a_version_replaced_twice_meanwhile_loads_the_newest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = af.Store()
    for v in (1, 2, 3):
        store_weights.publish(store, v, [("w", torch.full((2,), float(v)))])
    real_fetch = store_weights.fetch
    newest = iter([2, 3])

    def fetch(store: af.Store, version: int | None = None) -> Any:
        if version in (1, 2):  # deleted under the read: a newer version replaced it
            raise LookupError(f"weights version {version} is not in the store")
        return real_fetch(store, version)

    monkeypatch.setattr(store_weights, "fetch", fetch)
    monkeypatch.setattr(store_weights, "latest_version", lambda _: next(newest))
    engine = GatedEngine()
    engine.gate.set()
    watcher = store_weights.Watcher(store, interval=0.01)
    assert watcher.load(engine, 1) == 3
    assert engine.version == 3 and engine.got["w"] == torch.full((2,), 3.0).numpy().tobytes()


# -- the broadcast transport ---------------------------------------------------------------------


class RecordingGroup:
    """Rank 0 of a group of one: records the order of packs, sends and waits, and where each
    sent tensor's memory is."""

    rank, label, labels, device = 0, "trainer rank 0", ["trainer rank 0"], torch.device("cpu")

    def __init__(self, events: list[str]) -> None:
        self.events = events
        #: ``data_ptr()`` of each tensor sent, in order.
        self.sent: list[int] = []

    def broadcast(self, tensor: torch.Tensor) -> Any:
        n = len(self.sent)
        self.sent.append(tensor.data_ptr())
        self.events.append(f"send {n}")
        group = self

        class Work:
            def wait(self) -> None:
                group.events.append(f"wait {n}")

        return Work()

    def barrier(self) -> None:
        self.events.append("barrier")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The publisher's packs, as a :class:`RecordingGroup` on it records its sends and waits."""
    recorded: list[str] = []
    real_pack = bc.pack

    def recording_pack(*args: Any) -> torch.Tensor:
        recorded.append("pack")
        return real_pack(*args)

    monkeypatch.setattr(bc, "pack", recording_pack)
    return recorded


def test_broadcast_packs_the_next_bucket_while_the_one_before_is_on_the_wire(
    events: list[str],
) -> None:
    publisher = BroadcastPublisher(af.Store(), RecordingGroup(events), bucket_size=1024)
    publisher.publish(1, [("w", torch.randn(1024))])  # 4 buckets
    # The header (send 0), then bucket k is send k + 1; bucket k + 1 is packed and sent before
    # bucket k's send is waited on, and a bucket buffer is reused only after its send is done.
    assert events == [
        "send 0", "wait 0",
        "pack", "send 1",
        "pack", "send 2",
        "wait 1", "pack", "send 3",
        "wait 2", "pack", "send 4",
        "wait 3", "wait 4", "barrier",
    ]  # fmt: skip
    assert bc.announced(publisher.store).keys() == {1}


def test_broadcast_sends_large_tensors_from_their_own_memory(events: list[str]) -> None:
    group = RecordingGroup(events)
    big = torch.randn(DIRECT_BYTES // 4)
    publisher = BroadcastPublisher(af.Store(), group, bucket_size=DIRECT_BYTES)
    publisher.publish(1, [("small", torch.randn(8)), ("big", big)])
    # The header, the small tensor packed, then the big one unpacked, straight from its memory.
    assert events[:5] == ["send 0", "wait 0", "pack", "send 1", "send 2"]
    assert group.sent[2] == big.data_ptr()


def _receiving_process(
    spec: GroupSpec,
    rank: int,
    store_url: str,
    model_dir: Path,
    versions: list[int],
    transport: str,
    conn: Any,
) -> None:
    """A process holding one rollout engine: loads each version as it arrives and sends its
    engine's bytes back."""
    store = af.connect(store_url)
    engine = HFRolloutEngine(model_dir, Config())
    kind = IpcReceiver if transport == "ipc" else BroadcastReceiver
    receiver = kind(store, Group(spec, rank, f"rollout process {rank}"), 0.02)
    for version in versions:
        try:
            if not receiver.wait_for(version, REPORT_WAIT):
                conn.send(("timeout", version))
                return
        except WeightSyncError as e:
            conn.send(("error", str(e)))
            return
        receiver.load(engine, version)
        conn.send(("loaded", engine.version, engine_bytes(engine)))
    conn.recv()  # stays in the group until the test is done


def serving(world_size: int, **settings: Any) -> tuple[GroupSpec, socket.socket]:
    """A group's spec, and the socket its rank 0 serves the rendezvous through, listening on the
    spec's port from now on."""
    listener, port = listening()
    return GroupSpec(port=port, world_size=world_size, **settings), listener


def _spawn(target: Any, *args: Any) -> tuple[Any, Connection]:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    theirs.close()
    return proc, ours


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess()
    yield d
    d.stop()


def check_delivery(
    model_dir: Path, daemon: DaemonProcess, transport: str, versions: list[int]
) -> None:
    """Publishes ``versions`` to two receiving processes and checks each engine, bit for bit;
    the store carries layouts (and ipc handles) only, no tensor."""
    backend = "gloo" if transport == "ipc" else None  # ipc: the group carries control only
    spec, listener = serving(3, timeout=TIMEOUT, backend=backend)
    children = [
        _spawn(_receiving_process, spec, r, daemon.url, model_dir, versions, transport)
        for r in (1, 2)
    ]
    store = daemon.connect()
    group = Group(spec, 0, "trainer rank 0", listener)
    publisher = (
        IpcPublisher(store, group)
        if transport == "ipc"
        else BroadcastPublisher(store, group, BUCKET)
    )
    try:
        for version in versions:
            weights = version_weights(model_dir, version)
            # ipc: the trainer's tensors are on the GPU, as after an optimiser step there.
            sent = [(n, t.cuda()) for n, t in weights] if transport == "ipc" else weights
            publisher.publish(version, sent)
            for _, conn in children:
                assert conn.poll(REPORT_WAIT), f"no engine report of v{version}"
                kind, got_version, got = conn.recv()
                assert (kind, got_version) == ("loaded", version)
                assert_bit_exact(got, weights)
        assert not len(store.rows(partition="__weights__"))
    finally:
        for proc, conn in children:
            conn.send("done")
            proc.join(timeout=TIMEOUT)
        publisher.close()


def test_broadcast_delivers_each_version_to_every_engine_bit_exact(
    model_dir: Path, daemon: DaemonProcess
) -> None:
    check_delivery(model_dir, daemon, "broadcast", [1, 2])


def _publishing_process(
    spec: GroupSpec,
    listener: socket.socket,
    store_url: str,
    model_dir: Path,
    fault: str,
    conn: Any,
) -> None:
    """Rank 0: publishes v1 whole, then dies (or stops) at the third bucket of v2."""
    store = af.connect(store_url)
    conn.send("joining")
    publisher = BroadcastPublisher(store, Group(spec, 0, "trainer rank 0", listener), BUCKET)
    publisher.publish(1, version_weights(model_dir, 1))
    conn.recv()
    real_pack, packed = bc.pack, [0]

    def pack_then_fail(*args: Any) -> torch.Tensor:
        packed[0] += 1
        if packed[0] == 3:
            if fault == "die":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_pack(*args)

    bc.pack = pack_then_fail  # type: ignore[assignment]
    publisher.publish(2, version_weights(model_dir, 2))


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_broadcast_root_failing_mid_version_fails_the_receiver_and_keeps_the_engine_on_the_last(
    model_dir: Path, daemon: DaemonProcess, fault: str
) -> None:
    # A stalled root is noticed only when the timeout expires: short here, long enough for v1.
    timeout = FAULT_TIMEOUT if fault == "stall" else TIMEOUT
    spec, listener = serving(2, timeout=timeout)
    with listener:  # the spawned rank 0 holds a copy
        proc, conn = _spawn(_publishing_process, spec, listener, daemon.url, model_dir, fault)
    assert conn.poll(REPORT_WAIT) and conn.recv() == "joining"
    receiver = BroadcastReceiver(daemon.connect(), Group(spec, 1, "rollout process 1"), 0.02)
    engine = HFRolloutEngine(model_dir, Config())
    try:
        assert receiver.wait_for(1, REPORT_WAIT)
        receiver.load(engine)
        conn.send("go")
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"v2: the broadcast from trainer rank 0 failed"):
            receiver.wait_for(2, REPORT_WAIT)
        # Within the group's timeout, plus the time to build v2 before sending it (generous:
        # the property is that it ends, on a machine that may be loaded).
        assert time.monotonic() - started < timeout + 60
        if fault == "die":
            proc.join(timeout=TIMEOUT)
            assert proc.exitcode == 3
        # Nothing of v2 reached the engine, and v1 is still what a load gives.
        assert receiver.latest_received() == 1
        assert receiver.load(engine) == 1
        assert_bit_exact(engine_bytes(engine), version_weights(model_dir, 1))
    finally:
        receiver.close()
        proc.kill()


def _dying_receiver(spec: GroupSpec, store_url: str, conn: Any) -> None:
    """Joins the group and exits as soon as a version is announced."""
    store = af.connect(store_url)
    Group(spec, 1, "rollout process 1")
    while not bc.announced(store):
        time.sleep(0.02)
    os._exit(4)


def test_broadcast_receiver_dying_fails_the_publisher_naming_the_receivers(
    model_dir: Path, daemon: DaemonProcess
) -> None:
    spec, listener = serving(2, timeout=TIMEOUT)
    proc, _ = _spawn(_dying_receiver, spec, daemon.url)
    group = Group(spec, 0, "trainer rank 0", listener)
    publisher = BroadcastPublisher(daemon.connect(), group, BUCKET)
    started = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"v1: broadcasting to rollout process 1"):
            publisher.publish(1, version_weights(model_dir, 1))
        assert time.monotonic() - started < TIMEOUT + 60
    finally:
        proc.kill()


# -- the ipc transport ----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")


def test_an_ipc_handle_is_refused_once_its_owner_is_gone() -> None:
    me = process_identity(os.getpid())
    assert me is not None
    check_owner(me, 1)  # a live owner passes
    # A later process given the same pid has another start time: refused.
    with pytest.raises(
        WeightSyncError, match=rf"v1: refused the CUDA IPC handle of process {me['pid']}"
    ):
        check_owner({**me, "start": me["start"] + 1}, 1)
    # A child that runs until its stdin closes: alive, then exited but not reaped, then reaped.
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        alive = process_identity(child.pid)
        assert alive is not None
        check_owner(alive, 2)
        assert child.stdin is not None
        child.stdin.close()
        deadline = time.monotonic() + REPORT_WAIT  # expires only on failure
        while b") Z " not in Path(f"/proc/{child.pid}/stat").read_bytes():
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        with pytest.raises(WeightSyncError, match=r"v3: refused .* which is gone"):
            check_owner(alive, 3)  # a zombie
    finally:
        child.kill()
        child.wait()
    assert process_identity(child.pid) is None
    with pytest.raises(WeightSyncError, match=r"v4: refused .* which is gone"):
        check_owner(alive, 4)


def test_an_ipc_handle_goes_through_the_store_as_json_and_opens_with_the_same_fields(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What torch's CUDA reduction gives after the class, size, stride, offset, storage class
    # and dtype: device, handle, sizes, requires_grad, ref counter, event (bytes where it has).
    shared = (0, b"\x00\xffhandle", 4096, 0, False, b"/counter\x00", 7, b"\x01event", True)
    monkeypatch.setattr(ipc, "reduce_tensor", lambda t: (None, (None,) * 6 + shared))
    handle = ipc.share(torch.zeros(4096, dtype=torch.uint8))
    assert json.loads(handle)["numel"] == 4096  # JSON: nothing is unpickled on the way in
    opened: list[tuple[Any, ...]] = []
    monkeypatch.setattr(ipc, "rebuild_cuda_tensor", lambda *args: opened.append(args))
    ipc.open_shared(handle)
    assert opened == [
        (torch.Tensor, (4096,), (1,), 0, torch.storage.TypedStorage, torch.uint8, *shared)
    ]


@needs_cuda
def test_ipc_delivers_each_version_to_every_engine_bit_exact(
    model_dir: Path, daemon: DaemonProcess
) -> None:
    check_delivery(model_dir, daemon, "ipc", [1, 2, 3])


def _ipc_publisher_dying_after_announcing(
    spec: GroupSpec, listener: socket.socket, store_url: str, model_dir: Path, conn: Any
) -> None:
    """Rank 0: publishes v1 whole, then dies as soon as v2 is announced."""
    store = af.connect(store_url)
    conn.send("joining")
    publisher = IpcPublisher(store, Group(spec, 0, "trainer rank 0", listener))
    publisher.publish(1, version_weights(model_dir, 1))
    conn.recv()
    real_announce = bc.announce

    def announce_then_die(*args: Any) -> None:
        real_announce(*args)
        os._exit(3)

    bc.announce = announce_then_die  # type: ignore[assignment]
    publisher.publish(2, version_weights(model_dir, 2))


@needs_cuda
def test_ipc_publisher_dying_fails_the_receiver_and_keeps_the_engine_on_the_last(
    model_dir: Path, daemon: DaemonProcess
) -> None:
    spec, listener = serving(2, timeout=TIMEOUT, backend="gloo")
    with listener:  # the spawned rank 0 holds a copy
        proc, conn = _spawn(
            _ipc_publisher_dying_after_announcing, spec, listener, daemon.url, model_dir
        )
    assert conn.poll(REPORT_WAIT) and conn.recv() == "joining"
    receiver = IpcReceiver(daemon.connect(), Group(spec, 1, "rollout process 1"), 0.02)
    engine = HFRolloutEngine(model_dir, Config())
    try:
        assert receiver.wait_for(1, REPORT_WAIT)
        receiver.load(engine)
        conn.send("go")
        with pytest.raises(WeightSyncError, match=r"v2: .*trainer rank 0"):
            receiver.wait_for(2, REPORT_WAIT)
        proc.join(timeout=TIMEOUT)
        assert proc.exitcode == 3
        assert receiver.latest_received() == 1
        assert receiver.load(engine) == 1
        assert_bit_exact(engine_bytes(engine), version_weights(model_dir, 1))
    finally:
        receiver.close()
        proc.kill()


# -- the weights bench's weight sets ------------------------------------------------------------


def test_bench_weight_sets_are_shaped_like_qwen2_decoder_layers() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=ws.HIDDEN,
        intermediate_size=ws.INTERMEDIATE,
        num_attention_heads=ws.HEADS,
        num_key_value_heads=ws.KV_HEADS,
        num_hidden_layers=1,
        vocab_size=8,
    )
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    layer = {n: tuple(p.shape) for n, p in model.named_parameters() if ".layers.0." in n}
    assert dict(ws.layer_shapes(0)) == layer
    assert ws.layers_for(1.0) * ws.layer_bytes() == pytest.approx(1e9, rel=0.1)


def test_a_closed_group_frees_its_rendezvous_port() -> None:
    spec, listener = serving(1, backend="gloo")
    group = Group(spec, 0, "alone", listener)
    port = spec.port
    group.close()
    group.close()  # a second close does nothing
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # a member of a new group could serve on it again


class GatedEngine(RolloutEngine):
    """Loads only once ``gate`` opens, then keeps the bytes it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.gate = threading.Event(), threading.Event()
        self.got: dict[str, bytes] = {}

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        raise NotImplementedError

    def load_weights(self, version: int, weights: Any) -> None:
        self.entered.set()
        assert self.gate.wait(REPORT_WAIT)
        self.got = {name: as_bytes(t).numpy().tobytes() for name, t in weights}
        self.version = version


def in_process_pair(timeout: float) -> tuple[BroadcastPublisher, BroadcastReceiver]:
    """A publisher and one receiver in this process, over a gloo group on loopback, with 4 KiB
    buckets and an embedded store."""
    spec, listener = serving(2, timeout=timeout, backend="gloo")
    store = af.Store()
    joined: list[Group] = []
    joining = threading.Thread(target=lambda: joined.append(Group(spec, 1, "rollout 1")))
    joining.start()
    publisher = BroadcastPublisher(store, Group(spec, 0, "trainer rank 0", listener), 4096)
    joining.join(REPORT_WAIT)
    return publisher, BroadcastReceiver(store, joined[0], 0.01)


def test_versions_arrive_while_an_engine_loads_and_never_into_the_buffer_it_reads() -> None:
    def weights(version: int) -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.full((4096,), float(version))), ("b", torch.arange(7.0) * version)]

    publisher, receiver = in_process_pair(TIMEOUT)
    engine = GatedEngine()
    try:
        publisher.publish(1, weights(1))
        assert receiver.wait_for(1, REPORT_WAIT)
        loading = threading.Thread(target=receiver.load, args=(engine,), daemon=True)
        loading.start()
        assert engine.entered.wait(REPORT_WAIT)
        # While the engine is held mid-load on v1: two more versions are received (the
        # group's closing barrier is passed each time), the second into a fresh buffer.
        publishing = threading.Thread(
            target=lambda: [publisher.publish(v, weights(v)) for v in (2, 3)], daemon=True
        )
        publishing.start()
        publishing.join(REPORT_WAIT)
        assert not publishing.is_alive(), "publishing waited for an engine's load"
        assert receiver.latest_received() == 3
    finally:
        engine.gate.set()
    loading.join(REPORT_WAIT)
    assert_bit_exact(engine.got, weights(1))  # what it loaded was v1 whole
    assert receiver.load(engine) == 3
    assert_bit_exact(engine.got, weights(3))
    receiver.close()
    publisher.close()


def test_a_version_no_newer_than_the_last_sent_is_refused_at_once_and_the_group_goes_on() -> None:
    # Receivers take only a newer version: the publisher waited for them in the header's
    # broadcast until its timeout, then blamed them and refused every later version.
    publisher, receiver = in_process_pair(FAULT_TIMEOUT)
    try:
        publisher.publish(1, [("w", torch.ones(64))])
        assert receiver.wait_for(1, REPORT_WAIT)
        for version in (1, 0):
            with pytest.raises(ValueError, match=f"v{version} not sent: v1 was"):
                publisher.publish(version, [("w", torch.zeros(64))])
        publisher.publish(2, [("w", torch.full((64,), 2.0))])
        assert receiver.wait_for(2, REPORT_WAIT)
    finally:
        receiver.close()
        publisher.close()


def test_a_publisher_that_fails_to_pack_a_version_names_itself_not_the_receivers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy off the GPU that fails (an illegal access, out of memory) is rank 0's own failure:
    # it was reported as "a receiver died or stalled", sending the user to the wrong process.
    publisher, receiver = in_process_pair(FAULT_TIMEOUT)
    publisher.publish(1, [("w", torch.ones(64))])
    assert receiver.wait_for(1, REPORT_WAIT)

    def failing(*_: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bc, "pack", failing)
    with pytest.raises(WeightSyncError) as raised:
        publisher.publish(2, [("w", torch.full((64,), 2.0))])
    message = str(raised.value)
    assert message.startswith("weights v2: trainer rank 0 failed to pack it at bucket 1/1: CUDA")
    assert "receiver" not in message
    # The receiver, left mid-transfer, names rank 0 and keeps v1.
    with pytest.raises(WeightSyncError, match=r"v2: the broadcast from trainer rank 0 failed"):
        receiver.wait_for(2, REPORT_WAIT)
    assert receiver.latest_received() == 1
    receiver.close()
    publisher.close()
