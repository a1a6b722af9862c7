"""Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
from __future__ import annotations

import resource
import sys

import torch


def peak_memory_bytes() -> int:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
