"""The raw-socket ceiling of the ``tcp/*`` cases: a native loopback echo (``asyncflow-echo``, in
the ``_native`` module like the daemon) in its own process.

Both ends are pipelined and tuned: the client writes its rounds on one thread while another reads
the echo back, the server relays each chunk it reads to a writer thread, and every socket has
``TCP_NODELAY`` and 4 MiB send and receive buffers. A round sends the block to the other process
and receives it back, the bytes a ``tcp`` round moves (put in, read out), with nothing but the
socket in the way.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from asyncflow import _native


class EchoPeer:
    """An echo server subprocess and a connection to it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncflow.bench.echo"], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.client = _native.EchoClient(port)

    def round_trips(self, block: np.ndarray, rounds: int, back: np.ndarray | None = None) -> float:
        """Seconds to send ``block`` and receive it back ``rounds`` times, the sends running
        ahead of the receives. ``back`` (the block's shape) ends holding the last echo."""
        if back is None:
            back = np.empty_like(block)
        return self.client.round_trips(np.ascontiguousarray(block), rounds, back)

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> EchoPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    def listening(port: int) -> None:
        print(port, flush=True)

    _native.echo_serve(listening)


if __name__ == "__main__":
    main()
