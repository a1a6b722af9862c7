"""checkpoints.storage=per_host: each host writes its own ranks' shards to its own folder, a step is complete when
every host's part is, a resume takes the newest step complete on every host, and a host that lost its folder or
its node rank is refused by name. Two gloo ranks stand for two hosts (GROUP_RANK, torchrun's node rank) with a
folder each; the multi-host launch over real namespaced links is tests/test_multi_host.py."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from nanotron_ext.parallel.context import build_parallel_context
from nanotron_ext.train.checkpoint import (
    CheckpointError,
    CheckpointHosts,
    agreed_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)

try:
    from tests.helpers.dist import run_distributed
except ImportError:  # pytest put tests/ (not the repository root) on sys.path
    from helpers.dist import run_distributed


def _host(root: str, scenario: str):
    rank = int(os.environ["RANK"])
    # "swapped": each machine comes back with the other's node rank (its disk is still the one it had)
    os.environ["GROUP_RANK"] = str(rank)
    disk = Path(root) / f"host{1 - rank if scenario == 'swapped' else rank}"
    pc = build_parallel_context(dp=2, tp=1, pp=1, backend="gloo")
    hosts = CheckpointHosts.agree(pc.world_pg, per_host=True)
    torch.manual_seed(rank)
    model = nn.Linear(4, 4)
    out = {"rank": rank}
    if scenario == "save":
        for step in (1, 2):
            save_checkpoint(disk, step, pc, model=model, extra={"step": step}, keep_last=2, hosts=hosts)
        # step 3: host 1's commit (its rename) fails after host 0's succeeded
        if rank == 1:
            real = os.replace

            def failing(src, dst):
                if Path(dst).name == "step_3":
                    raise OSError(28, "No space left on device")
                return real(src, dst)
            os.replace = failing
        try:
            save_checkpoint(disk, 3, pc, model=model, extra={"step": 3}, keep_last=2, hosts=hosts)
        except CheckpointError as e:
            out["error"] = str(e)
        out["steps"] = [s for s, _ in list_checkpoints(disk)]
        out["meta"] = read_meta(disk / "step_2")
        agreed = agreed_checkpoint(disk, pc.world_pg, hosts, lambda: latest_checkpoint(disk))
        out["agreed"] = agreed.name
        out["extra"] = load_checkpoint(agreed, pc, model=nn.Linear(4, 4))
        return out
    if scenario == "lost":
        if rank == 1:
            shutil.rmtree(disk)

    def pick():
        if scenario == "damaged" and rank == 1:  # what checkpoint_to_resume says of a damaged newer step_<N>
            raise CheckpointError("checkpoints.dir: step_4 is damaged")
        return latest_checkpoint(disk)
    try:
        agreed = agreed_checkpoint(disk, pc.world_pg, hosts, pick)
        load_checkpoint(agreed, pc, model=nn.Linear(4, 4))
    except CheckpointError as e:
        out["error"] = str(e)
    return out


def test_each_host_keeps_its_own_shards_and_a_step_counts_when_every_host_has_it(tmp_path):
    ranks = run_distributed(_host, 2, str(tmp_path), "save")
    for r in ranks:
        assert "committing checkpoint" in r["error"] and "No space left" in r["error"], r  # both ranks learn
        assert r["agreed"] == "step_2" and r["extra"] == {"step": 2}
        meta = r["meta"]
        assert [f["name"] for f in meta["files"]] == [f"pp0_dp{r['rank']}_tp0.pt"]  # only this host's file
        assert meta["host"] == r["rank"]
        assert {h: [f["name"] for f in files] for h, files in meta["hosts"].items()} == {
            "0": ["pp0_dp0_tp0.pt"], "1": ["pp0_dp1_tp0.pt"]}
    # host 0 completed step 3 and host 1 did not: nothing was pruned on either, so step 2 is on both
    assert ranks[0]["steps"] == [1, 2, 3] and ranks[1]["steps"] == [1, 2]
    assert sorted(os.listdir(tmp_path / "host0" / "step_2")) == ["meta.json", "pp0_dp0_tp0.pt"]
    assert sorted(os.listdir(tmp_path / "host1" / "step_2")) == ["meta.json", "pp0_dp1_tp0.pt"]


@pytest.mark.parametrize("scenario, words", [
    ("lost", ["node 1 has no complete checkpoint", "node 0 has step_3"]),
    ("swapped", ["holds node 1's shards, not pp0_dp0_tp0.pt", "rank runs on node 0", "--node-rank it had"]),
    ("damaged", ["node 1: checkpoints.dir: step_4 is damaged"]),  # one host's refusal reaches both
])
def test_a_host_without_its_folder_or_its_node_rank_is_refused_by_name(tmp_path, scenario, words):
    run_distributed(_host, 2, str(tmp_path), "save")
    ranks = run_distributed(_host, 2, str(tmp_path), scenario)
    for r in ranks:
        for w in words:
            assert w in r["error"], (w, r["error"])


def _two_ranks_per_host(root: str):
    rank = int(os.environ["RANK"])
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2")
    disk = Path(root) / f"host{rank // 2}"
    pc = build_parallel_context(dp=2, tp=2, pp=1, backend="gloo")
    hosts = CheckpointHosts.agree(pc.world_pg, per_host=True)
    torch.manual_seed(rank)
    model = nn.Linear(4, 4)
    for step in (1, 2, 3):
        save_checkpoint(disk, step, pc, model=model, extra={"step": step}, keep_last=1, hosts=hosts)
    agreed = agreed_checkpoint(disk, pc.world_pg, hosts, lambda: latest_checkpoint(disk))
    extra = load_checkpoint(agreed, pc, model=nn.Linear(4, 4))
    return {"rank": rank, "extra": extra, "meta": read_meta(disk / "step_3"), "dirs": sorted(os.listdir(disk))}


def test_a_host_with_several_ranks_writes_their_shards_once_into_its_own_folder(tmp_path):
    ranks = run_distributed(_two_ranks_per_host, 4, str(tmp_path))
    for r in ranks:
        host = r["rank"] // 2
        assert r["extra"] == {"step": 3} and r["dirs"] == ["step_3"], r["dirs"]  # steps 1, 2 pruned on both hosts
        assert [f["rank"] for f in r["meta"]["files"]] == [2 * host, 2 * host + 1]  # this host's two ranks
        assert {h: [f["rank"] for f in files] for h, files in r["meta"]["hosts"].items()} == {"0": [0, 1], "1": [2, 3]}
    assert sorted(os.listdir(tmp_path / "host1" / "step_3")) == ["meta.json", "pp0_dp1_tp0.pt", "pp0_dp1_tp1.pt"]


def test_per_host_with_overwrite_is_refused_at_load():
    from nanotron_ext.config.checks import ConfigError
    from nanotron_ext.config.schema import CheckpointsConfig

    with pytest.raises(ConfigError, match="checkpoints.resume: overwrite hands one host"):
        CheckpointsConfig(storage="per_host", resume="overwrite")
    assert torch_dist.is_available() and torch.__version__
