"""The raw-socket baseline of the ``tcp/*`` cases: a loopback echo server in its own process.

Each message is a length (8 bytes) then that many bytes, received into a buffer and sent back
whole, so the client measures exactly what moving the same bytes to another process and back
costs with nothing but the socket in the way.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np


def serve(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    head = bytearray(8)
    while True:
        if conn.recv_into(head, 8, socket.MSG_WAITALL) != 8:
            return
        n = int.from_bytes(head, "little")
        if len(buf) < n:
            buf = bytearray(n)
        view = memoryview(buf)[:n]
        got = 0
        while got < n:
            got += conn.recv_into(view[got:], n - got)
        conn.sendall(view)


class EchoPeer:
    """An echo server subprocess and a connection to it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncflow.bench.echo"], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trips(self, block: np.ndarray, rounds: int) -> float:
        """Seconds to send ``block`` and receive it back ``rounds`` times."""
        data = block.data.cast("B")
        back = bytearray(len(data))
        view = memoryview(back)
        head = len(data).to_bytes(8, "little")
        t0 = time.perf_counter()
        for _ in range(rounds):
            self.sock.sendall(head)
            self.sock.sendall(data)
            got = 0
            while got < len(data):
                got += self.sock.recv_into(view[got:], len(data) - got)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=10)


def main() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    serve(listener)


if __name__ == "__main__":
    main()
