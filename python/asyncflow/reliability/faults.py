"""Faults injected into real daemons and clients, each a function that runs one trial and
reports what came of it: rows lost, rows committed twice, partial rows seen, and errors that a
client could not make sense of. The fast CI tests (``tests/store/test_faults.py``) run each once;
the ``asyncflow reliability`` command runs each many times and tabulates the outcomes.

Every row a trial writes carries its own proof: an ``id`` and a ``payload`` derived from it, so a
reader can tell a whole row from a partial or corrupted one.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

import asyncflow as af
from asyncflow.reliability.deployment import Deployment, Kind

Transport = Literal["auto", "tcp", "shm"]

#: How long a client tries to reconnect before it gives up (daemons restart in ~1 s).
RECONNECT = 60.0
#: Claims in these trials give up after this long; every wait is bounded.
WAIT = 30.0


@dataclass
class Outcome:
    """What one trial of a fault found."""

    rows: int = 0
    lost: int = 0
    duplicated: int = 0
    partial: int = 0
    crashes: int = 0
    #: Errors the client got that it was told to expect (e.g. "may or may not have been
    #: applied" for a put in flight when the daemon died), by kind.
    expected_errors: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    #: Distinct rows the harness read back whole at the end of the trial.
    seen: int = 0
    #: The store's own counters at the end of the trial (``stats()``), a tally kept apart
    #: from the harness's: e.g. ``rows_acked`` against the distinct rows seen.
    store: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.partial or self.crashes)


def payload(i: int) -> np.ndarray:
    """Row ``i``'s payload: its length and values both follow from ``i``."""
    return np.arange(i % 61 + 1, dtype=np.int64) * 7 + i


def rows_of(ids: Iterable[int]) -> dict[str, Any]:
    ids = list(ids)
    return {"id": np.array(ids, dtype=np.int64), "payload": [payload(i) for i in ids]}


def whole(ids: Sequence[Any], payloads: Sequence[Any]) -> list[bool]:
    """Whether each read row is exactly what was written for its id."""
    return [
        len(p) == len(payload(int(i))) and bool((p == payload(int(i))).all())
        for i, p in zip(ids, payloads, strict=True)
    ]


def connect(url: str, **kwargs: Any) -> af.Store:
    return af.connect(url, reconnect_timeout=RECONNECT, request_timeout=WAIT, **kwargs)


def drain(
    store: af.Store, task: str, outcome: Outcome, broken: set[int] | None = None
) -> Counter[int]:
    """Claims, checks and acks every row left for ``task``; returns how often each id came.
    Ids whose payload is not what was written for them go into ``broken`` too."""
    seen: Counter[int] = Counter()
    while True:
        batch = store.claim(task, ["id", "payload"], 256, timeout=0.5, allow_partial=True)
        if len(batch) == 0:
            return seen
        data = batch.read()
        ids = [int(i) for i in data["id"]]
        oks = whole(data["id"], data["payload"])
        outcome.partial += sum(not ok for ok in oks)
        if broken is not None:
            broken.update(i for i, ok in zip(ids, oks, strict=True) if not ok)
        seen.update(ids)
        batch.ack()


def store_counters(store: af.Store) -> dict[str, int]:
    """The store's own counters (``stats()``'s integers), to check the harness's tallies by."""
    return {k: v for k, v in store.stats().items() if isinstance(v, int)}


# -- a consumer killed while it holds leases ------------------------------------------------


