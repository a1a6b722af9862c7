"""The shaped link alone: one message of n bytes after an idle spell, timed until the receiver has all of it.

    python -m nanotron_ext.bench.netns_hosts.probe --serve                               # on host 1
    python -m nanotron_ext.bench.netns_hosts.probe --send-to HOST1 --bytes 34816,262144  # on host 0: a JSON line each

It separates the link from the pipeline: bench/multi_host.py puts each size's median beside a plain pipe of the
link's rate (n / R) and tbf's bucket ((n - b) / R while the bucket holds b bytes), the two link models of the clock.
Plain TCP sockets (no library times one message after an idle spell); the receiver's one-byte reply ends the timing.
"""
from __future__ import annotations

import argparse
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
    from nanotron_ext.cli_flags import Float, Int, NumberList, Parser, Text

    parser = Parser(prog="python -m nanotron_ext.bench.netns_hosts.probe", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", action="store_true", help="receive messages and answer each (the far host)")
    parser.add_argument("--send-to", type=Text(), default=None, help="the serving host's address (the near host)")
    parser.add_argument("--bytes", type=NumberList(), default="34816,262144",
                        help="message sizes in bytes, comma-separated (default 34816,262144)")
    parser.add_argument("--repeats", type=Int(1), default=5, help="messages per size; the median is printed")
    parser.add_argument("--idle-s", type=Float(0.0), default=0.5, help="silence before each message (s)")
    parser.add_argument("--port", type=Int(1, 65535), default=PORT, help=f"TCP port (default {PORT})")
    args = parser.parse_args(argv)
    if args.serve == (args.send_to is not None):
        parser.error("give one of --serve and --send-to ADDR")
    if args.serve:
        serve(args.port)
    else:
        send(args.send_to, [int(n) for n in args.bytes.split(",")], args.repeats, args.idle_s, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
