"""0007: nanotron.distributed.register_comm_hook sees collectives and nanotron's P2P with exact byte counts."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as torch_dist
from _common import check_origin, finish, init_gloo


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


if __name__ == "__main__":
    check_origin()
    init_gloo()
    import nanotron.distributed as dist
    from nanotron.parallel.pipeline_parallel.p2p import P2P

    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    pg = dist.new_group(ranks=list(range(world)))
    calls: List[Tuple[str, int, Optional[torch_dist.ProcessGroup], Optional[int]]] = []
    remove = dist.register_comm_hook(lambda op, n, group, peer: calls.append((op, n, group, peer)))

    # Collectives: reported once each, with the input payload's size.
    t = torch.arange(6, dtype=torch.float32) + rank
    dist.all_reduce(t, group=pg)
    assert torch.equal(t, 2 * torch.arange(6, dtype=torch.float32) + 1)
    shard = torch.full((3, 2), float(rank), dtype=torch.bfloat16)
    gathered = torch.empty(3 * world, 2, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(gathered, shard, group=pg)
    assert gathered[3:].eq(1).all()
    dist.all_gather_into_tensor(output_tensor=gathered, input_tensor=shard, group=pg)  # keywords: same payload
    expected = [("all_reduce", nbytes(t), pg, None)] + [("all_gather", nbytes(shard), pg, None)] * 2
    assert calls == expected, (calls, expected)

    # Point-to-point through nanotron's P2P: shape/stride headers, then the data, each reported.
    calls.clear()
    p2p = P2P(pg=pg, device=torch.device("cpu"))
    payload = torch.arange(12, dtype=torch.float64).view(3, 4)
    header = 7 * 8 + 2 * payload.dim() * 8  # first metadata (7 int64) + shape and stride (int64)
    peer = 1 - rank
    if rank == 0:
        p2p.send_tensors([payload], to_rank=1)
        ops = {"send"}
    else:
        (received,) = p2p.recv_tensors(num_tensors=1, from_rank=0)
        assert torch.equal(received, payload)
        ops = {"recv"}
    assert {c[0] for c in calls} == ops and all(c[2] is pg and c[3] == peer for c in calls), calls
    assert [c[1] for c in calls] == [7 * 8, 2 * payload.dim() * 8, nbytes(payload)], calls
    assert sum(c[1] for c in calls) == header + nbytes(payload)

    # ZeRO-1's coalesced collectives, called with keywords only as nanotron's optimizer does:
    # the reported payload is the input lists, not the first keyword (the output).
    calls.clear()
    inputs = [[torch.ones(4) * rank, torch.ones(4)], [torch.ones(2)] * world]  # [param][group_rank]: world == 2
    outputs = [torch.empty(4), torch.empty(2)]
    dist.reduce_scatter_coalesced(output_tensor_list=outputs, input_tensor_lists=inputs, group=pg)
    assert torch.equal(outputs[0], torch.full((4,), 1.0 if rank == 0 else 2.0))
    assert torch.equal(outputs[1], torch.full((2,), 2.0))
    local = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank))]
    gathered_lists = [[torch.empty_like(t) for _ in range(world)] for t in local]
    dist.all_gather_coalesced(output_tensor_lists=gathered_lists, input_tensor_list=local, group=pg)
    assert all(torch.equal(g[r], torch.full_like(g[r], r)) for g in gathered_lists for r in range(world))
    expected = [
        ("reduce_scatter", sum(nbytes(t) for ts in inputs for t in ts), pg, None),
        ("all_gather", sum(nbytes(t) for t in local), pg, None),
    ]
    assert calls == expected, (calls, expected)

    # Removing the hook stops the reports.
    remove()
    calls.clear()
    dist.all_reduce(t, group=pg)
    assert calls == [], calls
    print(f"rank {rank}: comm hooks ok", flush=True)
    finish(0)
