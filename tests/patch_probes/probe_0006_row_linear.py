"""0006: async TensorParallelRowLinear (REDUCE_SCATTER) at tp=2 matches an unsharded float64 reference."""
from __future__ import annotations

import os

import torch
import torch.distributed as torch_dist
from _common import check_origin, finish, init_gloo

BATCH, IN, OUT = 6, 8, 5
TOL = 1e-5

if __name__ == "__main__":
    assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"  # required by the async backward
    check_origin()
    init_gloo()
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.parallel.tensor_parallel.nn import TensorParallelRowLinear

    pg = torch_dist.group.WORLD
    rank, tp = torch_dist.get_rank(), torch_dist.get_world_size()
    gen = torch.Generator().manual_seed(0)  # identical full tensors on every rank
    x_full = torch.randn(BATCH, IN, generator=gen, dtype=torch.float64)
    w_full = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    b_full = torch.randn(OUT, generator=gen, dtype=torch.float64)
    g_full = torch.randn(BATCH, OUT, generator=gen, dtype=torch.float64)  # upstream gradient

    # Unsharded reference in float64.
    x_ref = x_full.clone().requires_grad_(True)
    w_ref = w_full.clone().requires_grad_(True)
    b_ref = b_full.clone().requires_grad_(True)
    y_ref = x_ref @ w_ref.t() + b_ref
    y_ref.backward(g_full)

    # Row-parallel: weight and input sharded along in_features; output reduce-scattered along batch.
    cols = slice(rank * IN // tp, (rank + 1) * IN // tp)
    rows = slice(rank * BATCH // tp, (rank + 1) * BATCH // tp)
    layer = TensorParallelRowLinear(
        IN, OUT, pg=pg, mode=TensorParallelLinearMode.REDUCE_SCATTER, bias=True, async_communication=True
    )
    with torch.no_grad():
        layer.weight.copy_(w_full[:, cols].float())
        if rank == 0:
            layer.bias.copy_(b_full.float())
    x = x_full[:, cols].float().contiguous().requires_grad_(True)
    y = layer(x)
    y.backward(g_full[rows].float())

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a.double(), b, rtol=TOL, atol=TOL)

    errors = []
    if not close(y, y_ref[rows].detach()):
        errors.append("output")
    if not close(x.grad, x_ref.grad[:, cols]):
        errors.append(f"input gradient (max abs err {(x.grad.double() - x_ref.grad[:, cols]).abs().max().item():.3g})")
    if not close(layer.weight.grad, w_ref.grad[:, cols]):
        errors.append("weight gradient")
    if rank == 0 and not close(layer.bias.grad, b_ref.grad):
        errors.append("bias gradient")
    print(f"rank {rank}: mismatched {errors}" if errors else f"rank {rank}: output and gradients match", flush=True)
    finish(1 if errors else 0)
