"""The hosts' launchers agree before any of them waits (nanotron_ext.launch_hosts, issue 53): every host's
verdict goes through one real c10d TCPStore (node 0 its server, the others clients, here threads of one process),
and every host ends with the same line: one host's refusal, a node rank given twice or out of range, --nnodes
different between hosts, or the node ranks that never arrived within the bound."""
from __future__ import annotations

import socket
import threading
from typing import Dict, List, Optional

import pytest

from nanotron_ext.launch_hosts import exchange, judge, open_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _verdict(node: int, nnodes: int = 2, refusal: Optional[str] = None) -> Dict[str, object]:
    return {"node": node, "nnodes": nnodes, "addr": f"10.0.0.{node + 1}", "refusal": refusal}


def _hosts(verdicts: List[Dict[str, object]], nnodes: int = 2, bound_s: float = 20.0) -> List[Optional[str]]:
    """Each verdict posted by its own 'host' (a thread; the first is node 0, the server): what each one ends with."""
    port = _free_port()
    server = open_store("127.0.0.1", port, 0)
    out: List[Optional[str]] = [None] * len(verdicts)
    notes: List[str] = []

    def host(i: int) -> None:
        store = server if i == 0 else open_store("127.0.0.1", port, 1)
        out[i] = exchange(store, verdicts[i], nnodes, bound_s, "--master-addr 127.0.0.1",
                          note=lambda *a, **k: notes.append(a[0]))

    threads = [threading.Thread(target=host, args=(i,)) for i in range(len(verdicts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.parametrize("refusing", [0, 1])
def test_one_hosts_refusal_is_what_every_host_ends_with(refusing: int) -> None:
    line = "error: data.prepared_dir /x does not exist"
    out = _hosts([_verdict(i, refusal=line if i == refusing else None) for i in (0, 1)])
    want = f"node {refusing} (10.0.0.{refusing + 1}): data.prepared_dir /x does not exist"
    assert out == [want, want], out


def test_every_host_ready_agrees_on_nothing_to_refuse() -> None:
    assert _hosts([_verdict(0), _verdict(1)]) == [None, None]
    assert _hosts([_verdict(0, 3), _verdict(1, 3), _verdict(2, 3)], nnodes=3) == [None, None, None]


def test_a_node_rank_given_to_two_hosts_is_named_on_every_host() -> None:
    out = _hosts([_verdict(0, 3), _verdict(1, 3), {**_verdict(1, 3), "addr": "10.0.0.9"}], nnodes=3)
    assert all(o is not None and "--node-rank 1 was given to two hosts" in o for o in out), out
    assert all("10.0.0.2" in o and "10.0.0.9" in o for o in out), out


def test_nnodes_that_differ_between_hosts_are_named() -> None:
    out = _hosts([_verdict(0, 2), _verdict(1, 3)])
    assert all(o is not None and "--nnodes differs between hosts" in o for o in out), out


def test_a_host_that_never_arrives_is_named_after_the_bound() -> None:
    out = _hosts([_verdict(0, 3), _verdict(1, 3)], nnodes=3, bound_s=1.0)
    for o in out:
        assert o is not None and "did not form within 1 s" in o and "node 0 (10.0.0.1)" in o, out
        assert "node 1 (10.0.0.2) arrived" in o and "node rank(s) 2 did not" in o, out


def test_judge_names_a_node_rank_not_below_nnodes() -> None:
    line, missing = judge([{**_verdict(0), "claim": 1}, {**_verdict(2), "claim": 1}], 2, 0)
    assert line is not None and "--node-rank 2 is not below --nnodes 2" in line and missing == [1], line


def test_node_zero_stays_up_with_its_refusal_until_a_late_host_has_read_it() -> None:
    """agree() end to end on 127.0.0.1: node 0 refuses at once and must not take the store down with it before
    node 1, launched 2 s later, has read why."""
    import argparse
    import time

    from nanotron_ext.launch_hosts import agree

    port, notes, out, ended = _free_port(), [], {}, {}

    def host(node: int, refusal: Optional[str]) -> None:
        args = argparse.Namespace(nnodes="2", node_rank=node, rdzv_backend="static", master_addr="127.0.0.1",
                                  master_port=port, rdzv_conf="timeout=20")
        out[node] = agree(args, refusal, note=lambda *a, **k: notes.append(a[0]))
        ended[node] = time.monotonic()

    first = threading.Thread(target=host, args=(0, "error: data.prepared_dir /x does not exist"))
    first.start()
    time.sleep(2.0)
    host(1, None)
    first.join(timeout=30)
    assert not first.is_alive()
    assert out[0].line == out[1].line == "error: node 0 (127.0.0.1): data.prepared_dir /x does not exist", out
    assert out[0].code == out[1].code == 2 and out[0].printed and not out[1].printed
    assert ended[0] >= ended[1] - 1.0, ended  # node 0 returned only once node 1 had read it
