"""The ``tcp/*`` cases' raw-socket ceiling: the native echo in its own process sends back exactly
the bytes it was sent, round after round, and nothing more."""

from __future__ import annotations

import numpy as np
import pytest

from asyncflow.bench.echo import EchoPeer


def test_every_round_comes_back_byte_for_byte() -> None:
    # Rows of an odd size, so rounds straddle the echo's reads; not a multiple of its chunk.
    block = np.random.default_rng(7).integers(0, 256, (3, 700_001), dtype=np.uint8)
    with EchoPeer() as echo:
        for rounds in (1, 6):
            back = np.zeros_like(block)
            assert echo.round_trips(block, rounds, back) > 0
            assert np.array_equal(back, block)


def test_a_back_buffer_of_another_size_is_refused() -> None:
    block = np.ones((4, 1024), dtype=np.uint8)
    with EchoPeer() as echo:
        with pytest.raises(ValueError, match="bytes"):
            echo.round_trips(block, 1, np.empty((4, 1000), dtype=np.uint8))
        back = np.zeros_like(block)
        echo.round_trips(block, 2, back)  # the connection is still usable
        assert np.array_equal(back, block)
