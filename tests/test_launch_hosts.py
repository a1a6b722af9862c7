"""A launch over several hosts that cannot form, refused by name within a bounded time (issue 53): an elastic
--nnodes range that never fits the layout (refused by the workers after 35 s), node 0 on a host that is not
--master-addr, a node waiting for a rendezvous nobody hosts (node ranks swapped: both were silent past 130 s), and
one host's per-host checkpoint refused while the other host waited in silence."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from tests.conftest import SMALL_VOCAB
from tests.helpers.runs import REPO, TINY

TWO_HOSTS = REPO / "examples" / "config_tiny_two_hosts.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stub_run(monkeypatch: pytest.MonkeyPatch) -> List[object]:
    """torchrun's `run` replaced: what would have started (nothing may, for a refused launch)."""
    import torch.distributed.run as torch_run
    from torch.distributed.launcher import api as launcher_api

    from nanotron_ext.train.failures import LAUNCHER_ENV

    started: List[object] = []
    monkeypatch.setattr(torch_run, "run", lambda args: started.append(args))
    monkeypatch.setenv(LAUNCHER_ENV, "0")
    monkeypatch.delenv(LAUNCHER_ENV)
    monkeypatch.setattr(launcher_api, "LocalElasticAgent", launcher_api.LocalElasticAgent)
    return started


def test_an_elastic_node_range_that_never_fits_the_layout_is_refused_at_once(stub_run: List[object], capsys,
                                                                             small_corpus: Path) -> None:
    from nanotron_ext.launch import main

    sets = [x for s in ["parallelism.dp=1", *_data(small_corpus)] for x in ("--set", s)]  # a fresh clone has no data
    code = main(["--nnodes=1:2", "--nproc-per-node=2", "-m", "nanotron_ext.train", "--config-file", str(TINY), *sets])
    err = capsys.readouterr().err
    assert code == 2 and not stub_run, (code, err)
    assert err.count("\n") == 1 and err.startswith("error: --nnodes 1:2: ") and "1 rank" in err, err


def test_node_zero_on_a_host_that_is_not_the_master_address_is_refused_at_once(stub_run: List[object],
                                                                                capsys) -> None:
    from nanotron_ext.launch import main

    code = main(["--nnodes=2", "--node-rank=0", "--nproc-per-node=1", "--rdzv-backend=static",
                 "--master-addr=192.0.2.1", f"--master-port={_free_port()}", "-m", "nanotron_ext.train",
                 "--config-file", str(TINY), "--set", "parallelism.dp=2"])
    err = capsys.readouterr().err
    assert code == 2 and not stub_run, (code, err)
    assert err.count("\n") == 1 and "--node-rank 0" in err and "--master-addr 192.0.2.1" in err, err


def _data(corpus: Path) -> List[str]:
    return [f"data.prepared_dir={corpus}", f"tokenizer.path={corpus / 'tokenizer.json'}",
            f"tokenizer.vocab_size={SMALL_VOCAB}", f"model.vocab_size={SMALL_VOCAB}"]


def _host_argv(node: int, port: int, root: Path, corpus: Path, *rdzv: str, master: str = "127.0.0.1") -> List[str]:
    argv = [sys.executable, "-m", "nanotron_ext.launch", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
            "--rdzv-backend=static", f"--master-addr={master}", f"--master-port={port}", *rdzv,
            "-m", "nanotron_ext.train", "--config-file", str(TWO_HOSTS)]
    for s in [*_data(corpus), f"checkpoints.dir={root / f'host{node}' / 'ckpt'}", "logging.progress_bar=false",
              f"general.output_dir={root / f'host{node}' / 'runs'}", "tokens.train_steps=4"]:
        argv += ["--set", s]
    return argv


@pytest.mark.slow
def test_a_node_waiting_for_a_rendezvous_nobody_hosts_names_the_addresses(tmp_path: Path,
                                                                          small_corpus: Path) -> None:
    """Node 1 alone, --master-addr an address of its own host where nothing listens (node ranks swapped: the host
    with node rank 0 is elsewhere): refused after the rendezvous's timeout, naming both flags."""
    t0 = time.monotonic()
    done = subprocess.run(_host_argv(1, _free_port(), tmp_path, small_corpus, "--rdzv-conf=timeout=3"), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - t0 < 60, (done.returncode, done.stderr[-2000:])
    line = done.stderr.strip().splitlines()[-1]
    assert "--node-rank 1" in line and "--master-addr 127.0.0.1" in line, done.stderr[-2000:]


def _checkpoint(folder: Path, meta: str) -> None:
    """A complete-looking step folder (its meta.json lists one file of the recorded size), or a damaged one."""
    folder.mkdir(parents=True)
    (folder / "pp0_dp0_tp0.pt").write_bytes(b"xyz")
    (folder / "meta.json").write_text(meta)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["meta.json", "shard"])
