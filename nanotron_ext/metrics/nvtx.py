"""NVTX ranges for Nsight Systems: real ranges on CUDA, no-ops elsewhere."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_enabled = False


def enable_nvtx(on: bool) -> None:
    global _enabled
    _enabled = on and torch.cuda.is_available()


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    if not _enabled:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
