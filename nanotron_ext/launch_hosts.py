"""A launch over several hosts (a static rendezvous: --nnodes N, --master-addr, --master-port) that agrees before
anything waits: every host's launcher hands its pre-flight verdict (ok, or its one refusal line) to the others, so
a refusal on one host is printed by every host within seconds, and a rendezvous that cannot form is named.

How (`agree`): node 0 hosts torch's own c10d TCPStore at --master-addr:--master-port (`multi_tenant`, so the
static rendezvous torchrun then opens in the same process reuses this very server: no second port); every other
node waits until it answers (`wait_for_rendezvous`) and joins it as a client. Each host posts its verdict
({node, nnodes, addr, refusal}), then reads everyone's until all N are in (start the workers) or one says no:

- a host's refusal (config, data, output folders: what `nanotron_ext.train.preflight` checks) -> every host prints
  `error: node I (ADDR): <its line>`, exit 2;
- two hosts given the same --node-rank, a node rank >= --nnodes, or --nnodes different between hosts -> named the
  same way on every host, exit 2;
- not all N within the rendezvous timeout (--rdzv-conf timeout=S; 600 s, torch's default) -> refused naming the
  node ranks that arrived (with their addresses) and those that did not; a note after 30 s says who is awaited.

Node 0 holds the store: after a refusal it stays up until every other host has read it (at most the same
bound), so a host launched a little later still learns why. Before the store exists: node 0 on a host that
--master-addr is not an address of is refused at once (`rendezvous_refusal`: it cannot host); another node waits
for node 0's store for the rendezvous timeout (30 s when --master-addr is its own host's, where node 0 would be:
node ranks swapped), then is refused naming --node-rank and --master-addr.
"""
from __future__ import annotations

import errno
import json
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

RDZV_TIMEOUT_S = 600  # torch's static rendezvous's default (--rdzv-conf timeout=S)
OWN_ADDRESS_WAIT_S = 30  # a node > 0 whose --master-addr is its own host's: node 0 should be right there
NOTE_AFTER_S = 30  # a host still waiting says for what, once
POLL_S = 0.25
STORE_OP_S = 30  # one store operation (connect, get), not the wait for the other hosts
PREFIX = "nanotron_ext/launch/"  # our keys, apart from torch's run-id-prefixed rendezvous keys in the same store


def node_range(args: object) -> Tuple[int, int]:
    lo, _, hi = str(getattr(args, "nnodes", "1")).partition(":")
    return int(lo), int(hi or lo)


def rendezvous(args: object) -> Optional[Tuple[str, int, str]]:
    """(host, port, the flags that name them) of a static rendezvous over several nodes, else None."""
    if getattr(args, "standalone", False) or getattr(args, "rdzv_backend", "static") != "static" \
            or node_range(args)[1] < 2:
        return None
    endpoint = getattr(args, "rdzv_endpoint", "") or ""
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        return (host, int(port), f"--rdzv-endpoint {endpoint}") if port.isdigit() and host else None
    if getattr(args, "master_addr", None) is None or getattr(args, "master_port", None) is None:
        return None  # (torch picks them itself)
    host, port = str(args.master_addr), int(args.master_port)
    return host, port, f"--master-addr {host} --master-port {port}"


