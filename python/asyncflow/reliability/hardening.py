"""Faults against the daemon's own defences, each run on real daemon processes: a damaged
write-ahead log, a write through a shared-memory view, socket paths another daemon serves or a
file holds, connection slots taken by idle sockets and idle clients, and memory floods (puts
announced large and stalled part-way, claims pipelined by a client that reads no reply), the
floods with the daemon's peak resident memory against ``--memory-limit``."""

from __future__ import annotations

import contextlib
import random
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import asyncflow as af
from asyncflow.daemon import DaemonProcess, new_token
from asyncflow.reliability.faults import WAIT, Outcome, rows_of, whole

#: The frame header: magic, version, op, flags, request id, metadata and payload lengths.
HEADER = struct.Struct("<2sBBIQII")
OP_PUT, OP_CLAIM, OP_HELLO = 3, 4, 1
MIB = 1 << 20


def serve_command(*flags: str) -> list[str]:
    return [sys.executable, "-m", "asyncflow.cli", "store", "serve", "--listen", "127.0.0.1:0",
            "--log-level", "warn", *flags]  # fmt: skip


def refused_start(*flags: str) -> tuple[bool, str]:
    """Starts a daemon that should refuse to start: whether it exited non-zero by itself within
    30 s, and what it printed on stderr."""
    try:
        done = subprocess.run(serve_command(*flags), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as e:
        return False, f"still running after 30 s: {e.stderr!r}"
    return done.returncode != 0, done.stderr


# -- a damaged write-ahead log ---------------------------------------------------------------


def damaged_log(seed: int = 0, rows: int = 100) -> Outcome:
    """100 rows put one at a time, a clean stop, one byte of the meta log flipped between a
    quarter and three quarters of its length. The next start must refuse, naming the file, and
    leave every file as it was; ``--recover`` must start, keep a copy of the damaged log and
    restore only rows that were put (a prefix of them)."""
    rng = random.Random(seed)
    outcome = Outcome(rows=rows)
    token = new_token()
    with tempfile.TemporaryDirectory(prefix="af-damaged-") as root:
        data = Path(root) / "data"
        with DaemonProcess("--data-dir", str(data), token=token) as d:
            store = d.connect()
            for i in range(rows):
                store.put(rows_of([i]))
        log = max(data.glob("log-*.meta"))
        damaged = bytearray(log.read_bytes())
        at = rng.randrange(len(damaged) // 4, 3 * len(damaged) // 4)
        damaged[at] ^= 0xFF
        log.write_bytes(bytes(damaged))
        files = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
        refused, said = refused_start("--data-dir", str(data))
        if refused and log.name in said:
            outcome.expected_errors["start refused, naming the damaged log"] += 1
        else:
            outcome.crashes += 1
            outcome.notes.append(f"unclear: a damaged log was not refused by name: {said[-300:]}")
        now = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file()}
        if now != files:
            outcome.lost += rows
            outcome.notes.append("unclear: the refused start changed the data directory")
        with DaemonProcess("--data-dir", str(data), "--recover", token=token) as d:
            store = d.connect()
            live = store.rows()
            got = store.read(live.indexes, ["id", "payload"]) if len(live) else None
        ids = [int(i) for i in got["id"]] if got is not None else []
        if got is not None:
            outcome.partial += sum(not ok for ok in whole(got["id"], got["payload"]))
        if ids != list(range(len(ids))):
            outcome.notes.append(f"unclear: --recover restored {ids[:10]}..., not a prefix")
            outcome.partial += 1
        if not list(data.glob(f"{log.name}.damaged-*")):
            outcome.notes.append("unclear: --recover kept no copy of the damaged log")
            outcome.crashes += 1
        outcome.seen = len(ids)
        outcome.expected_errors["rows after the damage dropped by --recover, as it reported"] += (
            rows - len(ids)
        )
    return outcome


# -- a write through a shared-memory view ----------------------------------------------------


def read_only_views() -> Outcome:
    """A reader on the shared-memory path tries to change a row in place through the view
    ``read`` gave it; another reader, on another connection, must still see what was put."""
    outcome = Outcome(rows=1)
    with DaemonProcess(token=new_token()) as d:
        writer = d.connect(transport="shm")
        idx = writer.put({"adv": [np.ones(4, dtype=np.float32)]})
        view = d.connect(transport="shm").read(idx, "adv")["adv"][0]
        for attempt in ("view *= 100", "view.setflags(write=True)"):
            try:
                if attempt.startswith("view *="):
                    view *= 100
                else:
                    view.setflags(write=True)
                outcome.notes.append(f"unclear: `{attempt}` on a view was allowed")
                outcome.crashes += 1
            except ValueError:
                outcome.expected_errors["in-place write to a view refused (ValueError)"] += 1
        other = d.connect(transport="shm").read(idx, "adv")["adv"][0]
        outcome.seen = 1
        if not np.array_equal(other, np.ones(4, dtype=np.float32)):
            outcome.partial += 1
            outcome.notes.append(f"unclear: another reader saw {other}")
    return outcome


# -- socket paths --------------------------------------------------------------------------


def socket_path_clash() -> Outcome:
    """A second daemon given a live daemon's ``--shm-socket`` must refuse to start; so must one
    given a regular file, which stays as it was. A daemon whose socket path has come to lead to
    another daemon (its file replaced) must not get a client's data sent there: the client
    fails with ``transport="shm"`` and stays on TCP with ``auto``."""
    outcome = Outcome()
    token = new_token()
    with tempfile.TemporaryDirectory(prefix="af-sockets-") as root:
        path_a, path_b, file = (Path(root) / n for n in ("a.sock", "b.sock", "file"))
        with DaemonProcess("--shm-socket", str(path_a), token=token) as a:
            refused, said = refused_start("--shm-socket", str(path_a))
            if refused and "in use" in said:
                outcome.expected_errors["second daemon on a live socket path refused"] += 1
            else:
                outcome.crashes += 1
                outcome.notes.append(f"unclear: a live socket path was taken: {said[-300:]}")
            file.write_text("keep me")
            refused, said = refused_start("--shm-socket", str(file))
            if refused and file.read_text() == "keep me":
                outcome.expected_errors["regular file at the socket path refused, kept"] += 1
            else:
                outcome.crashes += 1
                outcome.notes.append(f"unclear: a file at the socket path was replaced: {said}")
            with DaemonProcess("--shm-socket", str(path_b), token=token) as b:
                path_a.rename(path_b)
                try:
                    b.connect(transport="shm")
                    outcome.crashes += 1
                    outcome.notes.append("unclear: a client took a socket another daemon serves")
                except af.ConnectionError as e:
                    if "another daemon" in str(e):
                        outcome.expected_errors["shm client: socket of another daemon"] += 1
                    else:
                        outcome.notes.append(f"unclear: {e}")
                client = b.connect()
                idx = client.put(rows_of([1]))
                outcome.rows = 1
                transport = client.stats()["transport"]
                on_b = b.connect(transport="tcp").read(idx, ["id", "payload"])
                outcome.seen = sum(whole(on_b["id"], on_b["payload"]))
                on_a = len(a.connect(transport="tcp").rows())
                if transport != "tcp" or on_a or outcome.seen != 1:
                    outcome.lost += 1
                    outcome.notes.append(f"unclear: auto used {transport}; rows on a: {on_a}")
    return outcome


# -- connection slots -----------------------------------------------------------------------


def slot_exhaustion(idle_sockets: int = 40) -> Outcome:
    """``idle_sockets`` sockets that never say hello, against ``--max-connections 4
    --max-unauthenticated 8 --hello-timeout 2``: four clients must still be served; sockets
    beyond eight refused at once, the rest closed at the hello deadline. Then, with every place
    taken by an idle client, a fifth client must be served (an idle one gives way, after
    ``--evict-idle-after 1``), and each idle one served again on its next call."""
    outcome = Outcome()
    flags = ["--max-connections", "4", "--max-unauthenticated", "8", "--hello-timeout", "2",
             "--evict-idle-after", "1", "--no-shm"]  # fmt: skip
    with DaemonProcess(*flags, token=new_token()) as d:
        idle = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(idle_sockets)]
        try:
            clients = [d.connect(transport="tcp", reconnect_timeout=10.0) for _ in range(4)]
            for k, c in enumerate(clients):
                c.put(rows_of([k]))
            outcome.expected_errors["clients served beside idle sockets"] += len(clients)
        except af.StoreError as e:
            outcome.crashes += 1
            outcome.notes.append(f"unclear: a client was not served beside idle sockets: {e}")
            clients = []
        closed = _closed_within(idle, WAIT)
        outcome.expected_errors["silent sockets refused or closed at the hello deadline"] += closed
        if closed != idle_sockets:
            outcome.notes.append(f"unclear: {idle_sockets - closed} silent sockets still open")
        time.sleep(1.5)
        try:
            fifth = d.connect(transport="tcp")
            fifth.put(rows_of([4]))
            outcome.expected_errors["a new client served in place of an idle one"] += 1
            time.sleep(1.5)
            for c in clients:
                c.stats()
            outcome.expected_errors["idle clients served again on their next call"] += len(clients)
        except af.StoreError as e:
            outcome.crashes += 1
            outcome.notes.append(f"unclear: {type(e).__name__}: {e}")
        outcome.rows = 5
        if not outcome.crashes:
            time.sleep(1.5)  # every client idle again: the check's connection takes a place
            outcome.seen = len(d.connect(transport="tcp").rows())
            outcome.lost = 5 - outcome.seen
    return outcome


