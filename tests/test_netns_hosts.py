"""nanotron_ext.bench.netns_hosts: hosts on one machine (network namespaces on a bridge, shaped links, a disk each).

Real namespaces, real TCP: skipped with available()'s reason where they cannot be made (not root, no iproute2), and
the delay test where the kernel has no netem. Every test checks something that breaks when the module does: hosts
that cannot reach each other, a disk shared between hosts, a rate or a delay not applied (or applied twice), a cable
that does not cut, a namespace or a process left behind, the CLI's prefixes and exit code."""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

from nanotron_ext.bench.netns_hosts import Hosts, HostsUnavailable, available

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PORT = "29555"

# One small program for every probe, run on a host: `mesh`, `recv`, `send`, `echo`, `ping`, `connect`.
PROBE = r'''
import json, os, socket, sys, threading, time

def connect(addr, port, wait_s=15.0, timeout=5.0):
    deadline = time.monotonic() + wait_s
    while True:  # the peer's server may not listen yet: refused until it does
        try:
            return socket.create_connection((addr, port), timeout=timeout)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

def mesh(addrs, port):  # serve every other host once, and reach every other host once
    me = int(os.environ["HOST_INDEX"])
    addrs = addrs.split(","); port = int(port)
    srv = socket.create_server((addrs[me], port)); srv.settimeout(20)
    heard = []
    def serve():
        for _ in range(len(addrs) - 1):
            c, _ = srv.accept()
            with c:
                heard.append(int(c.recv(16))); c.sendall(str(me).encode())
    t = threading.Thread(target=serve); t.start()
    replies = {}
    for j, a in enumerate(addrs):
        if j != me:
            with connect(a, port) as c:
                c.sendall(str(me).encode()); replies[j] = int(c.recv(16))
    t.join()
    print(json.dumps({"me": me, "replies": replies, "heard": sorted(heard)}))

def recv(port, n):  # accept n senders, start them together; the first byte's and the last EOF's clock times
    srv = socket.create_server(("0.0.0.0", int(port))); srv.settimeout(20)
    conns = [srv.accept()[0] for _ in range(int(n))]
    marks = {"first": None, "last": 0.0, "bytes": 0}
    lock = threading.Lock()
    def drain(c):
        while True:
            b = c.recv(1 << 16)
            now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
            with lock:
                if not b:
                    marks["last"] = max(marks["last"], now); break
                marks["first"] = marks["first"] or now; marks["bytes"] += len(b)
        c.close()
    ts = [threading.Thread(target=drain, args=(c,)) for c in conns]
    for c in conns:
        c.sendall(b"g")  # go: its senders start within a millisecond (an incast, not one after the other)
    for t in ts: t.start()
    for t in ts: t.join()
    print(json.dumps(marks))

def send(addrs, port, nbytes):  # to every address at once, once every receiver said go
    conns = [connect(a, int(port)) for a in addrs.split(",")]
    assert all(c.recv(1) == b"g" for c in conns)
    def push(c):
        left, chunk = int(nbytes), b"\0" * (1 << 16)
        while left > 0:
            c.sendall(chunk[:left]); left -= min(left, len(chunk))
        c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
    ts = [threading.Thread(target=push, args=(c,)) for c in conns]
    for t in ts: t.start()
    for t in ts: t.join()

def echo(port):
    srv = socket.create_server(("0.0.0.0", int(port)))
    while True:
        c, _ = srv.accept()
        with c:
            while (b := c.recv(64)):
                c.sendall(b)

def ping(addr, port, rounds):  # the connect (SYN, SYN-ACK) and byte-sized round trips
    t0 = time.monotonic(); c = connect(addr, int(port)); connect_s = time.monotonic() - t0
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(rounds)):
        t0 = time.monotonic(); c.sendall(b"x"); c.recv(1); rtts.append(time.monotonic() - t0)
    print(json.dumps({"connect_s": connect_s, "rtts": rtts}))

def try_connect(addr, port, wait_s):  # one outcome: ok, or the error and how long it took
    t0 = time.monotonic()
    try:
        connect(addr, int(port), wait_s=float(wait_s), timeout=2.0).close(); out = {"ok": True}
    except OSError as e:
        out = {"ok": False, "error": repr(e)}
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out))

COMMANDS = {"mesh": mesh, "recv": recv, "send": send, "echo": echo, "ping": ping, "connect": try_connect}
COMMANDS[sys.argv[1]](*sys.argv[2:])
'''


