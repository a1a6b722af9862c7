"""One SparseLoCo outer step on plain torch modules (simulated replicas, one process) against a reference
written here with explicit tile loops: error feedback, top-k per 64 x 64 tile, bf16 values, mean over all
replicas or over senders, outer SGD with momentum; and the per-replica hooks' calls."""
from __future__ import annotations

from typing import List

import pytest
import torch

from nanotron_ext.sparseloco.config import SparseLoCoConfig
from nanotron_ext.sparseloco.simulate import SimulatedReplicas


def _sparsify_reference(acc: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest |acc| of every 64 x 64 tile (a 1-D tensor: of every run of 4096), rounded to bf16."""
    out = torch.zeros_like(acc)
    if acc.dim() == 1:
        for s in range(0, acc.numel(), 4096):
            run = acc[s:s + 4096]
            idx = run.abs().topk(min(k, run.numel())).indices
            out[s:s + 4096][idx] = run[idx].bfloat16().float()
        return out
    for i in range(0, acc.shape[0], 64):
        for j in range(0, acc.shape[1], 64):
            tile = acc[i:i + 64, j:j + 64].reshape(-1)
            idx = tile.abs().topk(k).indices
            flat = torch.zeros_like(tile)
            flat[idx] = tile[idx].bfloat16().float()
            out[i:i + 64, j:j + 64] = flat.reshape(64, 64)
    return out


def _replicas(n: int) -> List[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Linear(128, 64) for _ in range(n)]


@pytest.mark.parametrize("aggregate", ["all", "senders"])
def test_two_outer_steps_match_reference(aggregate: str) -> None:
    cfg = SparseLoCoConfig(inner_steps=1, topk=32, beta=0.9, outer_lr=0.8, outer_momentum=0.5, aggregate=aggregate)
    models = _replicas(3)
    sim = SimulatedReplicas(models, cfg)
    start = [p.detach().clone() for p in models[0].parameters()]
    g = [s.clone() for s in start]
    errors = [[torch.zeros_like(s) for s in start] for _ in models]
    mom = [torch.zeros_like(s) for s in start]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        moved = [[torch.randn(s.shape, generator=gen) * 0.01 for s in start] for _ in models]
        with torch.no_grad():
            for m, steps in zip(models, moved):
                for p, d in zip(m.parameters(), steps):
                    p.sub_(d)
        local = [[p.detach().clone() for p in m.parameters()] for m in models]
        sim.sync()
        for i in range(len(g)):  # the reference outer step, tensor by tensor
            sent = []
            for r in range(len(models)):
                acc = cfg.beta * errors[r][i] + (g[i] - local[r][i])
                sent.append(_sparsify_reference(acc, 32))
                errors[r][i] = acc - sent[-1]
            total = sent[0] + sent[1] + sent[2]
            if aggregate == "all":
                mean = total / 3
            else:
                mean = total / sum((s != 0).float() for s in sent).clamp(min=1)
            mom[i] = cfg.outer_momentum * mom[i] + mean
            g[i] = g[i] - cfg.outer_lr * mom[i]
        for m in models:  # every replica takes the same result
            for p, ref in zip(m.parameters(), g):
                torch.testing.assert_close(p.detach(), ref, rtol=0, atol=1e-6)
        assert all(torch.equal(p0, p1) for m in models[1:] for p0, p1 in zip(models[0].parameters(), m.parameters()))
    assert sim.sent_bytes == [(64 * 128 // 4096 * 32 + 32) * (2 + 1.5)] * 2  # 2 tiles + one run of 64, 32 kept each


def test_hooks_see_each_replica_before_encode_and_after_sync() -> None:
    models = _replicas(2)
    sim = SimulatedReplicas(models, SparseLoCoConfig(inner_steps=2))
    calls = []

    def hook(replica: int, params, moment: str) -> None:
        calls.append((replica, moment))
        if moment == "after_sync":  # e.g. re-project a replica's weights; must see the synced values
            assert all(torch.equal(p, g) for p, g in zip(params, sim.outer.global_params))

    sim.hooks.append(hook)
    sim.after_step(1)
    assert calls == []
    sim.after_step(2)
    # "after_apply" once with the global copies, before any replica takes them
    assert calls == [(0, "before_encode"), (1, "before_encode"), (-1, "after_apply"), (0, "after_sync"),
                     (1, "after_sync")]
