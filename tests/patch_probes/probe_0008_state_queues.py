"""0008: a pipeline batch state owns its queues; validate_batch_iter leaves nothing behind for the next batch."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
from _common import check_origin, finish, init_gloo
from probe_0005_validate import TinyPipelineModel

if __name__ == "__main__":
    check_origin()
    init_gloo()
    from nanotron.parallel.pipeline_parallel.engine import AllForwardAllBackwardPipelineEngine
    from nanotron.parallel.pipeline_parallel.state import PipelineEvalBatchState, PipelineTrainBatchState

    model = TinyPipelineModel(torch_dist.group.WORLD)
    batch = [{"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([3.0, 0.0])}]
    AllForwardAllBackwardPipelineEngine().validate_batch_iter(model=model, batch=iter(batch), nb_microbatches=2)

    # The next batch's state must start empty: validation's forward-only micro-batches are not its own.
    fresh = PipelineTrainBatchState()
    leftovers = {
        name: len(getattr(fresh, name))
        for name in (
            "microbatches_activations_requiring_backward", "microbatches_activations_to_send",
            "microbatches_activations_to_recv", "microbatches_grads_to_send", "microbatches_grads_to_recv",
            "activations_buffer", "grads_buffer",
        )
        if len(getattr(fresh, name))
    }
    assert not leftovers, f"a new PipelineTrainBatchState inherits queued entries: {leftovers}"
    a, b = PipelineEvalBatchState(), PipelineEvalBatchState()
    a.activations_buffer.append(torch.zeros(1))
    assert len(b.activations_buffer) == 0, "PipelineEvalBatchState instances share their queues"
    print("per-instance pipeline state queues ok", flush=True)
    finish(0)
