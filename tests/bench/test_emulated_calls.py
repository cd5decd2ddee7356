"""The pipeline suite's count of the emulator's CPU in the workers' own threads: the calls into
the emulated engines and verifier, each counted once, and nothing of the framework's around them.
Thread CPU only, so nothing depends on the clock."""

from __future__ import annotations

import time

import pytest

from asyncflow.bench.emulation.engines import CallsCpu


def burn(seconds: float) -> None:
    """Spends ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_call_inside_another_is_counted_once_and_the_callers_work_not_at_all() -> None:
    calls = CallsCpu()

    class Engine:
        @calls.counted
        def outer(self) -> str:
            return self.inner()

        @calls.counted
        def inner(self) -> str:
            burn(0.05)
            return "done"

    engine = Engine()
    burn(0.02)  # the framework's work before the call
    start = time.thread_time()
    assert engine.outer() == "done"
    spent = time.thread_time() - start
    burn(0.02)  # and after it
    # Counted twice, the inner call alone would make 0.1 s of the 0.05 s spent.
    assert 0.05 <= calls.seconds <= spent
    assert engine.inner() == "done"
    assert calls.seconds >= 0.1


def test_a_call_that_raises_is_counted_and_the_next_one_is_an_outer_call_again() -> None:
    calls = CallsCpu()

    @calls.counted
    def failing() -> None:
        burn(0.02)
        raise RuntimeError("device lost")

    @calls.counted
    def fine() -> None:
        burn(0.02)

    with pytest.raises(RuntimeError, match="device lost"):
        failing()
    assert calls.seconds >= 0.02
    fine()  # not taken for a call inside the failed one
    assert calls.seconds >= 0.04
