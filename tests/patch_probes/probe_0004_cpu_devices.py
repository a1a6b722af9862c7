"""0004: synced random state over a gloo group, and FP32GradientAccumulator on a CPU bf16 module."""
from __future__ import annotations

import copy

import torch
import torch.distributed as torch_dist
from _common import check_origin, init_gloo, run_checks
from torch import nn


def fp32_grad_accumulator() -> None:
    from nanotron.optim.gradient_accumulator import FP32GradientAccumulator

    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    acc = FP32GradientAccumulator(named_parameters=model.named_parameters())
    for name, param in model.named_parameters():
        fp32 = acc.parameters[name]["fp32"]
        assert fp32.device.type == "cpu" and fp32.dtype == torch.float32, (fp32.device, fp32.dtype)
        assert torch.equal(fp32, param.float())
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    acc.backward(model(x).float().pow(2).sum())
    reference(x).float().pow(2).sum().backward()
    for name, param in reference.named_parameters():
        assert torch.equal(acc.get_grad_buffer(name), param.grad.float()), name
        assert acc.parameters[name]["fp32"].grad is acc.get_grad_buffer(name)


def synced_random_state() -> None:
    from nanotron.random import get_current_random_state, get_synced_random_state, set_random_state

    rank = torch_dist.get_rank()
    torch.manual_seed(1234 + rank)  # different streams per rank until synced
    state = get_synced_random_state(random_state=get_current_random_state(), pg=torch_dist.group.WORLD)
    set_random_state(state)
    draws = [torch.empty(4) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(draws, torch.rand(4))
    assert all(torch.equal(d, draws[0]) for d in draws), draws
    torch.manual_seed(1234)
    assert torch.equal(draws[0], torch.rand(4)), "the synced state must be rank 0's"


if __name__ == "__main__":
    check_origin()
    init_gloo()
    run_checks([fp32_grad_accumulator, synced_random_state])
