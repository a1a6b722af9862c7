"""Hosts on one machine: N network namespaces standing for N hosts, joined by a switch, each with its own shaped
link and its own local disk, for multi-host jobs, tests and benchmarks without a second machine.

What it is for: a `--nnodes N` launch (one launcher per "host", rendezvous over a real TCP/IP network), per-host
checkpoints (each host writes the same configured path, which is a different folder per host), host faults (kill a
host's whole process tree, cut its cable) and real-network timing (rate, delay and loss of a physical link, applied by
the kernel to the real packets, TCP's behaviour included). Generalises scripts/netns_pipeline.sh (2 ranks, 1 veth
pair) to N hosts.

    with Hosts(3, rate="200mbit", delay="25ms", disk_root=tmp / "disks", disk_at=Path("/ckpt")) as hosts:
        procs = [hosts.popen(i, ["python", "-m", "...", "--master-addr", hosts.addr(0)]) for i in range(3)]
        hosts.kill_host(2)       # SIGKILL every process host 2 runs
        hosts.set_link(1, False)  # host 1's cable cut (True plugs it back)

    python -m nanotron_ext.bench.netns_hosts --hosts 2 --rate 200mbit --delay 25ms --disk-root /tmp/disks \\
        --disk-at /ckpt -- python train.py --node-rank {host} --master-addr {addr0}

The CLI runs the command on every host at once ({host}: the host's index, {addr0}: host 0's address), each output
line prefixed `[host<i>] `, and exits with the first failing host's code (the other hosts are stopped: SIGTERM, then
SIGKILL), 0 when all succeed.

Topology and addressing. A "switch" namespace `sw-<id>` holds a Linux bridge; host i is the namespace `h<i>-<id>`,
joined to the bridge by its own veth pair (`v<i>h<id>` in the host, `v<i>s<id>` on the switch; <id> is 6 random hex
digits per Hosts object, so concurrent objects never collide and every name fits IFNAMSIZ, 15 characters). Host i has
10.77.0.<i+1>/24 on its veth and `lo` up; the addresses exist only inside these private namespaces (each its own
routing table and port space), so they collide neither with the machine's network nor with another Hosts. IPv6
address generation is off on every port (`addrgenmode none`): no router solicitations or MLD reports on the shaped
links, and a Gloo picking an interface address can only find the IPv4 one. Each command gets HOST_INDEX, HOST_ADDR,
HOST_COUNT, HOST0_ADDR and GLOO_SOCKET_IFNAME (its veth) in its environment.

Shaping (the arrangement chosen): every host has a full-duplex link of `rate` to a non-blocking switch.
- uplink = egress of the host's veth: `netem` (delay, loss) as root (handle 1:), `tbf` (rate) as its child (1:1),
  the arrangement of netem's documentation;
- downlink = egress of the switch's veth to that host: `tbf` (rate) only.
So the delay and the loss are applied once per host-to-host trip, on the sender's uplink: one-way latency host a ->
host b = delay, RTT between two hosts = 2 x delay (plus serialisation at `rate`), a packet is lost with probability
`loss` per trip; the rate limits both what a host sends (its uplink) and what it receives (its downlink: two hosts
sending to one share that host's `rate`, as at a real switch port). tbf: burst max(64 KiB, 4 ms at rate) (veth hands
tbf GSO packets of up to 64 KiB, and the bucket must hold a timer tick of traffic, HZ=250), `latency 200ms` (its
queue: rate x 200 ms + burst); netem's queue limit is raised to 100000 packets (its default 1000 is less than a
delay x rate product of 64 KiB GSO packets). Without rate, delay and loss a link is unshaped (a veth is ~10s of Gbit/s).
netem must be in the kernel (CONFIG_NET_SCH_NETEM) for delay or loss: `available(netem=True)` says whether it is,
and a Hosts given delay or loss refuses to start without it (HostsUnavailable) rather than run unshaped.

Disks. Host i's local disk is the folder `disk_root/host<i>` (created). With `disk_at`, every command run on host i
sees that folder mounted at `disk_at` (`unshare -m --propagation private` + `mount --bind`, a private mount namespace
per command, nothing propagating back), so the same configured path (a checkpoint folder) is a different disk on every
host and nothing is shared between hosts but the network. `disk_at` is created as an empty mount point when missing
(and removed again at clean-up when this object created it and it is still empty).

Processes. Every command starts in a new session (start_new_session=True: its own process group), so a host's whole
tree is killed with one killpg; a process that left its group (setsid, a daemon) is found anyway by `ip netns pids`,
every process whose network namespace is the host's.

Clean-up guarantees (idempotent, any number of times, from any of these):
- `__exit__` (also on an exception inside the `with`), `close()`, and atexit;
- SIGTERM / SIGINT while the object is open (its handlers, installed in the main thread): clean up, then the signal
  takes the course it would have taken without this object (the previous handler; default SIGTERM kills the process,
  default SIGINT raises KeyboardInterrupt);
- the owning process SIGKILLed or crashing: a watchdog (a `sh` in its own session, reading a pipe only the owner
  holds) sees the pipe close and deletes the namespaces after killing every process in them.
Clean-up kills every started process group and every process in the namespaces (SIGKILL), then deletes the
namespaces; deleting a namespace destroys its veth ends (so the pairs) and their qdiscs, and the bridge with the
switch. A namespace is only destroyed once no process is in it, hence the kills first.

Needs root, `ip` and `tc` (iproute2), `unshare` and `mount` (util-linux), and a kernel with network namespaces,
veth, bridge and tbf; `available()` returns None when they all work here, else the reason (a pytest skip message).
"""
from __future__ import annotations

from nanotron_ext.bench.netns_hosts.hosts import Hosts
from nanotron_ext.bench.netns_hosts.links import (
    MAX_HOSTS,
    SUBNET,
    HostsError,
    HostsUnavailable,
    available,
    delay_seconds,
    loss_percent,
    rate_bits_per_s,
    tbf_burst_bytes,
)

__all__ = ["Hosts", "HostsError", "HostsUnavailable", "MAX_HOSTS", "SUBNET", "available", "delay_seconds",
           "loss_percent", "rate_bits_per_s", "tbf_burst_bytes"]
