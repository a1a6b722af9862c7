"""Hosts on one machine, the link side: the tc parameters (rate, delay, loss) checked before anything is made,
the shaping constants, the set-up errors and what this machine can do (`available`)."""
from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import subprocess
from typing import Optional, Sequence

from nanotron_ext.errors import UserFacingError

SUBNET = "10.77.0"
MAX_HOSTS = 254  # 10.77.0.1 .. 10.77.0.254 in a /24
TBF_MIN_BURST = 64 * 1024  # veth hands tbf whole GSO packets of up to 64 KiB: a smaller bucket never passes them
TBF_TICK_S = 0.004  # the bucket also holds one timer tick of traffic (HZ=250)
TBF_LATENCY = "200ms"
NETEM_LIMIT = 100000  # packets in netem's delay line; its default 1000 caps delay x rate far below a real link's
_IP_TIMEOUT_S = 30.0
# a command on a host with a disk: bind its folder at disk_at inside the command's own mount namespace, enter its
# working folder again (one at or under disk_at was the machine's real folder, opened before the mount: now it is
# the host's disk), then become the command
MOUNT_SH = ('here=$(pwd -P) || exit 125; mount --bind -- "$1" "$2" || exit 125; '
            'cd -- "$here" 2>/dev/null || { echo "netns_hosts: $here is under --disk-at $2, and this host'"'"'s disk '
            '$1 has no such folder" >&2; exit 125; }; shift 2; exec "$@"')
# the watchdog: block until the owner's pipe closes (the owner exited, however), then kill and delete
WATCHDOG_SH = ('read -r _ignored; for ns in "$@"; do for p in $(ip netns pids "$ns" 2>/dev/null); do '
                'kill -9 "$p" 2>/dev/null; done; ip netns del "$ns" 2>/dev/null; done; exit 0')


class HostsUnavailable(UserFacingError, RuntimeError):
    """Namespaces (or netem, for delay and loss) cannot be made here; the message says why."""


class HostsError(RuntimeError):
    """A command setting up the hosts failed; the message has the command and what it said."""


# -- link parameters, checked before anything is made ----------------------------------------------------------------
_RATE = re.compile(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)([kmgt]i?)?(bit|bps)", re.IGNORECASE)
# tc's range for tbf: whole bytes per second, and a bucket (4 ms at the rate, TBF_TICK_S) of at most 2^32 - 1 bytes
MIN_RATE_BITS = 8.0
MAX_RATE_BITS = 8e12
_DELAY = re.compile(r"(\d+(?:\.\d+)?)(s|secs?|ms|msecs?|us|usecs?)", re.IGNORECASE)
_LOSS = re.compile(r"(\d+(?:\.\d+)?)%")
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def rate_bits_per_s(text: str) -> float:
    """tc's rate (`200mbit`, `1gbit`, `10mbps` = megabytes/s, `kibit`...) in bits/s; ValueError when it is none."""
    m = _RATE.fullmatch(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text}: not a rate; give a number > 0 and a unit as tc takes it, e.g. 200mbit, 1gbit, "
                         "10mbps (bytes/s)")
    bits = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()] * (8 if m.group(3).lower() == "bps" else 1)
    if not MIN_RATE_BITS <= bits <= MAX_RATE_BITS:
        raise ValueError(f"{text}: out of tc's range for a link; give 8bit (1 byte/s) to 8tbit")
    return bits


def delay_seconds(text: str) -> float:
    """netem's delay (`25ms`, `0.1s`, `500us`) in seconds; ValueError when it is none."""
    m = _DELAY.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text}: not a delay; give a number and a unit, e.g. 25ms, 0.1s, 500us")
    unit = m.group(2).lower()
    return float(m.group(1)) * (1e-3 if unit.startswith("ms") else 1e-6 if unit.startswith("us") else 1.0)


def loss_percent(text: str) -> float:
    """netem's loss (`0.1%`) in percent; ValueError when it is none or above 100%."""
    m = _LOSS.fullmatch(text.strip())
    if not m or float(m.group(1)) > 100:
        raise ValueError(f"{text}: not a loss; give a percentage in [0, 100], e.g. 0.1%")
    return float(m.group(1))


def tbf_burst_bytes(bits_per_s: float) -> int:
    """tbf's bucket for `bits_per_s`: a GSO packet and a timer tick of traffic, whichever is larger."""
    return max(TBF_MIN_BURST, int(bits_per_s / 8 * TBF_TICK_S))


# -- what this machine can do ---------------------------------------------------------------------------------------
def quiet_run(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=_IP_TIMEOUT_S, stdin=subprocess.DEVNULL)


@functools.lru_cache(maxsize=None)
def available(netem: bool = False) -> Optional[str]:
    """None when hosts can be made here (root, `ip`, `tc`, `unshare`, `mount` present, and a probe namespace with a
    bridge, a veth pair, a tbf qdisc and a private mount namespace can be made and deleted); with `netem`, also the
    netem qdisc (delay, loss). Else the reason, one line (for a pytest skip)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc, mount)"
    for tool in ("ip", "tc", "unshare", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH (iproute2, util-linux)"
    probe = f"ntxprobe-{os.getpid()}-{secrets.token_hex(2)}"
    steps = [["ip", "netns", "add", probe],
             ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
             ["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
             ["ip", "-n", probe, "link", "set", "pb", "master", "br0"],
             ["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit", "burst", "64kb",
              "latency", TBF_LATENCY],
             ["ip", "netns", "exec", probe, "unshare", "-m", "--propagation", "private", "true"]]
    if netem:
        steps.append(["tc", "-n", probe, "qdisc", "add", "dev", "pb", "root", "netem", "delay", "1ms"])
    made = False
    try:
        for argv in steps:
            try:
                done = quiet_run(argv)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"`{' '.join(argv)}` failed: {e}"
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or ["no message"])[-1]
                if "netem" in argv:
                    return f"this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), needed for delay and loss: {said}"
                return f"`{' '.join(argv)}` failed: {said}"
            made = True
        return None
    finally:
        if made:
            quiet_run(["ip", "netns", "del", probe])


