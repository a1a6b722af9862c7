"""Hosts on one machine: the Hosts context manager (the package docstring has the topology, shaping and clean-up)."""
from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Dict, List, Mapping, Optional, Sequence

from nanotron_ext.bench.netns_hosts.links import (
    MAX_HOSTS,
    MOUNT_SH,
    NETEM_LIMIT,
    SUBNET,
    TBF_LATENCY,
    WATCHDOG_SH,
    HostsError,
    HostsUnavailable,
    available,
    delay_seconds,
    loss_percent,
    quiet_run,
    rate_bits_per_s,
    tbf_burst_bytes,
)

# a bind mount over / is not seen by a process whose root is the old / (every command): the hosts would share it
ROOT_REFUSAL = "the root folder cannot be a host's disk (a command would still write the machine's own); give a folder"


# -- the hosts ------------------------------------------------------------------------------------------------------
class Hosts:
    """N hosts on this machine (network namespaces on a bridge, shaped links, a disk each): a context manager.
    See the package docstring for the topology, the shaping and the clean-up guarantees."""

    def __init__(self, n: int, *, rate: Optional[str] = None, delay: Optional[str] = None,
                 loss: Optional[str] = None, disk_root: Path, disk_at: Optional[Path] = None) -> None:
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n={n}: must be in [1, {MAX_HOSTS}] (one /24)")
        # checked here, before anything is made: a bad value would otherwise fail half-way through the set-up
        self.rate_bits_per_s = rate_bits_per_s(rate) if rate else None
        self.delay_s = delay_seconds(delay) if delay else 0.0
        self.loss_percent = loss_percent(loss) if loss else 0.0
        self.n, self.rate, self.delay, self.loss = n, rate, delay, loss
        self.disk_root = Path(disk_root).resolve()
        self.disk_at = Path(disk_at).resolve() if disk_at is not None else None
        if self.disk_at == Path("/"):
            raise ValueError(f"disk_at={disk_at}: {ROOT_REFUSAL}")
        self.id = secrets.token_hex(3)
        self.switch_namespace = f"sw-{self.id}"
        self._made: List[str] = []  # namespaces that exist because of this object (deleted at clean-up)
        self._procs: List[List[subprocess.Popen]] = [[] for _ in range(n)]
        self._created_dirs: List[Path] = []  # disk_at and the parents this object made, deepest first
        self._watchdog: Optional[subprocess.Popen] = None
        self._previous: Dict[int, Any] = {}
        self._pending: Optional[int] = None  # a signal that came during clean-up, delivered after it
        self._lock = threading.RLock()  # re-entrant: the signal handler may close() inside close()
        self._started = self._closed = self._done = False  # started; close() begun; close() finished

    # -- names ---------------------------------------------------------------------------------------------------
    def namespace(self, i: int) -> str:
        """Host i's network namespace (`ip netns exec` it to look around)."""
        return f"h{self._index(i)}-{self.id}"

    @property
    def namespaces(self) -> List[str]:
        """Every namespace this object makes: the hosts', then the switch's."""
        return [self.namespace(i) for i in range(self.n)] + [self.switch_namespace]

    def addr(self, i: int) -> str:
        """Host i's IPv4 address, 10.77.0.<i+1>."""
        return f"{SUBNET}.{self._index(i) + 1}"

    def ifname(self, i: int) -> str:
        """Host i's veth, inside its namespace (its only interface besides lo)."""
        return f"v{self._index(i)}h{self.id}"

    def _switch_port(self, i: int) -> str:
        return f"v{i}s{self.id}"

    def disk(self, i: int) -> Path:
        """Host i's local disk: disk_root/host<i> (seen at disk_at by its commands when disk_at is given)."""
        return self.disk_root / f"host{self._index(i)}"

    def env(self, i: int) -> Dict[str, str]:
        """The variables every command on host i gets (before the caller's own)."""
        return {"HOST_INDEX": str(i), "HOST_ADDR": self.addr(i), "HOST_COUNT": str(self.n),
                "HOST0_ADDR": self.addr(0), "GLOO_SOCKET_IFNAME": self.ifname(i)}

    def _index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i}: there are hosts 0..{self.n - 1}")
        return i

    # -- life -------------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> "Hosts":
        """Make the switch, the hosts, their links and disks. On any failure, clean up and raise."""
        if self._started:
            raise RuntimeError("Hosts already started (one object, one set of hosts)")
        self._started = True
        reason = available(netem=bool(self.delay or self.loss))
        if reason is not None:
            self._closed = True
            raise HostsUnavailable(reason)
        self._install_handlers()  # before anything exists: a signal during set-up cleans up what is there so far
        atexit.register(self.close)
        try:
            self._start_watchdog()
            self._make_disks()
            self._make_network()
        except BaseException:
            self.close()
            raise
        return self

    def _start_watchdog(self) -> None:
        # its own session: a Ctrl-C to the terminal's process group does not kill it before it cleans up. The pipe's
        # write end is non-inheritable (PEP 446), so only this process holds it: it closes when this process dies.
        self._watchdog = subprocess.Popen(["sh", "-c", WATCHDOG_SH, "netns-hosts-watchdog", *self.namespaces],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)

    def _make_disks(self) -> None:
        for i in range(self.n):
            self.disk(i).mkdir(parents=True, exist_ok=True)
        if self.disk_at is not None:
            missing = [p for p in (self.disk_at, *self.disk_at.parents) if not p.exists()]
            self.disk_at.mkdir(parents=True, exist_ok=True)
            self._created_dirs = missing  # deepest first: removed in this order when still empty

    def _make_network(self) -> None:
        sw = self.switch_namespace
        self._netns_add(sw)
        self._ip("-n", sw, "link", "add", "br0", "type", "bridge")  # STP off (the default): ports forward at once
        self._ip("-n", sw, "link", "set", "br0", "addrgenmode", "none")
        self._ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.n):
            ns, dev, port = self.namespace(i), self.ifname(i), self._switch_port(i)
            self._netns_add(ns)
            # made directly in the two namespaces: a pair never exists in the machine's own namespace to leak there
            self._ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
            self._ip("-n", sw, "link", "set", port, "master", "br0")
            self._ip("-n", sw, "link", "set", port, "addrgenmode", "none")
            self._ip("-n", sw, "link", "set", port, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "link", "set", dev, "addrgenmode", "none")
            self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev)
            self._ip("-n", ns, "link", "set", dev, "up")
            self._shape(ns, dev, uplink=True)
            self._shape(sw, port, uplink=False)

    def _shape(self, ns: str, dev: str, uplink: bool) -> None:
        """The qdiscs of one direction of a host's link (module docstring: netem on the uplink only)."""
        tbf = []
        if self.rate_bits_per_s is not None:
            tbf = ["tbf", "rate", str(self.rate), "burst", str(tbf_burst_bytes(self.rate_bits_per_s)),
                   "latency", TBF_LATENCY]
        netem = []
        if uplink and (self.delay or self.loss):
            netem = ["netem", "limit", str(NETEM_LIMIT)]
            netem += ["delay", str(self.delay)] if self.delay else []
            netem += ["loss", str(self.loss)] if self.loss else []
        if netem:
            self._tc("-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
            if tbf:
                self._tc("-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        elif tbf:
            self._tc("-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)

    def _netns_add(self, ns: str) -> None:
        self._ip("netns", "add", ns)
        self._made.append(ns)  # only once it exists: a name that was taken (someone else's) is never deleted

    def _ip(self, *args: str) -> None:
        self._checked(["ip", *args])

    def _tc(self, *args: str) -> None:
        self._checked(["tc", *args])

    def _checked(self, argv: List[str]) -> None:
        done = quiet_run(argv)
        if done.returncode != 0:
            raise HostsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")

    # -- running things on a host ------------------------------------------------------------------------------------
    def command(self, i: int, argv: Sequence[str]) -> List[str]:
        """The command line that runs `argv` on host i: in its network namespace and, with disk_at, in its own
        private mount namespace with the host's disk bound at disk_at."""
        wrapped = ["ip", "netns", "exec", self.namespace(i)]
        if self.disk_at is not None:
            wrapped += ["unshare", "-m", "--propagation", "private", "--", "sh", "-c", MOUNT_SH, "netns-hosts",
                        str(self.disk(i)), str(self.disk_at)]
        return wrapped + [str(a) for a in argv]

    def popen(self, i: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **popen_kwargs: Any) -> subprocess.Popen:
        """Start `argv` on host i (its network, its disk), in a new session (its own process group), with os.environ,
        then env(i), then `env` in its environment. Other keyword arguments go to subprocess.Popen."""
        if not self._started or self._closed:
            raise RuntimeError("Hosts is not running: use it inside `with Hosts(...) as hosts:`")
        full_env = {**os.environ, **self.env(i), **(env or {})}
        popen_kwargs["start_new_session"] = True  # one killpg kills the whole tree (kill_host, clean-up)
        proc = subprocess.Popen(self.command(i, argv), env=full_env, **popen_kwargs)
        self._procs[i].append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], timeout: Optional[float] = None, *, input: Any = None,
            capture_output: bool = False, check: bool = False, env: Optional[Mapping[str, str]] = None,
            **popen_kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run on host i: wait for `argv` (its process group killed on timeout, then TimeoutExpired)."""
        if capture_output:
            popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
        if input is not None:
            popen_kwargs["stdin"] = subprocess.PIPE
        proc = self.popen(i, argv, env=env, **popen_kwargs)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc, signal.SIGKILL)
            proc.communicate()
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def set_link(self, i: int, up: bool) -> None:
        """Plug host i's cable in (True) or cut it (False): its veth up or down, from the host's side. Down, the host
        loses its route to the others (a connect fails at once) and its peer port loses carrier; up restores both.
        The qdiscs stay."""
        self._ip("-n", self.namespace(i), "link", "set", self.ifname(i), "up" if up else "down")

    def kill_host(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (SIGKILL: a host that dies) to every process started on host i, their process groups included,
        and to every other process in its namespace (one that left its group); SIGKILLed children are reaped."""
        for proc in self._procs[self._index(i)]:
            _killpg(proc, sig)
        self._signal_namespace(self.namespace(i), sig)
        if sig == signal.SIGKILL:
            for proc in self._procs[i]:
                _reap(proc)

    def _signal_namespace(self, ns: str, sig: int) -> None:
        if ns not in self._made:
            return
        for _ in range(5):  # again while a dying parent may still have forked
            pids = quiet_run(["ip", "netns", "pids", ns]).stdout.split()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), sig)
                except (ProcessLookupError, ValueError):
                    pass
            if sig != signal.SIGKILL:
                return
            time.sleep(0.02)

    # -- clean-up ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process, delete every namespace, remove the disk_at mount point it made. Idempotent."""
        with self._lock:
            if self._closed or not self._started:
                self._closed = True
                return
            self._closed = True
        try:
            for i in range(self.n):
                for proc in self._procs[i]:
                    _killpg(proc, signal.SIGKILL)
            for ns in self._made:
                self._signal_namespace(ns, signal.SIGKILL)
            for procs in self._procs:
                for proc in procs:
                    _reap(proc)
            for ns in reversed(self._made):
                quiet_run(["ip", "netns", "del", ns])
            for d in self._created_dirs:
                try:
                    d.rmdir()  # only when still empty: something the user put there stays
                except OSError:
                    break
            if self._watchdog is not None:  # its pass finds nothing left; it exits
                self._watchdog.stdin.close()
                _reap(self._watchdog)
        finally:
            self._restore_handlers()
            atexit.unregister(self.close)
            self._done = True
            pending, self._pending = self._pending, None
            if pending is not None:
                signal.raise_signal(pending)  # now the signal does what it would have done without this object

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; atexit and the watchdog still clean up
        for sig in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # the process ignores it (inherited or chosen): it must not take the hosts down either
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:  # not one installed after ours
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        if not self._done:
            self._pending = signum  # delivered again by close() once everything is gone (also if it is running now)
            self.close()
            return
        # closed from another thread, which could not take our handlers back: do it here (signals run in the main
        # thread), then the signal takes its course
        self._restore_handlers()
        signal.raise_signal(signum)


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    # only while the leader is not reaped: until then its pid (= the group's id) cannot have been reused
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


