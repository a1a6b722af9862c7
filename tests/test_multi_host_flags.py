"""bench.multi_host's flags and its time limit (issue 53): a --mbps that no link can take is refused at the flag (it
passed, then failed in the rate parser with a traceback), and a job that outlives --timeout-s ends in one line that
says so (it was a traceback about a failed job)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List

import pytest

from nanotron_ext.bench import multi_host

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mbps", ["1e-7", "1e300"])
def test_a_rate_no_link_can_take_is_refused_at_the_flag(mbps: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "nanotron_ext.bench.multi_host", "--mbps", mbps, "--work",
                           str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("error: --mbps ") \
        and done.stderr.count("\n") == 1, (done.returncode, done.stderr)


class _NoHosts:
    """Stands for Hosts: the job's launchers are replaced by processes that outlive the limit."""

    def __init__(self, n: int, **kwargs: Any) -> None:
        self.n = n

    def __enter__(self) -> "_NoHosts":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


@pytest.mark.slow
def test_a_job_that_outlives_the_time_limit_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    import nanotron_ext.bench.netns_hosts as netns_hosts

    def start_job(hosts: Any, config: Path, sets: Any, logs: Path) -> List[subprocess.Popen]:
        logs.mkdir(parents=True, exist_ok=True)
        procs = []
        for i in range(hosts.n):
            p = subprocess.Popen(["sleep", "60"])
            p.log = open(logs / f"host{i}.log", "w")  # noqa: SIM115 - closed by wait_job
            procs.append(p)
        return procs

    monkeypatch.setattr(netns_hosts, "available", lambda netem=False: None)
    monkeypatch.setattr(multi_host, "Hosts", _NoHosts)
    monkeypatch.setattr(multi_host, "start_job", start_job)
    t0 = time.monotonic()
    code = multi_host.main(["--timeout-s", "10", "--codecs", "identity", "--work", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 1 and time.monotonic() - t0 < 30, (code, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "--timeout-s 10" in err, err
