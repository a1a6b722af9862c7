"""The shaped link alone: one message of n bytes after an idle spell, timed until the receiver has all of it.

    python -m nanotron_ext.bench.netns_hosts.probe serve            # on host 1
    python -m nanotron_ext.bench.netns_hosts.probe send HOST1 N...  # on host 0: a JSON line per size

It separates the link from the pipeline: bench/multi_host.py puts each size's median beside a plain pipe of the
link's rate (n / R) and tbf's bucket ((n - b) / R while the bucket holds b bytes), the two link models of the clock.
Plain TCP sockets (no library times one message after an idle spell); the receiver's one-byte reply ends the timing.
"""
from __future__ import annotations

import json
import socket
import statistics
import sys
import time
from typing import Optional, Sequence

PORT = 29777
HEADER = 8  # the message's length, big-endian


def serve(port: int = PORT) -> None:
    """Receive messages (length, payload) and answer each with one byte, until the sender closes."""
    with socket.create_server(("0.0.0.0", port), reuse_port=True) as server:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while len(header := conn.recv(HEADER, socket.MSG_WAITALL)) == HEADER:
                left = int.from_bytes(header, "big")
                while left:
                    left -= len(conn.recv(min(1 << 20, left)))
                conn.sendall(b"k")


def send(addr: str, sizes: Sequence[int], repeats: int = 5, idle_s: float = 0.5, port: int = PORT) -> None:
    """Per size, the median seconds from handing a message to the socket until the receiver's reply, each after
    `idle_s` of silence (a bucket refills), printed as one JSON line."""
    deadline = time.monotonic() + 30
    while True:  # the server may still be starting
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for n in sizes:
            times = []
            for _ in range(repeats):
                time.sleep(idle_s)
                t = time.perf_counter()
                conn.sendall(n.to_bytes(HEADER, "big") + bytes(n))
                conn.recv(1)
                times.append(time.perf_counter() - t)
            print(json.dumps({"bytes": n, "median_s": statistics.median(times), "repeats": repeats}), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        serve()
        return 0
    if args[:1] == ["send"] and len(args) >= 3:
        send(args[1], [int(n) for n in args[2:]])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
