"""What a fault-tolerant replica exposes to, and accepts from, its torchft peers (issue 33 row 14).

torchft 0.2 as shipped lets any process that can reach a replica run code in it: its Manager and its recovery
HTTP server listen on all interfaces, and a replica behind the quorum's step unpickles whatever the peer with the
highest step serves (`weights_only=False`). Here a replica's torchft services listen on one address (the local end
of the route to the lighthouse: 127.0.0.1 for a lighthouse on this machine), the healing state is unpickled with
`weights_only=True` (tensors, numbers, containers: no code), and it is checked before torchft applies it.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import pickle
import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import torch
from torch.distributed._serialization import _streaming_load  # what torchft's transport reads with
from torchft.checkpointing import HTTPTransport


class PeerRefused(ValueError):
    """A healing state this replica will not take (torchft reports it, the sync's commit vote fails)."""


def url_host(host: str) -> str:
    """`host` as it stands in a URL or a Rust socket address (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host else host


def bind_host(lighthouse: str) -> str:
    """The address a replica's torchft services listen on and advertise: the local end of the route to the
    lighthouse (a UDP connect picks the route and sends nothing), so peers that reach the lighthouse reach it."""
    u = urlparse(lighthouse)
    family, _, _, _, addr = socket.getaddrinfo(u.hostname, u.port or 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def advertised_store(host: str) -> str:
    """The address of this replica group's store (torchrun's, MASTER_ADDR) as the other replica groups reach it:
    torchft hands it to them for the cross-replica process group, so a loopback MASTER_ADDR (torchrun --standalone)
    becomes `host`, this host's end of the route to the lighthouse (the store listens on every interface)."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        loopback = False
    return host if loopback else addr


def lighthouse_bind(lighthouse: str) -> str:
    """The lighthouse's own bind address (`host:port`) from its URL: that address only, not all interfaces."""
    u = urlparse(lighthouse)
    family, _, _, _, addr = socket.getaddrinfo(u.hostname, u.port or 29510, type=socket.SOCK_STREAM)[0]
    return f"{url_host(addr[0])}:{addr[1]}"


@contextlib.contextmanager
def manager_server_bound_to(host: str) -> Iterator[None]:
    """While a torchft Manager is built: its ManagerServer listens on `host` (torchft 0.2 hard-codes `[::]:port`)."""
    import torchft.manager as tm

    original = tm.ManagerServer

    def bound(**kw: Any) -> Any:
        return original(**{**kw, "bind": f"{url_host(host)}:{kw['bind'].rsplit(':', 1)[1]}"})

    tm.ManagerServer = bound
    try:
        yield
    finally:
        tm.ManagerServer = original


class _EndWatch:
    """A response body that remembers whether a read came back short, i.e. it ended before the reader's need (torchft
    sends the healing state with no length, so a peer that dies mid-transfer just closes the body)."""

    def __init__(self, f: Any) -> None:
        self._f, self.ended_early = f, False

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.ended_early |= n is not None and n > 0 and len(data) < n
        return data

    def readline(self, *limit: int) -> bytes:
        line = self._f.readline(*limit)
        self.ended_early |= not line.endswith(b"\n") and not (limit and len(line) == limit[0])
        return line

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self.ended_early |= n < len(buffer)
        return n


class TensorsOnlyTransport(HTTPTransport):
    """torchft's HTTP recovery transport listening on `host` only, reading a peer's state with weights_only=True;
    `check(state, step, source)` vets it (raises PeerRefused) before torchft applies it."""

    def __init__(self, host: str, timeout: timedelta, check: Callable[[Dict[str, Any], int, str], None]) -> None:
        self._host, self._check = host, check
        super().__init__(timeout=timeout, num_chunks=0)
        handler = self._server.RequestHandlerClass  # torchft's handler (it serves nothing yet: no step allowed)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        server = type("_BoundHTTPServer", (ThreadingHTTPServer,),
                      {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
                       "request_queue_size": 1024})
        self._server = server((host, 0), handler)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def address(self) -> str:
        return f"http://{url_host(self._host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            body = _EndWatch(f)
            try:
                return _streaming_load(body, weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if body.ended_early:  # the body stopped short (torchft sends no length: a dead peer closes it)
                    raise PeerRefused(f"the healing state from the peer at {address} broke off before it was "
                                      f"complete (the peer stopped, or the link dropped) [{first}]") from None
                raise PeerRefused(f"refused to heal from the peer at {address}: its state is not only tensors, numbers "
                                  f"and containers (read with weights_only: nothing in it was run) [{first}]") from None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Dict[str, Any]:
        state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self._check(state, step, metadata)
        return state


def peer_state_problem(state: object, step: int, shapes: List[Tuple[torch.Size, torch.dtype]], momentum_too: bool,
                       max_syncs: Optional[int],
                       fixed_shapes: Optional[List[Tuple[torch.Size, torch.dtype]]] = None) -> Optional[str]:
    """Why `state` (torchft's {"user": {"default": ...}, "torchft": ...} from the peer at quorum step `step`) is not
    one this run could have produced, or None: the step it carries is the one the quorum announced, its outer sync
    count is a whole number no larger than that step nor than the run's outer syncs, its global weights (and outer
    momentum, where this run has one; and heterogeneous SparseLoCo's T_fixed, `fixed_shapes`) are ours in count,
    shape and dtype, and finite."""
    try:
        ours, ft = state["user"]["default"], state["torchft"]
        weights, momentum, syncs = ours["global"], ours["momentum"], ours["syncs"]
        fixed = ours["fixed"] if fixed_shapes is not None else []
        peer_step = ft["step"]
    except (TypeError, KeyError):
        return "it is not a SparseLoCo healing state (global, momentum, syncs" + \
            (", fixed" if fixed_shapes is not None else "") + "; torchft step)"
    if type(peer_step) is not int or peer_step != step:
        return f"it carries step {peer_step!r}, the quorum announced {step}"
    if type(syncs) is not int or not 0 <= syncs <= step or (max_syncs is not None and syncs > max_syncs):
        limit = f" and this run's {max_syncs} outer syncs" if max_syncs is not None else ""
        return f"its outer sync count {syncs!r} is not in [0, step {step}{limit}]"
    expected = shapes + (shapes if momentum_too else [])
    if not isinstance(weights, list) or not isinstance(momentum,
                                                       list) or len(weights) + len(momentum) != len(expected) \
            or len(weights) != len(shapes):
        return f"it has {_count(weights)} weight and {_count(momentum)} momentum tensors, this replica " \
               f"{len(shapes)} and {len(expected) - len(shapes)}"
    if fixed_shapes is not None and (not isinstance(fixed, list) or len(fixed) != len(fixed_shapes)):
        return f"it has {_count(fixed)} T_fixed tensors, this replica {len(fixed_shapes)}"
    for i, (t, (shape, dtype)) in enumerate(zip(weights + momentum + fixed, expected + (fixed_shapes or []))):
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            return f"tensor {i} is {got}, this replica's is {tuple(shape)} {dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"tensor {i} is not finite"
    return None


def _count(x: object) -> str:
    return str(len(x)) if isinstance(x, list) else "no list of"
