"""Which local addresses listen on a TCP port, read from the kernel's tables (/proc/net/tcp, /proc/net/tcp6)."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import List, Optional, Set

LISTEN = "0A"


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return str(ipaddress.IPv6Address(words))


def _socket_inodes(pid: int) -> Set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(port: Optional[int] = None, pid: Optional[int] = None) -> List[str]:
    """'address:port' of every listening TCP socket (on `port`; of process `pid`), '0.0.0.0' / '::' = all interfaces."""
    inodes = _socket_inodes(pid) if pid is not None else None
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            addr, hex_port = local.split(":")
            if state != LISTEN or (port is not None and int(hex_port, 16) != port) or \
                    (inodes is not None and inode not in inodes):
                continue
            found.append(f"{_address(addr)}:{int(hex_port, 16)}")
    return sorted(found)