def _closed_within(sockets: list[socket.socket], seconds: float) -> int:
    """How many of ``sockets`` the daemon closes within ``seconds`` (what it says is read)."""
    open_ = {s.fileno(): s for s in sockets}
    deadline = time.monotonic() + seconds
    closed = 0
    while open_ and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_), [], [], 0.2)
        for fd in ready:
            try:
                data = open_[fd].recv(65536)
            except OSError:
                data = b""
            if not data:
                open_.pop(fd).close()
                closed += 1
    for s in open_.values():
        s.close()
    return closed


# -- memory floods ----------------------------------------------------------------------------


@dataclass
class Flood:
    """One memory flood: the daemon's resident memory at the start and at its peak (the
    kernel's high-water mark), against ``--memory-limit`` plus ``--max-transit-bytes``."""

    flood: str
    trials: int = 0
    limit: int = 0
    transit: int = 0
    start_rss: int = 0
    peak_rss: int = 0
    #: What the flood sent, in its own unit (bytes of payload, or claims).
    sent: int = 0
    unit: str = ""

    @property
    def bound(self) -> int:
        """What the peak may reach: the start, the limit and the transit pool."""
        return self.start_rss + self.limit + self.transit

    @property
    def ok(self) -> bool:
        return 0 < self.peak_rss <= self.bound


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _captured_frames(d: DaemonProcess) -> dict[int, bytes]:
    """The hello and a claim (a task with no rows, allowing a partial batch, waiting 1 ms) as
    the real client sends them over TCP, by op code: caught by a relay in between."""
    relay = socket.create_server(("127.0.0.1", 0))
    frames: dict[int, bytes] = {}

    def run() -> None:
        client, _ = relay.accept()
        daemon = socket.create_connection(("127.0.0.1", d.port))
        with client, daemon:  # both closed once the claim is caught
            relay_until_claim(client, daemon)

    def relay_until_claim(client: socket.socket, daemon: socket.socket) -> None:
        stream = b""
        client.settimeout(0.05)
        daemon.settimeout(0.05)
        while OP_CLAIM not in frames:
            for src, dst, mine in ((client, daemon, True), (daemon, client, False)):
                try:
                    chunk = src.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                dst.sendall(chunk)
                if mine:
                    stream += chunk
                    while len(stream) >= HEADER.size:
                        _, _, op, _, _, meta, payload = HEADER.unpack_from(stream)
                        end = HEADER.size + meta + payload
                        if len(stream) < end:
                            break
                        frames.setdefault(op, stream[:end])
                        stream = stream[end:]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    store = af.connect(f"tcp://127.0.0.1:{relay.getsockname()[1]}", token=d.token,
                       transport="tcp")  # fmt: skip
    store.register_task("t")
    with contextlib.suppress(af.StoreError):
        store.claim("t", ["x"], 1, timeout=0.001, allow_partial=True)
    thread.join(10)
    relay.close()
    return frames


