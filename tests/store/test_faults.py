"""Faults injected into real daemon and client processes, one trial each (``asyncflow
reliability`` runs many): SIGKILL of a consumer holding leases, of a producer mid-put, of a
daemon under load (standalone, controller, storage) with its data directory, a daemon that
stays down, and one that freezes. None may lose a row, commit one twice, show a partial row,
or leave a client hanging. Then the daemon's defences: a damaged log, writes through shared
views, socket-path clashes, slot exhaustion, and memory floods."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import asyncflow as af
from asyncflow.reliability import faults, hardening


def assert_clean(outcome: faults.Outcome) -> None:
    assert outcome.clean, outcome
    assert not [n for n in outcome.notes if "unclear" in n or "hung" in n], outcome.notes


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_a_killed_consumers_leases_expire_and_its_rows_come_again_once(kind: str) -> None:
    outcome = faults.consumer_killed_holding_leases(kind, rows=96)
    assert_clean(outcome)
    # The store's own count: each of the 96 rows acked once, by the consumer or the drain.
    assert outcome.store["rows_acked"] == 96
    assert outcome.store["live_rows"] == 0
    # The rows the consumer acked before it died never came again; the rest did.
    assert 0 < outcome.seen < 96


@pytest.mark.parametrize(
    ("kind", "transport"), [("standalone", "shm"), ("standalone", "tcp"), ("cluster", "tcp")]
)
def test_a_producer_killed_mid_put_leaves_no_partial_row(kind: str, transport: str) -> None:
    outcome = faults.producer_killed_mid_put(kind, transport, seed=1)
    assert_clean(outcome)
    assert outcome.rows > 0, "the producer recorded puts that returned before it died"
    assert outcome.lost == 0, "a put the producer recorded as returned is not in the store"
    assert outcome.seen >= outcome.rows
    assert outcome.duplicated == 0
    assert outcome.store["rows_acked"] == outcome.seen, "the store acked a row twice"


@pytest.mark.parametrize(
    ("kind", "victim"),
    [("standalone", "standalone"), ("cluster", "controller"), ("cluster", "storage-1")],
)
@pytest.mark.slow
def test_a_killed_daemon_restarts_with_every_completed_put_and_unacked_row(
    kind: str, victim: str
) -> None:
    outcome = faults.daemon_killed(kind, victim, fsync="always", seed=2)
    assert_clean(outcome)
    assert outcome.rows > 0


def test_a_daemon_that_stays_down_is_a_connection_error_not_a_hang() -> None:
    outcome = faults.daemon_stays_down(reconnect=1.0)
    assert_clean(outcome)
    assert outcome.expected_errors == {"ConnectionError": 1}, outcome.notes


def test_a_frozen_daemon_ends_a_waiting_claim_with_an_error_saying_what_it_waited_for() -> None:
    outcome = faults.daemon_frozen(request_timeout=1.0)
    assert_clean(outcome)
    assert sum(outcome.expected_errors.values()) == 1
    assert any("ping" in n or "claim" in n for n in outcome.notes), outcome.notes


def test_garbage_on_the_wire_never_takes_the_daemon_down() -> None:
    outcome = faults.garbage_frames(rounds=10, seed=3)
    assert_clean(outcome)
    assert outcome.seen == 10, "a well-behaved put after garbage did not read back whole"


def test_a_damaged_log_is_refused_by_name_and_recovered_only_when_asked() -> None:
    outcome = hardening.damaged_log(seed=4, rows=40)
    assert_clean(outcome)
    assert outcome.expected_errors["start refused, naming the damaged log"] == 1
    assert 0 <= outcome.seen < 40


def test_a_view_cannot_be_written_in_place_and_other_readers_see_what_was_put() -> None:
    outcome = hardening.read_only_views()
    assert_clean(outcome)
    assert outcome.expected_errors["in-place write to a view refused (ValueError)"] == 2


def test_socket_paths_of_live_daemons_or_files_are_refused_and_never_cross_daemons() -> None:
    outcome = hardening.socket_path_clash()
    assert_clean(outcome)
    assert sum(outcome.expected_errors.values()) == 3, outcome.expected_errors
    assert outcome.seen == 1


def test_silent_sockets_and_idle_clients_cannot_keep_a_client_out() -> None:
    outcome = hardening.slot_exhaustion(idle_sockets=20)
    assert_clean(outcome)
    assert outcome.expected_errors["silent sockets refused or closed at the hello deadline"] == 20
    assert outcome.expected_errors["a new client served in place of an idle one"] == 1
    assert outcome.seen == 5


def test_a_stalled_put_too_large_for_the_limit_keeps_no_memory() -> None:
    # The daemon reads on, dropping the bytes: no write waits long (30 s allowed).
    flood = hardening.stalled_puts(1 << 30, 64 << 20, connections=2, stall=30.0)
    assert flood.sent == 128, "the daemon read and dropped every byte sent"
    assert flood.ok, flood
    # Nothing was kept: the peak stays far below what was sent.
    assert flood.peak_rss - flood.start_rss < 32 << 20, flood


def test_claims_whose_replies_are_never_read_stop_being_read() -> None:
    flood = hardening.unread_claims(400_000)
    assert flood.ok, flood
    assert flood.sent < 400_000, "the daemon went on reading with its replies unread"


def _record(path: Path, puts: list[tuple[int, int]]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for first, count in puts:
            faults.record_put(fd, first, count)
    finally:
        os.close(fd)


def test_lost_counts_every_recorded_row_missing_or_not_whole_in_the_store(
    tmp_path: Path,
) -> None:
    """The producer-kill check on a store made to disagree with the record: rows 0-63 put whole,
    rows 64-127 recorded but never put, and row 5's payload not what was written."""
    record = tmp_path / "returned-puts"
    _record(record, [(0, 64), (64, 64)])
    store = af.Store()
    store.register_task("t")
    rows = faults.rows_of(range(64))
    rows["payload"][5] = np.zeros(3, dtype=np.int64)
    store.put(rows, partition="p")
    outcome = faults.Outcome()
    faults.check_recorded_puts(store, record, outcome)
    assert outcome.rows == 128
    assert outcome.seen == 64
    assert outcome.lost == 64 + 1
    assert outcome.partial == 1
    assert not outcome.clean


def test_rows_in_the_store_beyond_the_put_under_way_are_flagged(tmp_path: Path) -> None:
    record = tmp_path / "returned-puts"
    _record(record, [(0, 64)])
    store = af.Store()
    store.register_task("t")
    store.put(faults.rows_of(range(64 * 3)), partition="p")
    outcome = faults.Outcome()
    faults.check_recorded_puts(store, record, outcome)
    assert outcome.lost == 0
    assert [n for n in outcome.notes if "unclear" in n and "beyond" in n], outcome.notes


def test_a_torn_record_is_flagged(tmp_path: Path) -> None:
    record = tmp_path / "returned-puts"
    record.write_text("0 64\n64 6")
    assert faults.recorded_puts(record) == (set(range(64)), True)
