"""Checkpoints: round trip, pruning, crash safety, layout checks, and bit-exact resume on 4 ranks."""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from nanotron_ext.parallel.context import build_parallel_context
from nanotron_ext.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    save_checkpoint,
)

try:
    from tests.helpers.dist import free_port, run_distributed
except ImportError:  # pytest put tests/ (not the repository root) on sys.path
    from helpers.dist import free_port, run_distributed


# --------------------------------------------------------------------------------------------
# Single process (a world of one gloo rank, on a free port so concurrent test runs do not clash)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def ctx(monkeypatch):
    owned = not torch_dist.is_initialized()
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    pc = build_parallel_context(1, 1, 1, backend="gloo")
    yield pc
    if owned:
        torch_dist.destroy_process_group()


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def _make(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, LambdaLR(opt, _warmup)


def _step(model, opt, sched) -> torch.Tensor:
    # Data and dropout both draw from the global torch RNG, so a wrong RNG restore shows up here.
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def _save(root, step, pc, trio, **kw):
    model, opt, sched = trio
    return save_checkpoint(root, step, pc, model=model, optimizer=opt, scheduler=sched,
                           extra=kw.pop("extra", {"step": step}), **kw)


def _dirs(root: Path):
    return sorted(p.name for p in root.iterdir())


def test_round_trip_restores_rng_model_optimizer_scheduler(ctx, tmp_path):
    model, opt, sched = _make(0)
    random.seed(1)
    np.random.seed(2)
    for _ in range(3):
        _step(model, opt, sched)
    gen = torch.Generator().manual_seed(7)
    torch.rand(5, generator=gen)
    extra = {"step": 3, "loader": {"epoch": 1, "offset": 17, "gen": gen.get_state()}, "tokens": [1, 2.5, "x", None]}
    path = save_checkpoint(tmp_path, 3, ctx, model=model, optimizer=opt, scheduler=sched, extra=extra)
    assert path == tmp_path / "step_3" and latest_checkpoint(tmp_path) == path

    def future(m, o, s):
        draws = (torch.rand(4), np.random.rand(4), random.random())
        loss = _step(m, o, s)
        return draws, loss, {k: v.clone() for k, v in m.state_dict().items()}, o.state_dict(), s.get_last_lr()

    ref = future(model, opt, sched)

    model2, opt2, sched2 = _make(123)  # different weights, fresh optimizer state
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    got_extra = load_checkpoint(path, ctx, model=model2, optimizer=opt2, scheduler=sched2)
    assert got_extra["loader"]["epoch"] == 1 and got_extra["tokens"] == [1, 2.5, "x", None]
    assert torch.equal(got_extra["loader"]["gen"], gen.get_state())
    out = future(model2, opt2, sched2)

    assert torch.equal(ref[0][0], out[0][0]) and np.array_equal(ref[0][1], out[0][1]) and ref[0][2] == out[0][2]
    assert torch.equal(ref[1], out[1])
    assert all(torch.equal(ref[2][k], out[2][k]) for k in ref[2])
    for pid, st in ref[3]["state"].items():
        assert all(torch.equal(st[k], out[3]["state"][pid][k]) for k in st)
    assert ref[4] == out[4]

    meta = read_meta(path)
    assert meta["step"] == 3 and meta["layout"] == {"dp": 1, "tp": 1, "pp": 1}
    assert [f["name"] for f in meta["files"]] == ["pp0_dp0_tp0.pt"]
    assert meta["files"][0]["bytes"] == (path / "pp0_dp0_tp0.pt").stat().st_size
    assert len(meta["files"][0]["sha256"]) == 64 and "nanotron_ext_version" in meta


def test_keep_last_prunes_oldest_and_resave_replaces(ctx, tmp_path):
    trio = _make(0)
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, ctx, trio, keep_last=2)
    assert _dirs(tmp_path) == ["step_3", "step_4"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    # Re-saving an existing step (e.g. a final save right after resuming) replaces it.
    _save(tmp_path, 4, ctx, trio, keep_last=2, extra={"again": True})
    assert _dirs(tmp_path) == ["step_3", "step_4"]
    assert load_checkpoint(tmp_path / "step_4", ctx, model=trio[0]) == {"again": True}
    # The checkpoint just written is never pruned, even if older-numbered than the kept ones.
    _save(tmp_path, 2, ctx, trio, keep_last=1)
    assert _dirs(tmp_path) == ["step_2", "step_4"]


class _Killed(BaseException):
    """Stands in for SIGKILL: not an Exception, so no handler in the code under test sees it."""


def _fail_on(monkeypatch, predicate, exc):
    real = os.replace

    def fake(src, dst, *a, **kw):
        if predicate(Path(src), Path(dst)):
            raise exc
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", fake)


def _is_commit(src: Path, dst: Path) -> bool:
    return re.fullmatch(r"step_\d+", dst.name) is not None and ".tmp-" in src.name


def test_failed_commit_leaves_previous_latest(ctx, tmp_path, monkeypatch):
    trio = _make(0)
    first = _save(tmp_path, 1, ctx, trio)
    _fail_on(monkeypatch, _is_commit, OSError("disk on fire"))
    with pytest.raises(CheckpointError, match="disk on fire"):
        _save(tmp_path, 2, ctx, trio)
    assert latest_checkpoint(tmp_path) == first
    assert _dirs(tmp_path) == ["step_1"]  # a handled failure cleans its temp folder
    # Re-saving step 1 moves the old step_1 aside first; a failed commit puts it back.
    with pytest.raises(CheckpointError, match="disk on fire"):
        _save(tmp_path, 1, ctx, trio, extra={"new": True})
    monkeypatch.undo()
    assert _dirs(tmp_path) == ["step_1"] and latest_checkpoint(tmp_path) == first
    assert load_checkpoint(first, ctx, model=trio[0]) == {"step": 1}


def test_hard_crash_mid_save_is_invisible_and_cleaned_next_time(ctx, tmp_path, monkeypatch):
    trio = _make(0)
    first = _save(tmp_path, 1, ctx, trio)

    # Killed just before the commit rename: the temp folder even holds meta.json, yet is not a checkpoint.
    _fail_on(monkeypatch, _is_commit, _Killed())
    with pytest.raises(_Killed):
        _save(tmp_path, 2, ctx, trio)
    monkeypatch.undo()
    stale = [d for d in _dirs(tmp_path) if ".tmp-" in d]
    assert len(stale) == 1 and (tmp_path / stale[0] / "meta.json").exists()
    assert latest_checkpoint(tmp_path) == first

    # Killed while a rank's file is half written; the save starts by removing the earlier leftover.
    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        real_save({"half": torch.zeros(3)}, f)
        raise _Killed()

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(_Killed):
        _save(tmp_path, 3, ctx, trio)
    monkeypatch.undo()

    assert [d.split(".")[0] for d in _dirs(tmp_path)] == ["step_1", "step_3"]
    assert latest_checkpoint(tmp_path) == first

    third = _save(tmp_path, 3, ctx, trio)
    assert _dirs(tmp_path) == ["step_1", "step_3"] and latest_checkpoint(tmp_path) == third


def test_incomplete_or_corrupt_folders_are_not_checkpoints(ctx, tmp_path):
    trio = _make(0)
    good = _save(tmp_path, 1, ctx, trio)
    (tmp_path / "step_9").mkdir()  # no meta.json
    bad = _save(tmp_path, 5, ctx, trio)
    with open(bad / "pp0_dp0_tp0.pt", "r+b") as f:  # truncated after completion
        f.truncate(10)
    assert latest_checkpoint(tmp_path) == good

    flipped = _save(tmp_path, 6, ctx, trio)
    data = bytearray((flipped / "pp0_dp0_tp0.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content: only the hash sees it
    (flipped / "pp0_dp0_tp0.pt").write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == flipped
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(flipped, ctx, model=trio[0])


def test_layout_mismatch_names_both_layouts(ctx, tmp_path):
    trio = _make(0)
    path = _save(tmp_path, 1, ctx, trio)
    meta = read_meta(path)
    meta["layout"] = {"dp": 2, "tp": 4, "pp": 1}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, ctx, model=trio[0], optimizer=trio[1], scheduler=trio[2])
    msg = str(info.value)
    assert "dp=2 tp=4 pp=1" in msg and "dp=1 tp=1 pp=1" in msg and "resharding" in msg


def test_unloadable_extra_is_rejected_at_save_naming_the_key(ctx, tmp_path):
    trio = _make(0)
    with pytest.raises(CheckpointError, match=r"\['loader'\]\['perm'\].*numpy"):
        _save(tmp_path, 1, ctx, trio, extra={"loader": {"perm": np.arange(4)}})
    with pytest.raises(CheckpointError, match=r"\['count'\].*numpy"):
        _save(tmp_path, 1, ctx, trio, extra={"count": np.float64(1.0)})
    assert _dirs(tmp_path) == [] and latest_checkpoint(tmp_path) is None


# --------------------------------------------------------------------------------------------
# 4 gloo ranks, dp=2 x tp=2: uninterrupted 2N steps == N steps, save, fresh processes, N more
# --------------------------------------------------------------------------------------------
N_STEPS = 4
DP, TP = 2, 2


def _toy_run(root: str, resume: bool):
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.parallel.tensor_parallel.nn import TensorParallelColumnLinear, TensorParallelRowLinear

    pc = build_parallel_context(dp=DP, tp=TP, pp=1, backend="gloo")
    rank = torch_dist.get_rank()
    _, dp_rank, tp_rank = pc.get_3d_ranks(rank)
    # Weights: same across DP replicas, different TP shards; the resumed run starts from other
    # weights, RNG and data seeds so that only the checkpoint can make it match.
    torch.manual_seed(100 + tp_rank + (7 if resume else 0))
    mode = TensorParallelLinearMode.ALL_REDUCE
    model = nn.ModuleDict({
        "up": TensorParallelColumnLinear(8, 32, pc.tp_pg, mode),
        "down": TensorParallelRowLinear(32, 8, pc.tp_pg, mode),
    })
    opt = AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    sched = LambdaLR(opt, _warmup)
    torch.manual_seed(1000 + rank + (7 if resume else 0))  # dropout on the TP-sharded activations
    data = torch.Generator().manual_seed(50 + dp_rank + (7 if resume else 0))

    start = 0
    if resume:
        path = latest_checkpoint(root)
        assert path is not None and path.name == f"step_{N_STEPS}"
        extra = load_checkpoint(path, pc, model=model, optimizer=opt, scheduler=sched)
        data.set_state(extra["data_rng"])
        start = extra["step"]

    losses = []
    for step in range(start, 2 * N_STEPS):
        x = torch.randn(4, 8, generator=data)
        y = torch.randn(4, 8, generator=data)
        h = nn.functional.dropout(torch.relu(model["up"](x)), p=0.25, training=True)
        loss = ((model["down"](h) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            torch_dist.all_reduce(p.grad, group=pc.dp_pg)
            p.grad /= DP
        opt.step()
        sched.step()
        losses.append(loss.item())
        if not resume and step + 1 == N_STEPS:
            save_checkpoint(root, step + 1, pc, model=model, optimizer=opt, scheduler=sched,
                            extra={"step": step + 1, "data_rng": data.get_state()}, keep_last=2)
    # numpy copies: pickled by value through the result queue, compared bit for bit by the parent
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return {"rank": rank, "losses": losses[-N_STEPS:], "weights": weights, "lr": sched.get_last_lr()}


@pytest.mark.slow
def test_resume_in_fresh_processes_is_bit_identical(tmp_path):
    full = run_distributed(_toy_run, DP * TP, str(tmp_path), False)
    meta = read_meta(tmp_path / f"step_{N_STEPS}")
    assert meta["layout"] == {"dp": DP, "tp": TP, "pp": 1} and meta["world_size"] == 4
    assert sorted(f["name"] for f in meta["files"]) == [
        f"pp0_dp{d}_tp{t}.pt" for d in range(DP) for t in range(TP)]

    resumed = run_distributed(_toy_run, DP * TP, str(tmp_path), True)
    for a, b in zip(full, resumed):
        assert a["rank"] == b["rank"]
        assert len(b["losses"]) == N_STEPS and a["losses"] == b["losses"]
        assert a["weights"].keys() == b["weights"].keys()
        for k in a["weights"]:
            assert torch.equal(torch.from_numpy(a["weights"][k]), torch.from_numpy(b["weights"][k])), k
        assert a["lr"] == b["lr"]
    # Sanity: the toy run really trains and replicas/shards differ where they should.
    assert full[0]["losses"] != full[2]["losses"]  # different DP data
    assert not np.array_equal(full[0]["weights"]["up.weight"], full[1]["weights"]["up.weight"])  # TP shards
    assert np.array_equal(full[0]["weights"]["up.weight"], full[2]["weights"]["up.weight"])  # DP replicas


def test_a_full_disk_is_named_as_such(ctx, tmp_path, monkeypatch):
    # case 8: torch.save reports ENOSPC as "unexpected pos ..." with the OSError only in the chained traceback
    import errno

    def full(obj, f, *a, **kw):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 20800 vs 20694") from e

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match=r"cannot write .*pp0_dp0_tp0.pt.part: No space left on device "
                                              r"\(errno 28\); free space there or set checkpoints.dir"):
        _save(tmp_path, 1, ctx, _make(0))
    assert list_checkpoints(tmp_path) == []