def _with_id(frame: bytes, request_id: int) -> bytes:
    magic, version, op, flags, _, meta, payload = HEADER.unpack_from(frame)
    head = HEADER.pack(magic, version, op, flags, request_id, meta, payload)
    return head + frame[HEADER.size :]


def stalled_puts(
    announced: int, sent: int, limit: str = "256MiB", connections: int = 4, stall: float = 3.0
) -> Flood:
    """``connections`` sockets say hello, announce a put of ``announced`` bytes each and send
    ``sent`` of them, then stall (each gives up writing once the daemon has read nothing of its
    for ``stall`` seconds). The daemon's peak memory is measured with the sockets still open."""
    flood = Flood(f"{connections} puts announced {announced // MIB} MiB, stalled at "
                  f"{sent // MIB} MiB", unit="MiB sent")  # fmt: skip
    with DaemonProcess("--memory-limit", limit, "--no-shm", token=new_token()) as d:
        pid = d.proc.pid
        flood.start_rss = _status(pid, "VmRSS")
        hello = _captured_frames(d)[OP_HELLO]
        version = HEADER.unpack_from(hello)[1]
        head = HEADER.pack(b"AF", version, OP_PUT, 0, 7, 16, announced) + bytes(16)
        sockets = []
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", d.port))
            s.sendall(hello + head)
            sockets.append(s)
        counts = [0] * connections

        def send(k: int) -> None:
            s = sockets[k]
            s.settimeout(stall)
            chunk = bytes(MIB)
            try:
                while counts[k] < sent:
                    counts[k] += s.send(chunk[: min(MIB, sent - counts[k])])
            except OSError:
                pass

        senders = [threading.Thread(target=send, args=(k,)) for k in range(connections)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        flood.peak_rss = _status(pid, "VmHWM")
        flood.sent = sum(counts) // MIB
        for s in sockets:
            s.close()
        stats = d.connect().stats()
        flood.limit, flood.transit = int(stats["memory_limit"] or 0), 256 * MIB
    flood.trials = 1
    return flood


def unread_claims(claims: int = 2_000_000) -> Flood:
    """One connection pipelines ``claims`` claims (each waiting 1 ms for rows that never come)
    and never reads a reply; it gives up writing once the daemon has read nothing for 3 s."""
    flood = Flood(f"{claims} claims pipelined, no reply read", unit="claims sent")
    with DaemonProcess("--memory-limit", "256MiB", "--no-shm", token=new_token()) as d:
        pid = d.proc.pid
        flood.start_rss = _status(pid, "VmRSS")
        frames = _captured_frames(d)
        s = socket.create_connection(("127.0.0.1", d.port))
        s.sendall(frames[OP_HELLO])
        s.settimeout(3.0)
        batch = 10_000
        try:
            for first in range(1, claims + 1, batch):
                s.sendall(b"".join(_with_id(frames[OP_CLAIM], first + k) for k in range(batch)))
                flood.sent += batch
        except OSError:
            pass
        flood.peak_rss = _status(pid, "VmHWM")
        s.close()
        stats = d.connect().stats()
        flood.limit, flood.transit = int(stats["memory_limit"] or 0), 256 * MIB
    flood.trials = 1
    return flood
