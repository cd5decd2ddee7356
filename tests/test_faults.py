"""Faults injected into real daemon and client processes, one trial each (``asyncflow
reliability`` runs many): SIGKILL of a consumer holding leases, of a producer mid-put, of a
daemon under load (standalone, controller, storage) with its data directory, a daemon that
stays down, and one that freezes. None may lose a row, commit one twice, show a partial row,
or leave a client hanging."""

from __future__ import annotations

import pytest

from asyncflow.reliability import faults


def assert_clean(outcome: faults.Outcome) -> None:
    assert outcome.clean, outcome
    assert not [n for n in outcome.notes if "unclear" in n or "hung" in n], outcome.notes


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_a_killed_consumers_leases_expire_and_its_rows_come_again_once(kind: str) -> None:
    outcome = faults.consumer_killed_holding_leases(kind)
    assert_clean(outcome)
    assert outcome.rows == 96


@pytest.mark.parametrize(
    ("kind", "transport"), [("standalone", "shm"), ("standalone", "tcp"), ("cluster", "tcp")]
)
def test_a_producer_killed_mid_put_leaves_no_partial_row(kind: str, transport: str) -> None:
    outcome = faults.producer_killed_mid_put(kind, transport, seed=1)
    assert_clean(outcome)
    assert outcome.rows > 0, "the producer wrote whole puts before it died"


@pytest.mark.parametrize(
    ("kind", "victim"),
    [("standalone", "standalone"), ("cluster", "controller"), ("cluster", "storage-1")],
)
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
    assert outcome.rows == 10
