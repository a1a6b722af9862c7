"""0002: nanotron.distributed.initialize_torch_distributed() on CPU picks gloo and works."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
from _common import check_origin, finish

if __name__ == "__main__":
    check_origin()
    import nanotron.distributed as dist

    assert not torch.cuda.is_available(), "this probe exercises the CPU path"
    dist.initialize_torch_distributed()  # no backend argument: the 0.4 call signature
    assert torch_dist.get_backend() == "gloo", torch_dist.get_backend()
    t = torch.tensor([float(torch_dist.get_rank() + 1)])
    torch_dist.all_reduce(t)
    world = torch_dist.get_world_size()
    assert t.item() == world * (world + 1) / 2, t
    print("initialize_torch_distributed chose gloo; all_reduce ok", flush=True)
    finish(0)