def rdzv_timeout_s(args: object) -> float:
    for item in str(getattr(args, "rdzv_conf", "") or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "timeout":
            try:
                return max(0.0, float(value))
            except ValueError:
                break
    return float(RDZV_TIMEOUT_S)


def is_own_address(host: str) -> bool:
    """Whether `host` is an address of this machine (a socket can be bound to it)."""
    for family, kind, proto, _, addr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((addr[0], 0))
                return True
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
    return False


def rendezvous_refusal(args: object) -> Optional[str]:
    """Node 0 hosts a static rendezvous at --master-addr: refused at once on a host that address is not of."""
    rdzv = rendezvous(args)
    if rdzv is None or int(getattr(args, "node_rank", 0)) != 0:
        return None
    host, _, named = rdzv
    try:
        own = is_own_address(host)
    except OSError as e:
        return f"{named.split(' --')[0]}: cannot be resolved or bound here ({e}): give node 0's address"
    if not own:
        return (f"--node-rank 0 hosts the rendezvous, but {named.split(' --')[0]} is not an address of this host: "
                f"launch --node-rank 0 on the host at {host}, or give this host's address (were the node ranks "
                "swapped?)")
    return None


def wait_for_rendezvous(args: object, note: Callable[..., Any] = print, why: str = "") -> Optional[str]:
    """A node > 0 of a static rendezvous: wait until node 0's store answers at --master-addr; the refusal when it
    did not within the bound (module doc), else None. `why`: what this host waits to hand over (its refusal)."""
    rdzv = rendezvous(args)
    node = int(getattr(args, "node_rank", 0))
    if rdzv is None or node == 0:
        return None
    host, port, named = rdzv
    try:
        own = is_own_address(host)
    except OSError:
        own = False  # not resolvable: torch says so itself when it tries
    bound = min(OWN_ADDRESS_WAIT_S, rdzv_timeout_s(args)) if own else rdzv_timeout_s(args)
    start = time.monotonic()
    noted = False
    while True:
        left = bound - (time.monotonic() - start)
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return None
        except OSError:
            pass
        if time.monotonic() - start >= bound:
            break
        if not noted and time.monotonic() - start >= NOTE_AFTER_S:
            note(f"note: --node-rank {node} is waiting for node 0's rendezvous at {named}{why}; nothing answers "
                 f"there yet (at most {bound - (time.monotonic() - start):.0f} s more)", file=sys.stderr, flush=True)
            noted = True
        time.sleep(0.5)
    if own:
        return (f"--node-rank {node}: nothing answered at {named} for {bound:g} s, and that is an address of this "
                "host: node 0 hosts the rendezvous, so --master-addr must be the address of the host launched with "
                "--node-rank 0 (were the node ranks swapped?)")
    return (f"--node-rank {node}: no rendezvous answered at {named} within {bound:g} s (the rendezvous timeout, "
            "--rdzv-conf timeout=S): launch --node-rank 0 on that host, or give that host's address")


def _label(v: Dict[str, Any]) -> str:
    return f"node {v['node']} ({v['addr']})"


def judge(verdicts: List[Dict[str, Any]], nnodes: int, node: int) -> Tuple[Optional[str], List[int]]:
    """(the refusal every host prints, or None; the node ranks still missing) from the verdicts posted so far, in
    the order they arrived ({"node", "claim": 1 for the first host with that node rank, "nnodes", "addr",
    "refusal"}), as node `node`, given `--nnodes nnodes`, sees them."""
    lines = []
    for v in verdicts:
        if v["nnodes"] != nnodes:
            lines.append(f"--nnodes differs between hosts: {_label(v)} was given {v['nnodes']}, node {node} "
                         f"{nnodes}; give every host the same --nnodes")
        elif not 0 <= v["node"] < nnodes:
            lines.append(f"{_label(v)}: --node-rank {v['node']} is not below --nnodes {nnodes}; give each host its "
                         f"own node rank, 0 to {nnodes - 1}")
        elif v["claim"] > 1:
            first = next(u for u in verdicts if u["node"] == v["node"] and u["claim"] == 1)
            lines.append(f"--node-rank {v['node']} was given to two hosts ({first['addr']} and {v['addr']}): give "
                         f"each host its own node rank, 0 to {nnodes - 1}")
        elif v["refusal"]:
            lines.append(f"{_label(v)}: {v['refusal'].removeprefix('error: ')}")
    missing = sorted(set(range(nnodes)) - {v["node"] for v in verdicts})
    return ("; ".join(dict.fromkeys(lines)) or None), missing


@dataclass
class Outcome:
    """How the agreement ended: `line` (None: every host is ready) with exit `code`, and the store to keep open
    until torchrun's rendezvous has reused it (node 0's server)."""

    line: Optional[str]
    code: int = 2
    store: Any = None
    printed: bool = False


def _outbound_addr(host: str, port: int) -> str:
    """This host's address on the route to node 0 (what the others know it by)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def open_store(host: str, port: int, node: int) -> Any:
    """Node 0: torch's TCPStore server (multi-tenant: torchrun's static rendezvous reuses it); another node: a
    client of it. No world size: torchrun's own rendezvous still counts its nodes in."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, node == 0, timedelta(seconds=STORE_OP_S), wait_for_workers=False,
                    multi_tenant=True)