def test_one_hosts_damaged_checkpoint_is_refused_on_every_host(tmp_path: Path, small_corpus: Path,
                                                               damage: str) -> None:
    """Host 1's newest meta.json is damaged, or its shard deleted: host 1 refused at once, host 0 waited with no
    output. Now both print the refusal, naming node 1, within seconds of each other."""
    good = json.dumps({"step": 2, "layout": {"dp": 1, "tp": 1, "pp": 2},
                       "files": [{"name": "pp0_dp0_tp0.pt", "bytes": 3, "sha256": "0"}]})
    _checkpoint(tmp_path / "host0" / "ckpt" / "step_2", good)
    _checkpoint(tmp_path / "host1" / "ckpt" / "step_2", "{ not json" if damage == "meta.json" else good)
    if damage == "shard":
        (tmp_path / "host1" / "ckpt" / "step_2" / "pp0_dp0_tp0.pt").unlink()
    port = _free_port()
    procs = [subprocess.Popen(_host_argv(i, port, tmp_path, small_corpus), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for i in (0, 1)]
    ended = []
    try:
        for p in procs:
            p.wait(timeout=90)
            ended.append(time.monotonic())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert abs(ended[1] - ended[0]) < 30, outs
    for err in outs:
        line = err.strip().splitlines()[-1]
        assert line.startswith("error: ") and "node 1" in line and "step_2" in line, err[-2000:]


@pytest.mark.slow
def test_swapped_node_ranks_are_refused_on_both_hosts_naming_the_flags(tmp_path: Path, small_corpus: Path) -> None:
    """Two hosts (network namespaces, each its own address), node ranks swapped and --master-addr left at the old
    host 0: both were silent past 130 s. The new node 0 is refused at once, the new node 1 (whose own address is
    --master-addr) after the rendezvous timeout, each naming --node-rank and --master-addr."""
    from nanotron_ext.bench.netns_hosts import Hosts, available

    if available() is not None:
        pytest.skip(str(available()))
    with Hosts(2, disk_root=tmp_path / "disks") as hosts:
        t0 = time.monotonic()
        procs = [hosts.popen(i, _host_argv(1 - i, 29500, tmp_path, small_corpus, "--rdzv-conf=timeout=5",
                                           master=hosts.addr(0)),
                             env={"OMP_NUM_THREADS": "1"}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i in (0, 1)]
        outs = [p.communicate(timeout=120)[1] for p in procs]
        took = time.monotonic() - t0
    assert [p.returncode for p in procs] == [2, 2] and took < 90, (took, outs)
    for node, err in zip((1, 0), outs):
        line = err.strip().splitlines()[-1]
        assert f"--node-rank {node}" in line and "--master-addr 10.77.0.1" in line, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("refusing", [0, 1])
def test_one_hosts_preflight_refusal_is_printed_by_both_hosts(tmp_path: Path, small_corpus: Path,
                                                              refusing: int) -> None:
    """Two hosts (network namespaces), one whose launcher's own start-up check refuses (its data folder is
    missing): that host refused at once while the other waited in the rendezvous, silent, for its whole timeout
    (600 s). Now both print the refusal, naming the node and the key, well within 60 s."""
    from nanotron_ext.bench.netns_hosts import Hosts, available

    if available() is not None:
        pytest.skip(str(available()))
    with Hosts(2, disk_root=tmp_path / "disks") as hosts:
        t0 = time.monotonic()
        argvs = [_host_argv(i, 29500, tmp_path, small_corpus, master=hosts.addr(0)) for i in (0, 1)]
        argvs[refusing] += ["--set", f"data.prepared_dir={tmp_path / 'missing'}"]
        procs = [hosts.popen(i, argvs[i], env={"OMP_NUM_THREADS": "1"}, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in (0, 1)]
        try:
            outs = [p.communicate(timeout=60)[1] for p in procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"a host was still waiting after {time.monotonic() - t0:.0f} s")
        took = time.monotonic() - t0
    assert [p.returncode for p in procs] == [2, 2], outs
    for err in outs:
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"error: node {refusing} (10.77.0.{refusing + 1}): data.prepared_dir "), err[-2000:]
    assert took < 60, took
