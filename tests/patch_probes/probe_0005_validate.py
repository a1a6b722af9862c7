"""0005: AllForwardAllBackwardPipelineEngine.validate_batch_iter on a one-rank pipeline."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
from _common import check_origin, finish, init_gloo
from torch import nn


class SquaredError(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([2.0, -1.0]))

    def forward(self, x: torch.Tensor) -> dict:
        return {"loss": ((x * self.w) ** 2).sum()}


class TinyPipelineModel(nn.Module):
    def __init__(self, pg: torch_dist.ProcessGroup) -> None:
        super().__init__()
        from nanotron.parallel.pipeline_parallel.block import PipelineBlock
        from nanotron.parallel.pipeline_parallel.p2p import P2P

        self.block = PipelineBlock(
            p2p=P2P(pg=pg, device=torch.device("cpu")),
            module_builder=SquaredError,
            module_kwargs={},
            module_input_keys={"x"},
            module_output_keys={"loss"},
        )
        self.block.build_and_set_rank(0)

    def forward(self, x: torch.Tensor) -> dict:
        return self.block(x=x)


if __name__ == "__main__":
    check_origin()
    init_gloo()
    from nanotron.parallel.pipeline_parallel.engine import AllForwardAllBackwardPipelineEngine

    model = TinyPipelineModel(torch_dist.group.WORLD)
    batch = [{"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([3.0, 0.0])}]
    engine = AllForwardAllBackwardPipelineEngine()
    outputs = engine.validate_batch_iter(model=model, batch=iter(batch), nb_microbatches=2)
    losses = [o["loss"].item() for o in outputs]
    assert losses == [(4.0 + 4.0) / 2, 36.0 / 2], losses  # loss / nb_microbatches
    assert model.block.pp_block.w.grad is None, "validation must not backpropagate"

    # The training path (grad enabled) must still register the loss for backward.
    engine.train_batch_iter(model=model, pg=torch_dist.group.WORLD, batch=iter(batch), nb_microbatches=2,
                            grad_accumulator=None)
    # d/dw of sum_mb ((x*w)^2).sum() / 2 = sum_mb x^2 * w = [1*2 + 9*2, 4*(-1) + 0]
    assert torch.allclose(model.block.pp_block.w.grad, torch.tensor([20.0, -4.0])), model.block.pp_block.w.grad
    print("validate_batch_iter and train_batch_iter ok", flush=True)
    finish(0)
