"""The reliability report states the commit, date and machine load it ran at, and reports the
fuzz corpus replay as cargo reported it: a failed replay fails the report."""

from __future__ import annotations

from typing import Any

from asyncflow.reliability import report


def kept(replay_outcome: str) -> dict[str, Any]:
    return {
        "random_input": {"summary": "8 passed", "code": 0, "examples": 3, "reasons": []},
        "machine": {"cpu": "cpu", "load_before": "1", "load_after": "2", "minutes": 1.0},
        "run": {
            "commit": "0123456789ab",
            "date": "2026-01-02 03:04 UTC",
            "uncommitted": [],
            "trials": 2,
            "soak_seconds": 5.0,
        },
        "corpus_replay": {
            "inputs": 7,
            "checked_in": 5,
            "outcome": replay_outcome,
            "summary": "test result: FAILED. 0 passed; 1 failed",
            "command": "cargo test",
        },
    }


def test_the_report_names_its_commit_date_and_settings() -> None:
    text, failed = report.render([], [], kept("passed"), None)
    assert "commit `0123456789ab`, started 2026-01-02 03:04 UTC" in text
    assert "--trials 2 --soak-seconds 5" in text
    assert "| 7 inputs (5 checked in) | test passed |" in text
    # The loads as read, and what the end's includes; not a claim about other work it cannot see.
    assert "load average 1 / 5 / 15 min 1 at the start, 2 at the end (which counts" in text
    assert "shared with other work" not in text
    assert not failed


def test_a_memory_flood_over_its_bound_fails_the_report() -> None:
    mib = 1 << 20
    flood = {"flood": "f", "trials": 3, "limit": 256 * mib, "transit": 256 * mib,
             "start_rss": 40 * mib, "sent": 9, "unit": "MiB sent"}  # fmt: skip
    within = kept("passed") | {"floods": [flood | {"peak_rss": 500 * mib}]}
    text, failed = report.render([], [], within, None)
    assert "| f | 3 | 9 MiB sent | 256 + 256 | 40 | 500 | 460 | ok |" in text
    assert not failed
    over = kept("passed") | {"floods": [flood | {"peak_rss": 600 * mib}]}
    text, failed = report.render([], [], over, None)
    assert "| 560 | FAILED |" in text
    assert failed


def test_a_failed_corpus_replay_fails_the_report() -> None:
    text, failed = report.render([], [], kept("failed"), None)
    assert "test failed" in text
    assert failed