def _read(store: Any, seen: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Every verdict posted so far, in the order of arrival (new ones fetched, the others from `seen`)."""
    if not store.check([PREFIX + "arrivals"]):
        return []
    for entry in store.get(PREFIX + "arrivals").decode().split():
        if entry not in seen:
            seen[entry] = json.loads(store.get(PREFIX + "verdict/" + entry))
    return list(seen.values())


def exchange(store: Any, mine: Dict[str, Any], nnodes: int, bound_s: float, named: str,
             note: Callable[..., Any] = print) -> Optional[str]:
    """Post this host's verdict `mine` ({"node", "nnodes", "addr", "refusal"}) and read everyone's until all
    `nnodes` are in (None) or one refuses, or `bound_s` passed (the refusal line either way, without "error: ")."""
    node = mine["node"]
    claim = store.add(f"{PREFIX}claims/{node}", 1)
    store.set(f"{PREFIX}verdict/{node}.{claim}", json.dumps({**mine, "claim": claim}))
    store.append(PREFIX + "arrivals", f"{node}.{claim} ")  # after the verdict: whoever reads this finds it
    start, seen, noted = time.monotonic(), {}, False
    while True:
        line, missing = judge(_read(store, seen), nnodes, node)
        if line or not missing:
            return line
        waited = time.monotonic() - start
        if waited >= bound_s:
            arrived = ", ".join(_label(v) for v in seen.values())
            return (f"the launch over {nnodes} hosts did not form within {bound_s:g} s (the rendezvous timeout, "
                    f"--rdzv-conf timeout=S): {arrived} arrived at {named}, node rank(s) "
                    f"{', '.join(map(str, missing))} did not; launch them with --nnodes {nnodes} and the same "
                    "--master-addr / --master-port")
        if not noted and waited >= NOTE_AFTER_S:
            note(f"note: node {node} is waiting for node rank(s) {', '.join(map(str, missing))} at {named} (at most "
                 f"{bound_s - waited:.0f} s more)", file=sys.stderr, flush=True)
            noted = True
        time.sleep(POLL_S)


def hand_over(store: Any, nnodes: int, bound_s: float, line: str, note: Callable[..., Any] = print) -> None:
    """Node 0 after a refusal: keep the store up until the other hosts have read it (at most `bound_s`)."""
    start, noted = time.monotonic(), False
    while store.add(PREFIX + "read", 0) < nnodes - 1 and time.monotonic() - start < bound_s:
        if not noted and time.monotonic() - start >= 2.0:
            note(f"note: node 0 stays up to hand this refusal to the hosts that have not read it yet (at most "
                 f"{bound_s - (time.monotonic() - start):.0f} s; Ctrl-C ends it)", file=sys.stderr, flush=True)
            noted = True
        time.sleep(POLL_S)
    if noted:  # the refusal stays the last line
        note(line, file=sys.stderr, flush=True)


def agree(args: object, refusal: Optional[str], note: Callable[..., Any] = print) -> Outcome:
    """The agreement of the module doc for this host, whose own pre-flight gave `refusal` (its one line with
    "error: ", or None). Node 0 prints an agreed refusal itself before it stays up to hand it over (`printed`)."""
    host, port, named = rendezvous(args)
    node, nnodes, bound = int(getattr(args, "node_rank", 0)), node_range(args)[1], rdzv_timeout_s(args)
    if node > 0:
        waited = wait_for_rendezvous(args, note, why=" to hand it this host's refusal" if refusal else "")
        if waited:
            return Outcome(f"{refusal}; not handed to the other hosts: {waited}" if refusal else f"error: {waited}")
    try:
        store = open_store(host, port, node)
    except RuntimeError as e:  # DistNetworkError: the port is taken (another job, or node 0 launched twice)
        return Outcome(f"error: {named}: node {node} cannot {'host' if node == 0 else 'join'} the rendezvous there "
                       f"({str(e).splitlines()[0]}): is another job (or a second --node-rank 0) using that port?")
    mine = {"node": node, "nnodes": nnodes, "addr": _outbound_addr(host, port), "refusal": refusal}
    try:
        line = exchange(store, mine, nnodes, bound, named, note)
        if line is None:
            return Outcome(None, 0, store)
        line = f"error: {line}"
        if node > 0:
            store.add(PREFIX + "read", 1)
            return Outcome(line)
        note(line, file=sys.stderr, flush=True)
        hand_over(store, nnodes, bound, line, note)
        return Outcome(line, printed=True)
    except RuntimeError as e:  # node 0's store went away (its launcher stopped) while this host read it
        return Outcome(f"error: node {node}: the rendezvous at {named} went away before every host's verdict was in "
                       f"({str(e).splitlines()[0]}): was node 0's launcher stopped?", 1)