def spawn(*args: str) -> subprocess.Popen[str]:
    """A client process of ``clients.py``, talking JSON lines on its stdout."""
    command = [sys.executable, "-m", "asyncflow.reliability.clients", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def kill_client(child: subprocess.Popen[str]) -> None:
    """SIGKILLs a client, waits for it and closes our end of its stdout."""
    child.send_signal(signal.SIGKILL)
    child.wait()
    if child.stdout is not None:
        child.stdout.close()


def hear(child: subprocess.Popen[str], timeout: float = WAIT * 2) -> dict[str, Any]:
    """The child's next message; fails (killing it) if none comes in time."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    line = child.stdout.readline() if ready else ""
    if not line:
        kill_client(child)
        raise RuntimeError(f"client {child.args!r} said nothing within {timeout}s")
    return dict(json.loads(line))


#: The consumer's leases last this long; its connection's grace after it closes, this long.
LEASE, GRACE = 600.0, 1.0


def consumer_killed_holding_leases(kind: Kind = "standalone", rows: int = 96) -> Outcome:
    """A consumer acks one batch, claims another and is SIGKILLed holding it. Its acked rows must
    never come again; its leased rows must come again once its connection's reconnect grace
    (1 s) is over, long before their 600 s leases would run out (the drain gives up after
    ``WAIT``); nothing is lost."""
    outcome = Outcome(rows=rows)
    flags = ("--lease-timeout", str(LEASE), "--reconnect-grace", str(GRACE))
    with Deployment(kind, None, *flags) as d:
        store = connect(d.url)
        store.register_task("t")
        store.put(rows_of(range(rows)))
        child = spawn("consumer", d.url)
        told = hear(child)
        acked = told["acked"]
        kill_client(child)
        killed = time.monotonic()
        seen = drain_until(store, "t", rows - len(acked), outcome)
        outcome.notes.append(f"leased rows came again {time.monotonic() - killed:.1f}s after")
        acked_ids = set(acked)
        outcome.duplicated = sum(seen[i] - 1 for i in seen if seen[i] > 1)
        outcome.duplicated += len(acked_ids & set(seen))
        outcome.lost = rows - len(acked_ids) - len(set(seen) - acked_ids)
        outcome.seen = len(seen)
        stats = outcome.store = store_counters(store)
        if stats["rows_acked"] != rows or stats["live_rows"] != 0:
            outcome.notes.append(f"stats after drain: {stats['rows_acked']=} {stats['live_rows']=}")
            outcome.lost += stats["live_rows"]
    return outcome


def drain_until(store: af.Store, task: str, expected: int, outcome: Outcome) -> Counter[int]:
    """Drains until ``expected`` distinct rows came (leases must expire first), or ``WAIT``."""
    seen: Counter[int] = Counter()
    deadline = time.monotonic() + WAIT
    while len(seen) < expected and time.monotonic() < deadline:
        seen.update(drain(store, task, outcome))
    seen.update(drain(store, task, outcome))
    return seen


# -- a producer killed in the middle of a put -------------------------------------------------

#: Rows per put of the producer (``clients.producer``): a put is a batch of consecutive ids.
PRODUCER_BATCH = 64


def producer_killed_mid_put(
    kind: Kind = "standalone", transport: Transport = "shm", seed: int = 0
) -> Outcome:
    """A producer putting 64-row batches is SIGKILLed at a random moment. Every put it recorded
    as returned must be in the store, whole; no consumer may ever see a partial row, and no
    row of the put it died in may linger unfinished."""
    outcome = Outcome()
    rng = random.Random(seed)
    with (
        tempfile.TemporaryDirectory(prefix="af-producer-") as tmp,
        Deployment(kind) as d,
    ):
        record = Path(tmp) / "returned-puts"
        store = connect(d.url)
        store.register_task("t")
        child = spawn("producer", d.url, transport, str(record))
        hear(child)
        time.sleep(rng.uniform(0.0, 0.3))
        kill_client(child)
        # A controller drops the unfinished put's rows when it sees the connection close.
        deadline = time.monotonic() + WAIT
        while unfinished(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        outcome.partial += unfinished(store)
        check_recorded_puts(store, record, outcome)
    return outcome


def record_put(fd: int, first: int, count: int) -> None:
    """Appends a put that returned (rows ``first`` to ``first + count - 1``) to the producer's
    record, and syncs it before the next put: what the record names, the store acknowledged."""
    os.write(fd, f"{first} {count}\n".encode())
    os.fsync(fd)


def recorded_puts(record: Path) -> tuple[set[int], bool]:
    """The ids of every put the producer recorded as returned, and whether the record ends in a
    torn line (which one ``write`` of a few bytes, killed or not, never leaves)."""
    text = record.read_text() if record.exists() else ""
    *lines, tail = text.split("\n")
    ids: set[int] = set()
    for line in lines:
        first, count = (int(x) for x in line.split())
        ids.update(range(first, first + count))
    return ids, tail != ""


def lost_rows(recorded: Iterable[int], seen: Iterable[int], broken: Iterable[int]) -> set[int]:
    """Rows recorded as put that the store no longer has, or has other than as written."""
    present, bad = set(seen), set(broken)
    return {i for i in recorded if i not in present or i in bad}


def check_recorded_puts(store: af.Store, record: Path, outcome: Outcome) -> None:
    """Drains the store and holds it to the producer's record: every recorded row must come
    back whole and once. Rows nobody recorded may only be the one put that was under way at the
    kill (it returned, or it was applied, but was not recorded)."""
    recorded, torn = recorded_puts(record)
    if torn:
        outcome.notes.append("unclear: the producer's record ends in a torn line")
    broken: set[int] = set()
    seen = drain(store, "t", outcome, broken)
    outcome.rows = len(recorded)
    outcome.seen = len(seen)
    outcome.lost = len(lost_rows(recorded, seen, broken))
    outcome.duplicated = sum(n - 1 for n in seen.values())
    # Puts are whole batches of consecutive ids: a batch half present was half applied.
    batches = Counter(i // PRODUCER_BATCH for i in seen)
    outcome.partial += sum(1 for n in batches.values() if n != PRODUCER_BATCH)
    end = max(recorded, default=-1) + 1
    strays = set(seen) - recorded - set(range(end, end + PRODUCER_BATCH))
    if strays:
        outcome.notes.append(f"unclear: {len(strays)} rows beyond the put under way at the kill")
    outcome.store = store_counters(store)
    if outcome.store["rows_acked"] != len(seen):
        outcome.notes.append(
            f"unclear: the store acked {outcome.store['rows_acked']} rows, "
            f"the harness saw {len(seen)} distinct"
        )


def unfinished(store: af.Store) -> int:
    """Rows that exist without both their fields, in one consistent look."""
    while True:
        rows = store.rows()
        try:
            done = store.ready_fields(rows.indexes) if len(rows) else []
        except af.UnknownIndexError:
            continue  # a row went between the two calls: look again
        return sum(sorted(f) != ["id", "payload"] for f in done)


# -- a daemon killed under load, then started again on its data directory ------------------


@dataclass
class Ledger:
    """What the clients were told: rows whose put returned, and rows whose ack returned."""

    put: set[int] = field(default_factory=set)
    #: How many acks of each row returned: more than one is a row committed twice.
    acked: Counter[int] = field(default_factory=Counter)
    #: Ids of puts and acks that raised because the daemon died under them.
    uncertain: set[int] = field(default_factory=set)


def _traffic(url: str, ledger: Ledger, stop: Any, outcome: Outcome, start: int) -> None:
    """Puts batches of 8 and acks what it claims, recording what each call returned."""
    store = connect(url)
    i = start
    while not stop.is_set():
        ids = list(range(i, i + 8))
        i += 8
        try:
            store.put(rows_of(ids), partition="p")
            ledger.put.update(ids)
        except af.ConnectionError as e:
            outcome.expected_errors["put in flight at the crash"] += 1
            ledger.uncertain.update(ids)
            if "may or may not" not in str(e) and "not applied" not in str(e):
                outcome.notes.append(f"unclear put error: {e}")
        except af.StoreError as e:
            ledger.uncertain.update(ids)
            outcome.notes.append(f"unclear put error: {type(e).__name__}: {e}")
        got: list[int] = []
        try:
            batch = store.claim("t", ["id", "payload"], 8, timeout=1.0, allow_partial=True)
            if len(batch):
                data = batch.read()
                got = [int(x) for x in data["id"]]
                outcome.partial += sum(not ok for ok in whole(data["id"], data["payload"]))
            batch.ack()
            ledger.acked.update(got)
        except af.LeaseError:
            # Leased before the restart: the lease is void and the rows come again.
            outcome.expected_errors["ack of a lease from before the restart"] += 1
        except af.ConnectionError as e:
            outcome.expected_errors["ack in flight at the crash"] += 1
            ledger.uncertain.update(got)
            if "may or may not" not in str(e) and "unreachable" not in str(e):
                outcome.notes.append(f"unclear ack error: {e}")
        except af.StoreError as e:
            ledger.uncertain.update(got)
            outcome.notes.append(f"unclear ack error: {type(e).__name__}: {e}")


def daemon_killed(
    kind: Kind = "standalone",
    victim: str | None = None,
    fsync: str = "always",
    seed: int = 0,
    clients: int = 2,
) -> Outcome:
    """Clients put and ack under way; a daemon (the standalone one, the controller or a storage
    daemon) is SIGKILLed at a random moment and started again on its data directory. Every put
    that returned must be there unless its ack returned; no acked row may come back; clients go
    on through the restart by reconnecting."""
    rng = random.Random(seed)
    outcome = Outcome()
    ledger = Ledger()
    with (
        tempfile.TemporaryDirectory(prefix="af-faults-") as root,
        Deployment(kind, Path(root), "--fsync", fsync, "--lease-timeout", "2") as d,
    ):
        victim = victim or d.front
        connect(d.url).register_task("t")
        stop = threading.Event()
        workers = [
            threading.Thread(target=_traffic, args=(d.url, ledger, stop, outcome, k << 40))
            for k in range(clients)
        ]
        for w in workers:
            w.start()
        time.sleep(rng.uniform(0.3, 1.0))
        d.kill(victim)
        time.sleep(rng.uniform(0.0, 0.3))
        d.restart(victim)
        time.sleep(0.5)
        stop.set()
        for w in workers:
            w.join(WAIT * 2)
            if w.is_alive():
                outcome.notes.append("a client thread hung")
                outcome.crashes += 1
        store = connect(d.url)
        acked = set(ledger.acked)
        seen = drain_until(store, "t", len(ledger.put - acked), outcome)
        outcome.rows = len(ledger.put)
        outcome.lost = len(ledger.put - acked - ledger.uncertain - set(seen))
        outcome.duplicated = len(acked & set(seen))
        outcome.duplicated += sum(n - 1 for n in seen.values())
        outcome.duplicated += sum(n - 1 for n in ledger.acked.values())
        strays = set(seen) - ledger.put - ledger.uncertain
        if strays:
            outcome.notes.append(f"{len(strays)} rows nobody put")
            outcome.partial += len(strays)
        if any(code != 0 for code in d.stop()):
            outcome.crashes += 1
    return outcome


# -- a daemon that stays down, or freezes ---------------------------------------------------


def daemon_stays_down(reconnect: float = 2.0) -> Outcome:
    """The daemon is killed for good: the next call raises ConnectionError, naming the daemon,
    once the reconnect timeout has passed, instead of hanging."""
    outcome = Outcome()
    with Deployment("standalone") as d:
        store = af.connect(d.url, reconnect_timeout=reconnect, request_timeout=5.0)
        store.put(rows_of([1]))
        d.kill("standalone")
        started = time.monotonic()
        try:
            store.stats()
            outcome.notes.append("a call to a dead daemon succeeded")
            outcome.crashes += 1
        except af.ConnectionError as e:
            outcome.expected_errors["ConnectionError"] += 1
            if d.url.removeprefix("tcp://") not in str(e):
                outcome.notes.append(f"the error does not name the daemon: {e}")
        outcome.notes.append(f"gave up after {time.monotonic() - started:.1f}s")
    return outcome


def daemon_frozen(request_timeout: float = 2.0) -> Outcome:
    """The daemon is SIGSTOPped (alive, sockets open, answering nothing): a waiting call ends
    with an error that says what it waited for."""
    outcome = Outcome()
    with Deployment("standalone") as d:
        store = af.connect(d.url, request_timeout=request_timeout, reconnect_timeout=1.0)
        store.register_task("t")
        d.freeze("standalone")
        try:
            started = time.monotonic()
            store.claim("t", "x", 1, timeout=None)
            outcome.crashes += 1
            outcome.notes.append("a claim on a frozen daemon returned")
        except (af.TimeoutError, af.ConnectionError) as e:
            outcome.expected_errors[type(e).__name__] += 1
            outcome.notes.append(f"after {time.monotonic() - started:.1f}s: {e}")
        finally:
            d.thaw("standalone")
    return outcome


# -- garbage on the wire --------------------------------------------------------------------


def _frame(op: int, request_id: int, meta: bytes, payload: bytes = b"") -> bytes:
    """A frame as the protocol lays it out (``crates/asyncflow-proto/src/frame.rs``)."""
    header = b"AF" + struct.pack("<BBIQII", 1, op, 0, request_id, len(meta), len(payload))
    return header + meta + payload


HELLO = _frame(1, 1, b"\x00" + struct.pack("<I", 0))


def _random_frame(rng: random.Random) -> bytes:
    """A well-formed envelope around a random operation, metadata and payload."""
    meta = rng.randbytes(rng.randint(0, 256))
    payload = rng.randbytes(rng.choice([0, 0, 8, 100]))
    return _frame(rng.randint(0, 40), rng.getrandbits(64), meta, payload)


def garbage_frames(rounds: int = 50, seed: int = 0) -> Outcome:
    """Connections that send random bytes, or a hello followed by frames with random operations
    and random metadata; after each, a well-behaved client must still be served, and the daemon
    must still be alive at the end."""
    rng = random.Random(seed)
    outcome = Outcome()
    with Deployment("standalone") as d:
        good = connect(d.url, transport="tcp")
        host, port = d.url.removeprefix("tcp://").rsplit(":", 1)
        for k in range(rounds):
            junk = rng.randbytes(rng.randint(1, 2048))
            if k % 2:
                frames = [_random_frame(rng) for _ in range(rng.randint(1, 8))]
                junk = HELLO + b"".join(frames)
            with socket.create_connection((host, int(port)), timeout=10) as bad:
                try:
                    bad.sendall(junk)
                    bad.shutdown(socket.SHUT_WR)
                    while bad.recv(65536):
                        pass
                except OSError:
                    pass
            ids = good.put(rows_of([k]))
            data = good.read(ids, ["id", "payload"])
            oks = whole(data["id"], data["payload"])
            outcome.partial += sum(not ok for ok in oks)
            outcome.seen += sum(oks)
            outcome.rows += 1
        if d.members["standalone"].proc.poll() is not None:
            outcome.crashes += 1
    return outcome
