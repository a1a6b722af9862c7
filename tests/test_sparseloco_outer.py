"""SparseLoCo's outer loop on gloo processes:

- with k = chunk size, no quantisation, H = 1 and outer lr 1.0 the outer step is parameter averaging,
  which for plain SGD inner steps equals data-parallel SGD on the averaged gradient (the equality that
  holds; with AdamW inner steps it would not, each replica keeps its own moments): checked against
  dp_sync=allreduce with the same SGD, and k = 32 must differ from it;
- after every outer sync all replicas are bit-identical (and not before), and one sync's DP bytes (the
  ledger's all_gather) equal the closed form written here and are <= 1% of a dense gradient all-reduce
  measured by the same ledger;
- the simulated-replica mode (M = 2 in one process, AdamW inner steps) equals the distributed mode at dp = 2
  bit for bit.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.one_step import fixed_micro_batches, small_config

SEQ, MB, N_MICRO = 8, 2, 2
SMALL = dict(vocab_size=320, hidden_size=32, ffn_size=48, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16)
# every 2-D weight a whole number of 64 x 64 tiles, as at paper scale (the 1-D norms are runs of 128)
TILED = dict(vocab_size=1024, hidden_size=128, ffn_size=384, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=16)


def _config(model: dict, dp_sync: str, sparseloco: dict):
    return small_config({**model, "tie_embeddings": False}, dp=2, seq=SEQ, mb=MB, n_micro=N_MICRO,
                        parallelism={"dp_sync": dp_sync}, sparseloco=sparseloco)


def _micro(seed: int, vocab: int) -> List[Dict[str, torch.Tensor]]:
    return fixed_micro_batches(N_MICRO, MB, SEQ, vocab, seed)


def _train(model_kw: dict, dp_sync: str, sparseloco: dict, steps: int, inner: str, dp: int = 2) -> dict:
    """`steps` inner steps on this rank's replica; per step: checksum, DP bytes by op; final weights."""
    import nanotron.distributed as dist

    from nanotron_ext.models.build import build_dp_sync, build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.comm import get_ledger
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = build_parallel_context(dp=dp, tp=1, pp=1, backend="gloo")
    cfg = _config(model_kw, dp_sync, sparseloco)
    torch.manual_seed(0)
    model = build_model(cfg, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.5) if inner == "sgd" else build_optimizer(model,
                                                                                             cfg.optimizer, ctx.tp_pg)
    sync = build_dp_sync(cfg, model, ctx)
    rank = dist.get_rank(ctx.dp_pg)
    out: dict = {"checksum": [], "dp": [], "hooks": []}
    if dp_sync == "sparseloco":
        sync.hooks.append(lambda replica, params, moment: out["hooks"].append((replica, moment, len(params))))
    for step in range(1, steps + 1):
        get_ledger().reset()
        forward_backward(model, make_engine("1f1b"), _micro(100 * step + rank, model_kw["vocab_size"]), ctx, sync)
        opt.step()
        opt.zero_grad()
        sync.after_step(step)
        out["dp"].append({op: v["bytes"] for op, v in get_ledger().snapshot().get("dp", {}).items()})
        out["checksum"].append(float(sum(p.double().sum() for p in model.parameters())))
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if dp_sync == "sparseloco":  # a dense gradient all-reduce of the same model, measured by the same ledger
        from nanotron_ext.parallel.data_parallel import allreduce_gradients_

        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        get_ledger().reset()
        allreduce_gradients_(model.parameters(), ctx.dp_pg)
        out["dense_bytes"] = get_ledger().bytes("dp")
        out["shapes"] = [tuple(p.shape) for _, p in model.named_parameters()]
    return out


FULL_K = {"inner_steps": 1, "chunk": 4096, "topk": 4096, "value_dtype": "fp32", "outer_lr": 1.0, "quant_bits": 0}


