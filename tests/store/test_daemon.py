"""The daemon as users run it: `asyncflow store serve`, `asyncflow.connect`, tokens, transports,
sharding over storage daemons, metrics, stopping, and clients that misbehave."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import asyncflow as af
from asyncflow import _native
from asyncflow.daemon import DaemonProcess
from asyncflow.telemetry.threads import (
    WATCHER,
    asleep,
    new_thread,
    settled,
    switches_by_thread,
)

#: The conftest's ``daemons`` fixture: starts a daemon with the given flags.
Daemons = Callable[..., Any]


def test_tcp_can_be_asked_for_and_carries_the_same_data(daemons: Daemons) -> None:
    store = af.connect(daemons().url, transport="tcp")
    assert store.stats()["transport"] == "tcp"
    store.register_task("t")
    rows = [np.arange(n, dtype=np.float32) for n in (3, 0, 1000)]
    store.put({"v": rows, "text": ["a", "bc", ""]})
    batch = store.claim("t", ["v", "text"], 3, timeout=5)
    got = batch.read()
    for sent, back in zip(rows, got["v"], strict=True):
        np.testing.assert_array_equal(back, sent)
        assert not back.flags.writeable
    assert got["text"] == [b"a", b"bc", b""]
    batch.ack()


def test_shared_memory_reads_view_the_daemons_memory(daemons: Daemons) -> None:
    store = af.connect(daemons().url, transport="shm")
    idx = store.put({"x": [np.arange(4096, dtype=np.int64)]})
    view = store.read(idx, "x")["x"][0]
    assert isinstance(view.base, _native.ChunkOwner)
    assert np.shares_memory(view, store.read(idx, "x")["x"][0])


def test_one_read_of_rows_from_many_shared_segments(daemons: Daemons) -> None:
    # Each put stages its own segment (32 KiB: a put of 16 KiB or less would travel in its
    # request); a reader that has mapped none of them needs more descriptors than one message
    # carries, so the rest of the cells come inline.
    url = daemons().url
    writer, reader = af.connect(url, transport="shm"), af.connect(url, transport="shm")
    rows = [np.full(4096 + i, i, dtype=np.int64) for i in range(40)]
    idx = np.concatenate([writer.put({"x": [row]}) for row in rows])
    for _ in range(2):  # then again, with the segments mapped by the first read
        got = reader.read(idx, "x")["x"]
        for sent, back in zip(rows, got, strict=True):
            np.testing.assert_array_equal(back, sent)
    assert isinstance(reader.read(idx[-1:], "x")["x"][0].base, _native.ChunkOwner)
    # Rows whose segments alternate, each segment coming back after others.
    order = [k for pair in zip(range(20), range(39, 19, -1), strict=True) for k in pair]
    order += [0, 39, 0]
    got = reader.read(idx[order], "x")["x"]
    for k, back in zip(order, got, strict=True):
        np.testing.assert_array_equal(back, rows[k])


def test_a_token_is_required_when_configured(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = daemons("--token", "s3cret").url
    for token in (None, "wrong"):
        with pytest.raises(af.AuthError):
            af.connect(url, token=token)
    af.connect(url, token="s3cret").register_task("t")
    monkeypatch.setenv("ASYNCFLOW_TOKEN", "s3cret")
    af.connect(url).register_task("t")


def test_an_empty_token_never_turns_the_files_token_off(
    daemons: Daemons, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty ``$ASYNCFLOW_TOKEN`` is unset (as clients read it): the file's token holds. An
    empty ``--token`` is refused, not taken for none."""
    config = tmp_path / "daemon.toml"
    config.write_text('token = "s3cret"\n')
    monkeypatch.setenv("ASYNCFLOW_TOKEN", "")
    url = daemons("--config", str(config)).url
    with pytest.raises(af.AuthError):
        af.connect(url, token="wrong")
    af.connect(url, token="s3cret").register_task("t")
    command = [sys.executable, "-m", "asyncflow.cli", "store", "serve", "--listen", "127.0.0.1:0"]
    done = subprocess.run(
        [*command, "--config", str(config), "--token", ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "token is empty" in done.stderr, done.stderr
    assert "listening" not in done.stdout


def test_a_request_larger_than_the_transit_pool_is_refused_with_a_reply(daemons: Daemons) -> None:
    """Its connection stays up: the client knows the put was not applied."""
    store = af.connect(daemons("--max-transit-bytes", "4KiB").url)
    with pytest.raises(af.BadRequestError, match="--max-transit-bytes"):
        store.put({"x": list(range(300))})
    assert store.stats()["live_rows"] == 0
    store.put({"x": list(range(30))})
    assert store.stats()["live_rows"] == 30


def test_sigint_stops_the_daemon_cleanly_as_sigterm_does(daemons: Daemons) -> None:
    daemon = daemons()
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(timeout=60) == 0


def test_a_public_address_without_token_is_refused_before_listening() -> None:
    command = [sys.executable, "-m", "asyncflow.cli", "store", "serve", "--listen", "0.0.0.0:0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "--insecure" in done.stderr and "listening" not in done.stdout


def test_an_unreachable_daemon_is_a_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(af.ConnectionError):
        af.connect(f"tcp://127.0.0.1:{port}")


def test_sigterm_stops_a_waiting_claim_and_the_daemon_exits_cleanly(daemons: Daemons) -> None:
    port = free_port()
    daemon = daemons("--metrics", f"127.0.0.1:{port}")
    # The claim ends with an error reply, or, when the connection closes before that reply goes
    # out, once connecting again has failed for 2 s.
    store = af.connect(daemon.url, reconnect_timeout=2.0)
    store.register_task("t")
    errors: list[BaseException] = []

    def wait_for_rows() -> None:
        try:
            store.claim("t", "x", 1, timeout=60)
        except BaseException as e:
            errors.append(e)

    received = metric(port, "received_bytes_total")
    waiter = threading.Thread(target=wait_for_rows)
    waiter.start()
    wait_until(lambda: metric(port, "received_bytes_total") > received, "the claim arrived")
    # The daemon reads a connection's requests in order: once this one is answered, the claim
    # before it is waiting for rows.
    store.stats()
    assert daemon.stop() == 0
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], af.ConnectionError)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_are_served_in_prometheus_text(daemons: Daemons) -> None:
    port = free_port()
    store = af.connect(daemons("--metrics", f"127.0.0.1:{port}").url)
    store.put({"x": [1, 2, 3]})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    assert "# TYPE asyncflow_requests_total counter" in text
    assert "asyncflow_live_rows 3" in text


def metric(port: int, name: str) -> int:
    """A counter or gauge from the daemon's metrics page (``--metrics 127.0.0.1:PORT``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        lines = page.read().decode().splitlines()
    return next(int(n.split()[1]) for n in lines if n.startswith(f"asyncflow_{name} "))


def requests_served(port: int) -> int:
    return metric(port, "requests_total")


def test_a_put_that_acks_its_batch_is_one_request(daemons: Daemons) -> None:
    port = free_port()
    store = af.connect(daemons("--metrics", f"127.0.0.1:{port}").url)
    store.register_task("t")
    store.put({"x": [1, 2]})
    batch = store.claim("t", "x", 2, timeout=1)
    before = requests_served(port)
    store.put({"y": np.array([3, 4])}, indexes=batch.indexes, ack=batch)
    assert requests_served(port) - before == 1
    assert store.stats()["rows_acked"] == 2


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Polls ``condition`` until it holds; fails after ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_daemon_out_of_descriptors_waits_without_spinning_and_serves_again_after() -> None:
    # 64 descriptors at most, hard limit too: connections that never say hello use them up
    # (--hello-timeout keeps them), and the next ones wait in the listener's backlog.
    daemon = DaemonProcess("--hello-timeout", "600", prefix=("prlimit", "--nofile=64:64"))
    host, port = daemon.url.removeprefix("tcp://").rsplit(":", 1)
    try:
        idle = [socket.create_connection((host, int(port))) for _ in range(96)]
        fds = Path(f"/proc/{daemon.proc.pid}/fd")
        wait_until(lambda: len(list(fds.iterdir())) >= 63, "the daemon ran out of descriptors")
        before, t0 = cpu_seconds(daemon.proc.pid), time.monotonic()
        time.sleep(2.0)
        busy = (cpu_seconds(daemon.proc.pid) - before) / (time.monotonic() - t0)
        # Retrying a failing accept at once keeps a core busy (1.0 s a second here).
        assert busy < 0.3, f"the daemon used {busy:.2f} s of CPU a second while out of descriptors"
        for s in idle:
            s.close()
        store = af.connect(daemon.url, transport="tcp")
        store.register_task("t")
        store.put({"x": np.arange(3)})
        assert list(store.claim("t", "x", 3, timeout=30).read()["x"]) == [0, 1, 2]
    finally:
        assert daemon.stop() == 0


def test_a_shared_memory_put_after_the_first_is_one_round_trip(daemons: Daemons) -> None:
    port = free_port()
    store = af.connect(daemons("--metrics", f"127.0.0.1:{port}").url, transport="shm")
    store.register_task("t")
    block = np.random.default_rng(0).integers(0, 255, (4, 1 << 16), dtype=np.uint8)

    def one_round(i: int) -> None:
        store.put({"x": block + i})
        batch = store.claim("t", "x", 4, timeout=5)
        np.testing.assert_array_equal(np.stack(batch.read()["x"]), block + i)
        batch.ack()  # no view of the rows is left, so their segment is free again

    # The first put stages a region; once its rows are gone, the segment they were in comes
    # back (with the ack's reply) as a spare for the next put, which writes it without asking.
    one_round(0)
    before = requests_served(port)
    for i in range(1, 6):
        one_round(i)
    assert requests_served(port) - before == 5 * 3, "put, claim (bringing the cells), ack"
    gc.collect()
    assert store.stats()["memory_used"] == 0, "an unused spare holds no store memory"
    # A put of another size gives the spare back and stages; once its rows are gone, their
    # segment comes back as a spare of its size.
    # A put of a few KiB goes in its request instead, and leaves the spare alone.
    before = requests_served(port)
    store.put({"x": np.zeros((4, 1 << 18), np.uint8)})  # larger: stage and put
    store.claim("t", "x", 4, timeout=5).ack()
    medium = [np.ones(1 << 14, np.uint8)] * 2  # 32 KiB: a 1 MiB spare is not kept for it
    rows = store.put({"x": medium})
    assert [v.tolist() for v in store.read(rows, "x")["x"]] == [m.tolist() for m in medium]
    store.claim("t", "x", 2, timeout=5).ack()
    small = store.put({"x": [np.full(10, 2, np.uint8)]})  # in the request: one round trip
    assert store.read(small, "x")["x"][0].tolist() == [2] * 10
    store.put({"x": medium})  # into the 64 KiB spare, still there
    assert requests_served(port) - before == 2 + 2 + 2 + 1 + 2 + 1 + 1 + 1


def test_requests_travel_in_rings_unless_the_socket_is_asked_for(daemons: Daemons) -> None:
    url = daemons().url
    rings, socket = af.connect(url, transport="shm"), af.connect(url, transport="shm-socket")
    assert rings.stats()["transport"] == "shm"
    assert socket.stats()["transport"] == "shm-socket"
    rings.register_task("t")
    rows = rings.put({"x": [np.arange(3, dtype=np.int64)] * 2})
    assert [v.tolist() for v in socket.read(rows, ["x"])["x"]] == [[0, 1, 2]] * 2
    batch = socket.claim("t", "x", 2, timeout=5)
    assert [v.tolist() for v in batch.read()["x"]] == [[0, 1, 2]] * 2
    batch.ack()
    with pytest.raises(af.BadRequestError, match="'shm-socket'"):
        af.connect(url, transport="ring")


def watcher_wakeups(daemons: Daemons, claims: int, timeout: float, then_ask: bool) -> int:
    """How many times a new shared-memory link's watcher thread wakes while this thread makes
    ``claims`` claims that each wait ``timeout`` s for rows that never come, each followed
    (``then_ask``) by a request the daemon answers at once."""
    others = set(switches_by_thread(WATCHER))
    store = af.connect(daemons().url, transport="shm")
    store.register_task("t")
    mine = new_thread(WATCHER, others)  # this link's watcher
    # It may still be busy with the replies so far.
    wait_until(lambda: asleep(mine), "the watcher's sleep")
    before = switches_by_thread(WATCHER)[mine]
    for _ in range(claims):
        with pytest.raises(af.StoreTimeoutError):
            store.claim("t", "never", 1, timeout=timeout)
        if then_ask:
            store.register_task("t")  # answered at once, and read by its caller
    time.sleep(0.3)  # the watcher goes back to sleep after the last reply
    # Each wake-up ends in one more sleep.
    return switches_by_thread(WATCHER)[mine] - before


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_the_request_after_a_sleeping_claim_does_not_wake_the_watcher(daemons: Daemons) -> None:
    # A caller counts itself out of the link's sleepers only once it has woken, after the
    # watcher handed it its reply. The watcher, back at the top of its loop first, used to see
    # it still asleep and ask for the replies' bell again; the caller's next request's reply,
    # which the caller reads itself, then rang it for nothing: two wake-ups per claim.
    claims = 10
    woken = watcher_wakeups(daemons, claims, timeout=0.3, then_ask=True)
    # One wake-up a claim, for its reply; one more only when a reply to register_task comes
    # after its caller stopped looking and slept (200 µs), as on a loaded machine now and then.
    assert woken <= claims * 7 // 5, f"the watcher woke {woken} times for {claims} claims"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_replies_read_by_their_callers_do_not_wake_the_watcher_while_another_caller_sleeps(
    daemons: Daemons,
) -> None:
    # Threads of a process share one link. While one thread's claim sleeps (waiting for rows),
    # the watcher reads for it; the replies ring's bell used to say only "a reader sleeps", so
    # every reply to the other threads, each read by its own caller, rang the watcher as well.
    others = set(switches_by_thread(WATCHER))
    store = af.connect(daemons().url, transport="shm")
    store.register_task("t")
    watcher = new_thread(WATCHER, others)
    claimed: list[int] = []
    claimer = threading.Thread(
        target=lambda: claimed.append(len(store.claim("t", "x", 1, timeout=120)))
    )
    claimer.start()
    claiming = str(claimer.native_id)
    # The claim sleeps inside the native call (past any wait for the GIL), and the watcher.
    wait_until(lambda: settled(claiming) and asleep(watcher), "the claim's and the watcher's sleep")
    before = switches_by_thread(WATCHER)[watcher]
    asks = 40
    for _ in range(asks):
        store.register_task("t")  # answered at once, and read by its caller
        time.sleep(0.005)  # time for a watcher woken by the reply to fall asleep again
    woken = switches_by_thread(WATCHER)[watcher] - before
    waited_throughout = not claimed
    store.put({"x": [1.0]})
    claimer.join(timeout=60)
    assert claimed == [1], "the put ended the claim"
    assert waited_throughout, "the claim ended before the asks were made"
    # None, but for an ask whose reply came after its caller stopped looking (200 µs) and
    # slept, as on a loaded machine now and then.
    assert woken <= asks // 4, f"the watcher woke {woken} times for {asks} quick replies"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
def test_a_claim_that_sleeps_on_rings_wakes_the_watcher_only_for_its_reply(
    daemons: Daemons,
) -> None:
    # A caller about to sleep used to wake the link's watcher thread to have it listen for the
    # replies' bell, and the reply woke it again. On rings the caller now asks for the bell
    # itself, and only the reply (here: the daemon's answer at the claim's timeout) wakes it.
    claims = 4
    woken = watcher_wakeups(daemons, claims, timeout=0.5, then_ask=False)
    # Told, then the reply: at least 2 a claim; the reply only: 1, and one more now and then
    # when the bell rings for a reply read meanwhile. (No ping comes: the daemon is silent for
    # 0.5 s at a time, far less than a ping interval.)
    assert woken <= claims * 3 // 2, f"the watcher woke {woken} times for {claims} claims"


def test_a_shared_memory_claim_brings_its_cells_and_reading_them_asks_nothing(
    daemons: Daemons,
) -> None:
    port = free_port()
    url = daemons("--metrics", f"127.0.0.1:{port}").url
    shm, tcp = af.connect(url, transport="shm"), af.connect(url, transport="tcp")
    shm.register_task("t")
    shm.register_task("u")
    shm.put({"x": [np.arange(5, dtype=np.int32)] * 3, "y": [b"a", b"b", b"c"]})
    # Over TCP the claim brings no cells (they would all cross the socket whether read or not).
    before = requests_served(port)
    batch = tcp.claim("u", "x", 3, timeout=5)
    assert [v.tolist() for v in batch.read()["x"]] == [list(range(5))] * 3
    assert requests_served(port) - before == 2
    batch.ack()
    before = requests_served(port)
    batch = shm.claim("t", "x", 3, timeout=5)
    values = batch.read()["x"]
    assert requests_served(port) - before == 1, "the claim only"
    assert [v.tolist() for v in values] == [list(range(5))] * 3
    assert batch.read(["y"])["y"] == [b"a", b"b", b"c"], "a field not claimed is read"
    assert requests_served(port) - before == 2
    batch.ack()
    with pytest.raises(af.LeaseError):  # the rows are gone; the daemon says so
        batch.read()
    del values
    gc.collect()
    assert shm.stats()["memory_used"] == 0, "the cells sent with the claim are let go"


def test_a_put_into_a_spare_waits_for_memory_under_a_limit(daemons: Daemons) -> None:
    port = free_port()
    # Half the limit keeps freed segments for reuse: room for one of 64 KiB.
    flags = ("--memory-limit", "140000", "--metrics", f"127.0.0.1:{port}")
    store = af.connect(daemons(*flags).url, transport="shm")
    rows = [store.put({"x": [np.full(35000, i, np.uint8)]}) for i in range(4)]
    store.delete(rows[0])  # frees a 64 KiB segment: a spare, with the reply
    before = requests_served(port)
    with pytest.raises(af.MemoryLimitError):
        store.put({"x": [np.full(65000, 7, np.uint8)]}, timeout=0.05)
    assert requests_served(port) - before == 1, "the put went into the spare"
    assert store.stats()["memory_used"] == 3 * 35000  # and a spare comes with the reply
    # Room is made only once the put has reached the daemon (and found none).
    before, received = requests_served(port), metric(port, "received_bytes_total")

    def make_room() -> None:
        wait_until(lambda: metric(port, "received_bytes_total") > received, "the put arrived")
        store.delete(np.concatenate(rows[1:3]))

    freed = threading.Thread(target=make_room)
    freed.start()
    last = store.put({"x": [np.full(65000, 8, np.uint8)]}, timeout=60)
    freed.join()
    assert requests_served(port) - before == 2, "the put (into a spare), once room was made"
    assert store.read(last, "x")["x"][0].min() == 8
    assert store.stats()["memory_used"] == 35000 + 65000
    store.delete(np.concatenate([rows[3], last]))
    gc.collect()
    assert store.stats()["memory_used"] == 0


def test_a_store_sharded_over_three_storage_daemons(sharded_store: Callable[..., af.Store]) -> None:
    store = sharded_store(3)
    store.register_task("t")
    # 16 KiB and more a row, so that each storage daemon's part is written into its shared
    # memory; smaller parts would travel in their requests.
    rows = [np.full(4096 + n, n, dtype=np.int32) for n in range(9)]
    store.put({"ids": rows})
    s = store.stats()
    assert s["storage_daemons"] == 3 and s["payload_rows"] == 9 and s["transport"] == "shm"
    with store.claim("t", "ids", 9, timeout=5) as batch:
        for sent, back in zip(rows, batch.read()["ids"], strict=True):
            np.testing.assert_array_equal(back, sent)
    deadline = time.monotonic() + 10
    while store.stats()["payload_rows"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats()["payload_rows"] == 0, "acked rows are dropped on their storage daemons"
    # Each storage daemon set aside a spare for the next put; it holds no store memory.
    for n in range(3):
        store.put({"ids": rows})
        with store.claim("t", "ids", 9, timeout=5) as batch:
            assert [int(a[0]) for a in batch.read()["ids"]] == list(range(9)), n
    del back  # the last row viewed above keeps its chunk
    while store.stats()["memory_used"] and time.monotonic() < deadline + 10:
        time.sleep(0.02)
    assert store.stats()["memory_used"] == 0
    # A put that acks a batch: the controller commits the put, then the lease is acked.
    store.put({"ids": rows[:2]})
    batch = store.claim("t", "ids", 2, timeout=5)
    acked = store.stats()["rows_acked"]
    new = store.put({"ids": rows[2:4]}, partition="next", ack=batch)
    assert store.rows(new).partitions == ["next", "next"]
    assert store.stats()["rows_acked"] == acked + 2


def test_a_put_one_storage_daemon_refuses_fails_whole_and_the_others_go_on(
    sharded_store: Callable[..., af.Store],
) -> None:
    """A put's bytes go to every owner before any reply is awaited: one owner's refusal fails the
    put with its error, the others' replies are taken too (the next requests on their links get
    their own), and none of the put's rows stays."""
    store = sharded_store(3, "--memory-limit", "64KiB")
    store.register_task("t")
    # Rows 0, 1 and 2 go to storage daemons 0, 1 and 2; daemon 1's can never fit.
    rows = [np.zeros(10, np.uint8), np.zeros(100_000, np.uint8), np.zeros(10, np.uint8)]
    with pytest.raises(af.MemoryLimitError):
        store.put({"x": rows})
    assert store.stats()["live_rows"] == 0
    deadline = time.monotonic() + 10
    while store.stats()["payload_rows"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.stats()["payload_rows"] == 0, "the owners that stored theirs dropped them"
    for n in range(3):
        store.put({"x": [np.full(5, k, np.uint8) for k in range(3)]})
        with store.claim("t", "x", 3, timeout=5) as batch:
            assert [int(a[0]) for a in batch.read()["x"]] == [0, 1, 2], n


def test_data_parallel_ranks_share_a_claim_on_a_sharded_store(
    sharded_store: Callable[..., af.Store],
) -> None:
    store = sharded_store(2)
    store.register_task("train")
    # Groups of two rows, 1 to 4 tokens long: balanced parts hold 5 tokens each.
    for g, tokens in enumerate([1, 4, 2, 3]):
        store.put({"ids": [np.zeros(tokens, np.int64)] * 2}, groups=[g, g], group_size=2)
    parts = [
        store.claim(
            "train",
            ["ids"],
            8,
            timeout=5,
            whole_groups=True,
            step=0,
            dp_rank=r,
            dp_size=2,
            balance_field="ids",
        )
        for r in range(2)
    ]
    assert sorted(int(i) for p in parts for i in p.indexes) == list(range(8))
    for part in parts:
        assert sum(len(cell) for cell in part.read()["ids"]) == 10, "balanced by token counts"


def _put_from_child(url: str, queue: multiprocessing.Queue[int]) -> None:
    store = af.connect(url)
    queue.put(len(store.put({"x": [1, 2]})))


def test_a_forked_child_reconnects_on_its_own(daemons: Daemons) -> None:
    url = daemons().url
    store = af.connect(url)
    store.put({"x": [0]})
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[int] = ctx.Queue()
    child = ctx.Process(target=_put_from_child, args=(url, queue))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0 and queue.get(timeout=5) == 2
    assert store.stats()["live_rows"] == 3, "the parent's connection still works"


def test_the_parents_connection_in_a_forked_child_reconnects(daemons: Daemons) -> None:
    store = af.connect(daemons().url)
    pid = os.fork()
    if pid == 0:  # the child: the inherited store must reconnect rather than share a socket
        code = 0
        try:
            store.put({"x": [1]})
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.stats()["live_rows"] == 1


def test_garbage_on_one_connection_does_not_disturb_another(daemons: Daemons) -> None:
    daemon = daemons()
    store = af.connect(daemon.url, transport="tcp")
    host, port = daemon.url.removeprefix("tcp://").rsplit(":", 1)
    for junk in (b"\x00" * 24, b"GET / HTTP/1.1\r\n\r\n", os.urandom(4096)):
        with socket.create_connection((host, int(port)), timeout=10) as bad:
            bad.sendall(junk)
            bad.settimeout(10)
            # The daemon may refuse the frame and close before the junk is all read (a reset);
            # what matters is the other connection, below.
            try:
                bad.shutdown(socket.SHUT_WR)
                while bad.recv(4096):
                    pass
            except OSError:
                pass
        assert len(store.put({"x": [1]})) == 1


def test_serve_help_names_the_command_that_ran_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", "store", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: asyncflow store serve [OPTIONS]" in done.stdout
    assert "asyncflow-store [OPTIONS]" not in done.stdout
    # A usage error names it too, and exits 2 like every refused flag.
    bad = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", "store", "serve", "--lease-timeout", "1e20"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.startswith("asyncflow store serve: ") and "--lease-timeout" in bad.stderr
    assert "panicked" not in bad.stderr


def _frame(op: int, request_id: int, meta: bytes, payload: bytes = b"") -> bytes:
    """One protocol frame: magic, version 3, op, flags, id, then both lengths (little-endian)."""
    head = b"AF" + struct.pack("<BBIQII", 3, op, 0, request_id, len(meta), len(payload))
    return head + meta + payload


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    """The op and metadata of the next frame the daemon sends."""

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the daemon closed the connection"
            data += chunk
        return data

    head = exactly(24)
    meta_len, payload_len = struct.unpack("<II", head[16:24])
    body = exactly(meta_len + payload_len)
    return head[3], body[:meta_len]


def test_a_crafted_put_whose_size_overflows_is_a_schema_error(daemons: Daemons) -> None:
    """Sizes that wrap around 64 bits — first dimension 2**62 + 1 of f32[*, 1] is 4 bytes, of
    u8[*, 2**32, 2**32] 0 — are refused by the daemon with a schema failure; NumPy cannot build
    such arrays, so the put is written by hand."""
    daemon = daemons()
    store = af.connect(daemon.url, transport="tcp")
    host, port = daemon.url.removeprefix("tcp://").rsplit(":", 1)

    def u64s(xs: list[int]) -> bytes:
        return struct.pack("<I", len(xs)) + b"".join(struct.pack("<Q", x) for x in xs)

    f32, u8 = 6, 1
    for name, dtype, trailing, first_dim, payload in [
        (b"wide", f32, [1], 2**62 + 1, b"\0" * 4),
        (b"square", u8, [2**32, 2**32], 1, b""),
    ]:
        column = struct.pack("<I", len(name)) + name + bytes([dtype, 1]) + u64s(trailing)
        cells = struct.pack("<I", 1) + struct.pack("<QQQ", 0, len(payload), first_dim)
        partition = struct.pack("<I", 1) + b"p"
        target = b"\0" + partition + b"\0" + b"\0" + u64s([0]) + struct.pack("<I", 0)
        put = struct.pack("<I", 1) + column + cells + target + b"\0" + b"\0"
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(_frame(1, 1, b"\0" + struct.pack("<I", 0)))
            assert _reply(raw)[0] == 128, "hello answered"
            raw.sendall(_frame(3, 2, put, payload))
            op, meta = _reply(raw)
        assert op == 129, f"{name!r}: the put is refused"
        assert b"too many bytes" in meta, meta
    assert store.stats()["live_rows"] == 0, "nothing was stored"
    # The daemon goes on serving, and reads raise no builtin ValueError.
    idx = store.put({"x": [np.arange(3, dtype=np.float32)]})
    assert list(store.read(idx, ["x"])["x"][0]) == [0.0, 1.0, 2.0]


def test_a_killed_daemons_socket_is_removed_when_the_next_one_starts(daemons: Daemons) -> None:
    first = daemons()
    pid = first.proc.pid
    pattern = f"asyncflow-store-{pid}-"
    temp = tempfile.gettempdir()

    def sockets() -> list[str]:
        return [
            p.name
            for p in Path(temp).iterdir()
            if p.name.startswith(pattern) and p.name.endswith(".sock")
        ]

    assert len(sockets()) == 1, "the daemon serves shared memory on a socket in the temp dir"
    first.kill()
    assert len(sockets()) == 1, "SIGKILL leaves the socket behind"
    second = daemons()
    assert sockets() == [], "the next daemon to start removes it"
    assert len(af.connect(second.url).put({"x": [1]})) == 1


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for a parent that does not reap it does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_daemon_that_ends_with_its_parent_ends_when_the_parent_is_killed() -> None:
    """A job killed outright (SIGKILL: no cleanup of its own runs) leaves no daemon behind."""
    script = (
        "import time\n"
        "from asyncflow.daemon import DaemonProcess\n"
        "daemon = DaemonProcess(exit_with_parent=True)\n"
        "print(daemon.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as job:
        assert job.stdout is not None
        daemon = int(job.stdout.readline())
        assert running(daemon)
        job.kill()
        job.wait()
    deadline = time.monotonic() + 60  # generous: the daemon stops cleanly on its SIGTERM
    while running(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(daemon)