@pytest.fixture
def netns() -> None:
    reason = available()
    if reason is not None:
        pytest.skip(f"network namespaces cannot be made here: {reason}")


@pytest.fixture
def hosts(netns: None, tmp_path: Path) -> Iterator[Callable[..., Hosts]]:
    """hosts(n, **Hosts kwargs): started Hosts (disk_root under tmp_path by default), all closed at the end."""
    made: List[Hosts] = []

    def make(n: int, **kwargs: Any) -> Hosts:
        kwargs.setdefault("disk_root", tmp_path / "disks")
        h = Hosts(n, **kwargs).start()
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def probe(tmp_path: Path) -> List[str]:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return [PY, str(path)]


def _json(done: subprocess.CompletedProcess) -> Dict[str, Any]:
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _netns_names() -> set:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie no one reaps (pid 1 of a container) is gone too


def _gone(names: List[str], pids: List[int], within_s: float) -> List[str]:
    """What is still there after `within_s`: namespaces of `names`, live `pids`."""
    deadline = time.monotonic() + within_s
    while True:
        left = sorted(set(names) & _netns_names()) + [f"pid {p}" for p in pids if _alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# -- (a) reach and disks ------------------------------------------------------------------------------------------
def test_three_hosts_reach_each_other_and_each_has_its_own_disk(hosts: Callable[..., Hosts], probe: List[str],
                                                                tmp_path: Path) -> None:
    at = tmp_path / "ckpt"
    h = hosts(3, disk_at=at)
    assert [h.addr(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    addrs = ",".join(h.addr(i) for i in range(3))
    procs = [h.popen(i, [*probe, "mesh", addrs, PORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, (i, err)
        got = json.loads(out)
        others = [j for j in range(3) if j != i]
        assert got["replies"] == {str(j): j for j in others} and got["heard"] == others, got

    # the same path is a different disk per host: host 1 does not see what host 0 wrote there, and each sees its own
    marker = at / "who"
    assert h.run(0, ["sh", "-c", f"echo host0 > {marker}"], timeout=10).returncode == 0
    seen = h.run(1, ["sh", "-c", f"test ! -e {marker} && echo host1 > {marker} && cat {marker}"], timeout=10,
                 capture_output=True, text=True)
    assert seen.returncode == 0 and seen.stdout == "host1\n", (seen.stdout, seen.stderr)
    back = h.run(0, ["cat", str(marker)], timeout=10, capture_output=True, text=True)
    assert back.stdout == "host0\n", back
    assert (h.disk(0) / "who").read_text() == "host0\n" and (h.disk(1) / "who").read_text() == "host1\n"
    assert not (h.disk(2) / "who").exists() and list(at.iterdir()) == []  # nothing reached the machine's own view
    env = h.run(2, [PY, "-c", "import os; print(os.environ['HOST_INDEX'], os.environ['GLOO_SOCKET_IFNAME'])"],
                timeout=10, capture_output=True, text=True, env={"EXTRA": "1"})
    assert env.stdout.split() == ["2", h.ifname(2)]
    links = h.run(2, ["ip", "-o", "-4", "addr", "show", "dev", h.ifname(2)], timeout=10, capture_output=True,
                  text=True)
    assert "10.77.0.3/24" in links.stdout, links.stdout
    h.close()
    assert not at.exists()  # the mount point it made is removed again


# -- (b) shaping --------------------------------------------------------------------------------------------------
def _throughput_mbit(h: Hosts, probe: List[str], flows: List[Tuple[int, int]], nbytes: int) -> float:
    """Mbit/s of `flows` (sender, receiver) run at once, nbytes each: all bytes over first byte to last EOF."""
    receivers = sorted({r for _, r in flows})
    recvs = [h.popen(r, [*probe, "recv", PORT, str(sum(1 for _, to in flows if to == r))], stdout=subprocess.PIPE,
                     text=True) for r in receivers]
    sends = [h.popen(s, [*probe, "send", ",".join(h.addr(r) for f, r in flows if f == s), PORT, str(nbytes)])
             for s in sorted({s for s, _ in flows})]
    marks = [json.loads(p.communicate(timeout=30)[0]) for p in recvs]
    assert all(p.returncode == 0 for p in recvs) and all(s.wait(timeout=30) == 0 for s in sends)
    total = sum(m["bytes"] for m in marks)
    assert total == nbytes * len(flows), marks
    return total * 8 / (max(m["last"] for m in marks) - min(m["first"] for m in marks)) / 1e6


def test_rate_shapes_each_uplink_and_each_downlink(hosts: Callable[..., Hosts], probe: List[str]) -> None:
    h = hosts(3, rate="40mbit")
    one = _throughput_mbit(h, probe, [(1, 0)], 4_000_000)
    assert 0.6 * 40 <= one <= 1.15 * 40, f"host 1 -> host 0: {one:.1f} Mbit/s on a 40mbit link"
    # two hosts sending to one share its downlink (its switch port): together still 40, not 2 x 40
    incast = _throughput_mbit(h, probe, [(1, 0), (2, 0)], 2_000_000)
    assert 0.6 * 40 <= incast <= 1.15 * 40, f"hosts 1 and 2 -> host 0: {incast:.1f} Mbit/s into a 40mbit link"
    # one host sending to two shares its uplink
    fanout = _throughput_mbit(h, probe, [(1, 0), (1, 2)], 2_000_000)
    assert 0.6 * 40 <= fanout <= 1.15 * 40, f"host 1 -> hosts 0 and 2: {fanout:.1f} Mbit/s out of a 40mbit link"


def test_the_bucket_passes_a_burst_at_once_then_the_rate_holds(hosts: Callable[..., Hosts]) -> None:
    """The link model of the clock's tbf variant (bench/netns_hosts/probe.py, one message after an idle spell): a
    message of half the bucket arrives far sooner than a plain pipe's n / R; one of three buckets takes at least
    (n - b) / R, the rate holding once the bucket is spent."""
    from nanotron_ext.bench.netns_hosts.links import tbf_burst_bytes

    h = hosts(2, rate="2mbit")
    rate, burst = 2e6 / 8, tbf_burst_bytes(2e6)
    small, large = burst // 2, 3 * burst
    probe = [PY, "-m", "nanotron_ext.bench.netns_hosts.probe"]
    server = h.popen(1, [*probe, "--serve"], cwd=REPO)
    try:
        done = h.run(0, [*probe, "--send-to", h.addr(1), "--bytes", f"{small},{large}"], timeout=120,
                     capture_output=True, text=True, cwd=REPO)
    finally:
        server.kill()
        server.wait()
    assert done.returncode == 0, done.stderr
    got = {r["bytes"]: r["median_s"] for r in map(json.loads, done.stdout.splitlines())}
    assert got[small] < 0.5 * small / rate, f"{small} B took {got[small]:.3f} s; a plain pipe: {small / rate:.3f} s"
    assert got[large] >= 0.9 * (large - burst) / rate, f"{large} B took {got[large]:.3f} s"


def test_delay_makes_the_round_trip(hosts: Callable[..., Hosts], probe: List[str]) -> None:
    reason = available(netem=True)
    if reason is not None:
        pytest.skip(reason)
    h = hosts(2, delay="50ms")
    rtt = 2 * 0.050  # the sender's uplink delays each way (module docstring)
    server = h.popen(0, [*probe, "echo", PORT])
    got = _json(h.run(1, [*probe, "ping", h.addr(0), PORT, "5"], timeout=30, capture_output=True, text=True))
    server.kill()
    assert got["connect_s"] >= 0.95 * rtt, got  # SYN out, SYN-ACK back
    median = statistics.median(got["rtts"])
    assert 0.95 * rtt <= median <= 1.5 * rtt + 0.02, got  # not missing, not applied on both sides of the link


def test_delay_without_netem_is_refused_before_anything_is_made(netns: None, tmp_path: Path) -> None:
    if available(netem=True) is None:
        pytest.skip("this kernel has netem: the delay is applied (test_delay_makes_the_round_trip)")
    before = _netns_names()
    with pytest.raises(HostsUnavailable, match="netem"):
        Hosts(2, delay="10ms", disk_root=tmp_path / "disks").start()
    assert _netns_names() == before


# -- (c) a cut cable ----------------------------------------------------------------------------------------------
def test_set_link_cuts_and_restores_the_cable(hosts: Callable[..., Hosts], probe: List[str]) -> None:
    h = hosts(2)
    h.popen(0, [*probe, "echo", PORT])

    def connect(wait_s: float) -> Dict[str, Any]:
        return _json(h.run(1, [*probe, "connect", h.addr(0), PORT, str(wait_s)], timeout=20, capture_output=True,
                           text=True))

    assert connect(10)["ok"]
    h.set_link(1, False)
    cut = connect(0)
    assert not cut["ok"] and cut["seconds"] < 3.0, cut
    h.set_link(1, True)
    assert connect(5)["ok"]


# -- (d) clean-up -------------------------------------------------------------------------------------------------
def _start_sleepers(h: Hosts) -> List[int]:
    pids = [h.popen(i, ["sleep", "1000"]).pid for i in range(h.n)]
    # one that leaves its process group (a daemon): found by the namespace's pids, not by killpg
    out = h.run(0, ["sh", "-c", "setsid sleep 1001 >/dev/null 2>&1 & echo $!"], timeout=10, capture_output=True,
                text=True).stdout
    return pids + [int(out)]


@pytest.mark.parametrize("fail", [False, True], ids=["exit", "exception"])
def test_the_context_leaves_no_namespace_and_no_process(netns: None, tmp_path: Path, fail: bool) -> None:
    class Boom(Exception):
        pass

    names: List[str] = []
    pids: List[int] = []
    try:
        with Hosts(2, rate="100mbit", disk_root=tmp_path / "disks", disk_at=tmp_path / "at") as h:
            names = h.namespaces
            assert set(names) <= _netns_names() and len(names) == 3
            pids = _start_sleepers(h)
            assert all(_alive(p) for p in pids)
            if fail:
                raise Boom()
    except Boom:
        assert fail
    assert _gone(names, pids, within_s=3.0) == []
    h.close()  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        h.popen(0, ["true"])
    assert not (tmp_path / "at").exists()


KILLED = r'''
import json, signal, subprocess, sys, time
from pathlib import Path
from nanotron_ext.bench.netns_hosts import Hosts
# Ctrl-C as an interactive owner takes it (a suite started in the background inherits SIGINT ignored), or ignored
signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[2:] == ["ignore-int"] else signal.default_int_handler)
with Hosts(2, disk_root=Path(sys.argv[1])) as h:
    pids = [h.popen(i, ["sleep", "1000"], stdout=subprocess.DEVNULL).pid for i in range(2)]
    print(json.dumps({"names": h.namespaces, "pids": pids}), flush=True)
    time.sleep(60)
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["term", "int", "kill"])
def test_a_killed_owner_leaves_no_namespace_and_no_process(netns: None, tmp_path: Path, sig: int) -> None:
    owner = subprocess.Popen([PY, "-c", KILLED, str(tmp_path / "disks")], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(owner.stdout.readline() or "null")
        assert started, owner.communicate(timeout=10)
        owner.send_signal(sig)
        owner.wait(timeout=10)
    finally:
        owner.kill()
        owner.communicate(timeout=10)
    # TERM and INT: cleaned up by the handlers before the signal's default (death by it), so gone when it is gone;
    # KILL: by the watchdog, which sees the owner's pipe close
    assert owner.returncode == -sig, owner.returncode
    assert _gone(started["names"], started["pids"], within_s=5.0 if sig == signal.SIGKILL else 0.0) == [], sig


def test_an_owner_that_ignores_ctrl_c_keeps_its_hosts_through_it(netns: None, tmp_path: Path) -> None:
    owner = subprocess.Popen([PY, "-c", KILLED, str(tmp_path / "disks"), "ignore-int"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(owner.stdout.readline() or "null")
        assert started, owner.communicate(timeout=10)
        owner.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert owner.poll() is None and set(started["names"]) <= _netns_names()
        owner.send_signal(signal.SIGTERM)
        owner.wait(timeout=60)
    finally:
        owner.kill()
        owner.communicate(timeout=10)
    assert owner.returncode == -signal.SIGTERM and _gone(started["names"], started["pids"], within_s=0.0) == []


# -- (e) the command line -----------------------------------------------------------------------------------------
def _cli(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "nanotron_ext.bench.netns_hosts", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_the_cli_prefixes_each_host_and_returns_the_first_failure(netns: None, tmp_path: Path) -> None:
    before = _netns_names()
    disks = str(tmp_path / "disks")
    ok = _cli(tmp_path, "--hosts", "2", "--disk-root", disks, "--",
              PY, "-c", "import os, sys; print(os.environ['HOST_INDEX'], sys.argv[1])", "{addr0}")
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.splitlines()) == ["[host0] 0 10.77.0.1", "[host1] 1 10.77.0.1"], ok.stdout

    t0 = time.monotonic()  # host 1 fails at once; host 0 would sleep 30 s: it is stopped instead
    bad = _cli(tmp_path, "--hosts", "2", "--disk-root", disks, "--",
               "sh", "-c", "if [ {host} = 1 ]; then echo bye >&2; exit 3; fi; sleep 30")
    assert bad.returncode == 3, (bad.returncode, bad.stderr)
    assert time.monotonic() - t0 < 20
    assert "[host1] bye" in bad.stderr.splitlines() and "host1 failed (exit 3)" in bad.stderr, bad.stderr

    refused = _cli(tmp_path, "--hosts", "0", "--disk-root", disks, "--", "true")
    assert refused.returncode == 2 and refused.stderr.startswith("error: --hosts 0") \
        and refused.stderr.count("\n") == 1, refused.stderr
    assert _netns_names() - before == set()
    assert sorted(p.name for p in (tmp_path / "disks").iterdir()) == ["host0", "host1"]
    assert os.listdir(tmp_path / "disks" / "host0") == []


def test_relative_paths_under_disk_at_land_on_each_hosts_own_disk(netns: None, tmp_path: Path) -> None:
    """Run from inside --disk-at, a command's relative paths are on its host's disk (they went to the machine's real
    folder there, shared by every host)."""
    disk_at, disks = tmp_path / "disk", tmp_path / "disks"
    disk_at.mkdir()
    done = subprocess.run([PY, "-m", "nanotron_ext.bench.netns_hosts", "--hosts", "2", "--disk-root", str(disks),
                           "--disk-at", str(disk_at), "--", "sh", "-c", "echo {host} > mine.txt"], cwd=disk_at,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert [(disks / f"host{i}" / "mine.txt").read_text() for i in range(2)] == ["0\n", "1\n"]
    assert not (disk_at / "mine.txt").exists()


@pytest.mark.parametrize("flags, named", [
    (["--disk-at", "/"], "--disk-at /"),  # bound over the root, it changed nothing: every host wrote the real disk
    (["--rate", "1bit"], "--rate 1bit"),  # tc takes whole bytes per second: it printed its usage, exit 1
    (["--rate", "10tbit"], "--rate 10tbit"),  # tbf's bucket (4 ms at that rate) past tc's 32-bit burst
])
def test_what_the_hosts_cannot_take_is_refused_at_the_flag(netns: None, tmp_path: Path, flags: List[str],
                                                           named: str) -> None:
    done = _cli(tmp_path, "--hosts", "2", "--disk-root", str(tmp_path / "disks"), *flags, "--", "true")
    assert done.returncode == 2 and done.stderr.startswith(f"error: {named}:") and done.stderr.count("\n") == 1, \
        (done.returncode, done.stderr)