@pytest.mark.slow
def test_full_k_h1_equals_data_parallel_sgd() -> None:
    dp = run_distributed(_train, 2, SMALL, "allreduce", {}, 3, "sgd")
    sl = run_distributed(_train, 2, SMALL, "sparseloco", FULL_K, 3, "sgd")
    sparse = run_distributed(_train, 2, SMALL, "sparseloco", {**FULL_K, "topk": 32}, 3, "sgd")
    assert dp[0]["checksum"][-1] != dp[0]["checksum"][0]  # it trained
    moved = 0.0
    for name, w in dp[0]["weights"].items():
        torch.testing.assert_close(sl[0]["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((sparse[0]["weights"][name] - w).abs().max()))
    assert moved > 1e-4, "top-32 of 4096 must not reproduce dense data parallelism"


@pytest.mark.slow
def test_replicas_identical_after_each_sync_and_bytes_under_one_percent() -> None:
    cfg = {"inner_steps": 2, "chunk": 4096, "topk": 32, "value_dtype": "bf16", "index_bits": 12}
    a, b = run_distributed(_train, 2, TILED, "sparseloco", cfg, 4, "adamw")
    n_params = len(a["shapes"])
    # per sync: this replica before encoding, the global copies after the outer step, this replica synced
    assert b["hooks"] == [(1, "before_encode", n_params), (1, "after_apply", n_params), (1, "after_sync", n_params)] * 2
    for step in range(4):
        same = a["checksum"][step] == b["checksum"][step]
        assert same == (step % 2 == 1), (step, a["checksum"][step], b["checksum"][step])
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    # closed form: 2-D (r, c) -> (r/64)(c/64) tiles of 32 kept; 1-D n -> one run of n (<= 4096) with 32 kept;
    # each kept entry: a bf16 value (2 B) and a 12-bit index; indices packed in one stream
    kept = 0
    for shape in a["shapes"]:
        if len(shape) == 2:
            assert shape[0] % 64 == 0 and shape[1] % 64 == 0
            kept += (shape[0] // 64) * (shape[1] // 64) * 32
        else:
            kept += -(-shape[0] // 4096) * 32
    closed = kept * 2 + (kept * 12 + 7) // 8
    for step in (1, 3):  # sync steps: the payload's all_gather, plus the logged loss's 4-byte all-reduce
        assert a["dp"][step] == {"all_gather": closed, "all_reduce": 4}, a["dp"][step]
    assert a["dp"][0] == {"all_reduce": 4}  # inner steps: no gradient traffic
    dense = a["dense_bytes"]
    assert dense == 4 * sum(torch.Size(s).numel() for s in a["shapes"])
    assert closed <= 0.01 * dense, (closed, dense, closed / dense)


def _simulated(model_kw: dict, sparseloco: dict, steps: int) -> dict:
    """M = 2 replicas in this one process, fed the data ranks 0 and 1 get in `_train`."""
    from nanotron_ext.models.build import build_model
    from nanotron_ext.optim.build import build_optimizer
    from nanotron_ext.parallel.context import build_parallel_context
    from nanotron_ext.sparseloco.simulate import SimulatedReplicas
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    ctx = build_parallel_context(dp=1, tp=1, pp=1, backend="gloo")
    cfg = _config(model_kw, "sparseloco", sparseloco)
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model(cfg, ctx))
        opts.append(build_optimizer(models[-1], cfg.optimizer, ctx.tp_pg))
    sim = SimulatedReplicas(models, cfg.sparseloco)
    for step in range(1, steps + 1):
        for r, (m, opt) in enumerate(zip(models, opts)):
            forward_backward(m, make_engine("1f1b"), _micro(100 * step + r, model_kw["vocab_size"]), ctx)
            opt.step()
            opt.zero_grad()
        sim.after_step(step)
    return {"weights": [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models],
            "sent": sim.sent_bytes}


@pytest.mark.slow
@pytest.mark.parametrize("extra",
                         [{}, {"quant_bits": 2, "aggregate": "senders", "outer_momentum": 0.5, "outer_lr": 0.8}])
def test_simulated_replicas_equal_distributed(extra: dict) -> None:
    cfg = {"inner_steps": 2, "chunk": 4096, "topk": 32, **extra}
    dist_runs = run_distributed(_train, 2, SMALL, "sparseloco", cfg, 5, "adamw")  # 2 syncs, then one inner step
    sim = run_distributed(_simulated, 1, SMALL, cfg, 5)[0]
    assert len(sim["sent"]) == 2
    for r in range(2):
        for name, w in dist_runs[r]["weights"].items():
            assert torch.equal(sim["weights"][r][name], w), (r, name)
    w0, w1 = sim["weights"]
    assert any(not torch.equal(w0[n], w1[n]) for n in w0), "step 5 is an inner step: replicas differ again"


def _outer_steps_against_torch_sgd(nesterov: bool, torch_nesterov: bool) -> List[float]:
    """Three outer steps of SparseLoCoOuter (every entry sent in fp32, no error carried: DiLoCo's dense sync) from
    two replicas against torch.optim.SGD on a copy of the global weights whose .grad is the mean pseudo-gradient
    (global - local) computed here; returns the largest difference of each step."""
    from nanotron_ext.sparseloco.config import SparseLoCoConfig
    from nanotron_ext.sparseloco.outer import SparseLoCoOuter

    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(64, 64, generator=gen), torch.randn(100, generator=gen)]
    cfg = SparseLoCoConfig(chunk=4096, topk=4096, value_dtype="fp32", beta=0.0, outer_lr=0.7, outer_momentum=0.9,
                           outer_nesterov=nesterov)
    outer = SparseLoCoOuter(start, cfg)
    errors = [outer.new_error(), outer.new_error()]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=torch_nesterov)
    worst = []
    for _ in range(3):
        locals_ = [[g - 0.1 * torch.randn(g.shape, generator=gen) for g in outer.global_params] for _ in errors]
        for p, l0, l1 in zip(ref, *locals_):
            p.grad = ((p.detach() - l0) + (p.detach() - l1)) / 2
        sgd.step()
        outer.apply([outer.encode(loc, e) for loc, e in zip(locals_, errors)])
        worst.append(max(float((g - p.detach()).abs().max()) for g, p in zip(outer.global_params, ref)))
        for g, p in zip(outer.global_params, ref):  # next step from the same point, so errors do not compound
            g.copy_(p.detach())
    return worst


@pytest.mark.parametrize("nesterov", [False, True])
def test_outer_momentum_is_torch_sgd(nesterov: bool) -> None:
    """sparseloco.outer_nesterov (DiLoCo's outer Nesterov) and the heavy-ball default are torch.optim.SGD's update
    on the pseudo-gradient; each differs from the other by far more than rounding."""
    worst = _outer_steps_against_torch_sgd(nesterov, nesterov)
    assert max(worst) < 1e-6, worst
    assert min(_outer_steps_against_torch_sgd(nesterov, not nesterov)) > 1e-2  # the check can tell them apart


def test_outer_nesterov_needs_momentum() -> None:
    from nanotron_ext.config.checks import ConfigError
    from nanotron_ext.sparseloco.config import SparseLoCoConfig

    with pytest.raises(ConfigError, match="sparseloco.outer_nesterov"):
        SparseLoCoConfig(outer_nesterov=True)
