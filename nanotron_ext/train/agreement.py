"""What every rank of a job must agree on, so that none is left waiting in a collective for a rank that left.

Rank 0 alone writes the run folder (config.yaml, metrics, progress, the summary); when such a write fails
(a full disk) the other ranks used to go on into the next collective and die there with a gloo traceback. Here
rank 0's failure reaches every rank, which all stop with the same one-line error naming the file:

- `on_main(write)`: a one-off write, shared at once (one broadcast);
- `main_io(write, ...)`: a per-step write, kept until the next `control` all-reduce;
- `control(flag, weights_sq)`: the one all-reduce per step (tagged `control` in the comm ledger) that carries
  "stop" flags, rank 0's pending write error and the squared norm of all weights (the divergence guard's);
  `control_on_device` is the same all-reduce left on the device, read a step later (the device guard's).

Any rank's error, raised on all: `gather_or_raise(error, group, raise_as)` (checkpoint save and load, the run
folder's claim, a restored state, the agreed checkpoint, inference's shard reads). And the control messages under
it: `gather_objects` (every rank's object, outside the comm ledger) and `host_index` (this rank's host).
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as torch_dist
from nanotron import distributed as dist

from nanotron_ext.errors import TrainingError, os_error_line

T = TypeVar("T")


def gather_objects(obj: Any, group: Any) -> List[Any]:
    """Every rank's `obj` (control messages: not training traffic, so not in the comm ledger)."""
    out: List[Any] = [None] * torch_dist.get_world_size(group)
    torch_dist.all_gather_object(out, obj, group=group)
    return out


def host_index() -> int:
    """This process's host: torchrun's node rank (GROUP_RANK; 0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def gather_or_raise(error: Optional[str], group: Any, raise_as: Callable[[List[Tuple[int, str]]], BaseException],
                    *, value: Any = None, cause: Optional[BaseException] = None) -> List[Any]:
    """Collective over `group` (None: the world): every rank's `value`, unless some rank's `error` is set; then
    every rank raises `raise_as(failures)` (failures: [(rank, error)], rank order), from `cause` (this rank's own
    exception, if any), so no rank is left waiting in a later collective for one that left."""
    seen = gather_objects((value, error), group)
    failed = [(r, e) for r, (_, e) in enumerate(seen) if e is not None]
    if failed:
        raise raise_as(failed) from cause
    return [v for v, _ in seen]


class RankAgreement:
    def __init__(self, world_pg: Any, device: torch.device, ledger: Any, is_main: bool) -> None:
        self.world_pg, self.device, self.ledger, self.is_main = world_pg, device, ledger, is_main
        self.io_error: Optional[OSError] = None  # rank 0's failed per-step write, until the next control

    def control(self, flag: bool, weights_sq: torch.Tensor) -> Tuple[bool, float]:
        """(`flag` on any rank, the sum of `weights_sq` over ranks); raises rank 0's pending write error on
        every rank. Every rank must call it at the same point."""
        flag_t = torch.full((), float(flag), dtype=torch.float64, device=self.device)
        stop, io_failed, total_sq = self.control_on_device(flag_t, weights_sq).tolist()
        if io_failed:
            self.raise_shared(self.io_error)
        return bool(stop), total_sq

    def control_on_device(self, flag: torch.Tensor, weights_sq: torch.Tensor) -> torch.Tensor:
        """`control` without reading anything back (the device guard's, nanotron_ext.train.step_guard): the same
        all-reduce, whose float64 device result [flags > 0 on any rank, rank 0's write failed > 0, summed
        `weights_sq`] the caller reads later, then calls `raise_shared(self.io_error)` if the second is set."""
        io_failed = torch.full((), float(self.io_error is not None), dtype=torch.float64, device=self.device)
        t = torch.stack([flag.to(device=self.device, dtype=torch.float64), io_failed,
                         weights_sq.to(device=self.device, dtype=torch.float64)])
        with self.ledger.tag("control"):  # counted like every byte, under world all_reduce:control
            dist.all_reduce(t, group=self.world_pg)
        return t

    def main_io(self, write: Callable[..., object], *args: object, **kwargs: object) -> None:
        """Rank 0's per-step write (metrics, progress): a failure is kept for the next `control`."""
        if self.is_main and self.io_error is None:
            try:
                write(*args, **kwargs)
            except OSError as e:
                self.io_error = e

    def on_main(self, write: Callable[[], T]) -> Optional[T]:
        """Run `write` on rank 0 and share how it went (collective): every rank raises its error."""
        result, error = None, None
        if self.is_main:
            try:
                result = write()
            except OSError as e:
                error = e
        self.raise_shared(error)
        return result

    def raise_shared(self, error: Optional[OSError]) -> None:
        """Collective: rank 0's write error (or None) becomes the same TrainingError on every rank."""
        box = [None if error is None else os_error_line(error)]
        torch_dist.broadcast_object_list(box, src=0, group=self.world_pg)  # control, not training traffic
        if box[0] is not None:
            raise TrainingError(box[0]) from error
