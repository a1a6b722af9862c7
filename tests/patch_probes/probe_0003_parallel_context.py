"""0003 (with 0002): ParallelContext(tp=2) on CPU initialises torch.distributed itself, with gloo."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
from _common import check_origin, finish

if __name__ == "__main__":
    check_origin()
    from nanotron.parallel import ParallelContext

    assert not torch.cuda.is_available(), "this probe exercises the CPU path"
    assert not torch_dist.is_initialized()
    pc = ParallelContext(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1)
    assert torch_dist.get_backend() == "gloo", torch_dist.get_backend()
    assert pc.backend == "gloo" and pc.device == torch.device("cpu"), (pc.backend, pc.device)
    assert pc.tp_pg.size() == 2 and pc.pp_pg.size() == 1 and pc.dp_pg.size() == 1
    t = torch.tensor([float(torch_dist.get_rank(pc.tp_pg) + 1)])
    torch_dist.all_reduce(t, group=pc.tp_pg)
    assert t.item() == 3.0, t
    print("ParallelContext on gloo: tp_pg all_reduce ok", flush=True)
    finish(0)
