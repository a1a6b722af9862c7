"""A replica's view of the torchft lighthouse (issue 33 rows 12, 15): while it does not answer, the replica says so,
naming its address, and waits a bounded time (sparseloco.fault_tolerance.quorum_timeout_s) for it to come back;
torchft's own reconnection (its Manager's quorum_retries) then uses the restarted one. Past the bound the run stops
with one line saying what to do, not a disk-space hint for a network fault."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Callable, Iterator, Optional
from urllib.parse import urlparse

from nanotron_ext.errors import TrainingError

REPORT_EVERY_S = 30.0  # a "still waiting" line this often


def unreachable(url: str, timeout_s: float = 2.0) -> Optional[str]:
    """Why nothing answers at the lighthouse's address ("Connection refused", ...), or None when something does."""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port or 80), timeout=timeout_s):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def gone(url: str, reason: str, waited_s: float) -> TrainingError:
    """The line a replica ends with when the lighthouse stays away (row 12)."""
    bind = f"{urlparse(url).hostname}:{urlparse(url).port}"
    return TrainingError(
        f"sparseloco.fault_tolerance: the torchft lighthouse at {url} does not answer ({reason}; waited "
        f"{waited_s:.0f} s, sparseloco.fault_tolerance.quorum_timeout_s): restart it (torchft_lighthouse --bind {bind} "
        f"--min_replicas N, or python -m nanotron_ext.sparseloco.ft_launch) and launch the replicas again: they resume "
        f"from their last checkpoints")


class LighthouseWatch:
    """Says (through `say`) when the lighthouse at `url` stops and starts answering; `wait` blocks until it answers,
    at most `bound_s`; `during` watches from a thread while a torchft call that cannot be interrupted runs."""

    def __init__(self, url: str, bound_s: float, say: Callable[[str], None], poll_s: float = 1.0) -> None:
        self.url, self.bound_s, self.say, self.poll_s = url, bound_s, say, poll_s
        self.down_since: Optional[float] = None
        self._reported = 0.0

    def check(self) -> Optional[str]:
        """Probe once; report a change (or a long wait). Returns why it does not answer, or None."""
        reason, now = unreachable(self.url), time.monotonic()
        if reason is None:
            if self.down_since is not None:
                self.say(f"sparseloco.fault_tolerance: the torchft lighthouse at {self.url} answers again after "
                         f"{now - self.down_since:.0f} s; rejoining it")
            self.down_since = None
        elif self.down_since is None:
            self.down_since = self._reported = now
            self.say(f"sparseloco.fault_tolerance: waiting for the torchft lighthouse at {self.url} ({reason}); "
                     f"restart it there and the replicas rejoin it (they stop after "
                     f"sparseloco.fault_tolerance.quorum_timeout_s={self.bound_s:g} s)")
        elif now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            self.say(f"sparseloco.fault_tolerance: still waiting for the torchft lighthouse at {self.url} "
                     f"({reason}, {now - self.down_since:.0f} s)")
        return reason

    def wait(self) -> None:
        """Return once the lighthouse answers; raise `gone` after `bound_s` without an answer."""
        while (reason := self.check()) is not None:
            waited = time.monotonic() - self.down_since
            if waited >= self.bound_s:
                raise gone(self.url, reason, waited)
            time.sleep(self.poll_s)

    @contextlib.contextmanager
    def during(self) -> Iterator[None]:
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(self.poll_s):
                self.check()

        thread = threading.Thread(target=watch, name="lighthouse_watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
