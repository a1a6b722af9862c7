"""How a worker reports the error that ends it: one line, from the right rank, to the right place.

Under `python -m nanotron_ext.launch` (which sets LAUNCHER_ENV) no worker prints its error: each writes it to
the error file torch elastic gives it (TORCHELASTIC_ERROR_FILE, the documented torchrun protocol) and the
launcher prints the first one and exits with its code. Under plain torchrun rank 0 prints user-facing errors
(every rank meets the same one) and any rank prints a collective failure of its own; the error file is written
too, so torchrun's failure report shows the line instead of "To enable traceback see ...".
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
from typing import Any, Callable, Optional, Tuple

from nanotron_ext.errors import one_line

LAUNCHER_ENV = "NANOTRON_EXT_LAUNCHER"  # set by nanotron_ext.launch for its workers: it prints their errors
_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def node_of(global_rank: int) -> Optional[int]:
    """The node (host) of a global rank in a torchrun job over several hosts, else None: torchrun numbers ranks
    node by node, LOCAL_WORLD_SIZE to a node."""
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) < 2:
        return None
    return global_rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def who(global_rank: int) -> str:
    """"rank R", with its node when the job spans several hosts."""
    node = node_of(global_rank)
    return f"rank {global_rank}" + (f" (node {node})" if node is not None else "")


def report(line: str, code: int, *, every_rank: bool = False) -> int:
    """Report `line` (made one line) as this worker's last word and return `code` (its exit status).

    From here the way out is decided: a launcher stopping the other workers (SIGTERM) or a second Ctrl-C must
    not turn it into "interrupted" or a traceback, so both are ignored from now on."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    line = one_line(line)
    write_error_file(line, code)
    if os.environ.get(LAUNCHER_ENV) != "1" and (every_rank or rank() == 0):
        print(line, file=sys.stderr, flush=True)
    return code


def write_error_file(line: str, code: int) -> None:
    """torch elastic's error-file format ({"message", "timestamp"}), plus our exit code and a precise time so the
    launcher can tell which rank failed first."""
    path = os.environ.get(_ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(now),
                       "nanotron_ext": {"exitcode": code, "time": now, "rank": rank()}}, f)
    except OSError:
        pass  # e.g. a full /tmp: the launcher then names the exit code without the line


_COMM_MARKERS = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "/gloo/", "NCCL")


def _others(group: object) -> list:
    """The other global ranks of `group` (the peers a collective waits on), [] when they cannot be read."""
    import torch.distributed as torch_dist

    try:  # None is the default group: a collective on it waits on every other rank of the job
        ranks = torch_dist.get_process_group_ranks(group if group is not None else torch_dist.group.WORLD)
    except (RuntimeError, ValueError, AttributeError):
        return []
    return [r for r in ranks if r != rank()]


def _nanotron_p2p_peer(frame: Any) -> Optional[Tuple[str, object, list]]:
    """(call, group, [peer]) from a frame of nanotron's P2P (parallel/pipeline_parallel/p2p.py), whose errors surface
    from a Work's wait() after the torch.distributed call returned: its `self.pg` and its `to_rank` / `from_rank`
    (ranks of that group); None for any other frame."""
    import torch.distributed as torch_dist

    if not frame.f_code.co_filename.endswith(os.path.join("pipeline_parallel", "p2p.py")):
        return None
    pg = getattr(frame.f_locals.get("self"), "pg", None)
    if pg is None:
        return None
    ends = [frame.f_locals.get(k) for k in ("to_rank", "from_rank")]
    try:
        peers = [torch_dist.get_global_rank(pg, e) for e in ends if isinstance(e, int)][:1]
    except (RuntimeError, ValueError):
        peers = []
    return frame.f_code.co_name, pg, peers or _others(pg)


def _with(peers: list) -> str:
    """" with rank 1 (node 1)": the peers of the failed call, when few enough to name (a host's, in a job over
    several hosts: which host to look at)."""
    if not peers or len(peers) > 4:
        return ""
    return " with " + ("rank " if len(peers) == 1 else "ranks ") + ", ".join(
        who(p).removeprefix("rank ") for p in peers)


def describe_collective_failure(exc: BaseException, group_name: Callable[[object], str],
                                timeout_s: Optional[float]) -> Optional[str]:
    """One line for an exception raised by a collective or point-to-point call whose peer stopped responding
    or went away (gloo/NCCL timeout or a closed connection), or None for any other exception.

    The call and its group are read from the innermost torch.distributed frame of the traceback (its `group`
    argument), named by `group_name` (the comm ledger's role names: tp, pp, dp, world)."""
    import torch.distributed as torch_dist

    text = str(exc)
    if not isinstance(exc, torch_dist.DistError) and not (
            isinstance(exc, RuntimeError) and any(m in text for m in _COMM_MARKERS)):
        return None
    call, group, peers = "a collective", None, []
    found = False
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if code.co_filename.endswith("distributed_c10d.py") and not code.co_name.startswith("_"):
            call, group = code.co_name, frame.f_locals.get("group")
            ends = [frame.f_locals.get(k) for k in ("src", "dst") if code.co_name in ("send", "recv", "isend", "irecv")]
            peers = [int(e) for e in ends if isinstance(e, int)][:1] or _others(group)
            found = True
        elif not found and (p2p := _nanotron_p2p_peer(frame)) is not None:
            (call, group, peers), found = p2p, True
    if not found:  # raised by a Work's wait() away from its call: the default group's peers, when few
        peers = _others(None)
    where = f"{call} on the {group_name(group)} group" + _with(peers)
    first = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(text.split()))[:200]  # without gloo's "[path/file.cc:78]"
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        limit = f" (general.collective_timeout_s={timeout_s:g})" if timeout_s else ""
        return (f"error: {who(rank())}: {where} timed out{limit}: a peer rank stopped responding (frozen, stopped "
                f"or overloaded) [{first}]")
    return (f"error: {who(rank())}: {where} failed because a peer rank went away (it exited or was killed; its own "
            f"report says why) [{first}]")
