"""Unsharded building blocks of the Llama family: RMSNorm, rotary embedding, causal attention core."""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from nanotron import distributed as dist
from nanotron.parallel.tensor_parallel.distributed_differentiable_primitives import differentiable_identity
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

_HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, statistics in fp32 (torch's F.rms_norm does the math).

    `shared_across` names a TP group whose ranks apply this same weight to *different* data
    (e.g. qk-norm over each rank's own heads): its gradient is then summed over that group.
    """

    def __init__(self, dim: int, eps: float, shared_across: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.shared_across = shared_across

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.shared_across is not None:
            weight = differentiable_identity(weight, group=self.shared_across)
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the Llama 'rotate half' convention; tables are rebuilt per device, not saved."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, heads, head_dim]."""
        seq = x.shape[1]
        cos, sin = self.cos[:seq, None, :], self.sin[:seq, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """q: [b, s, hq, hd], k/v: [b, s, hkv, hd] (hkv divides hq) -> [b, s, hq, hd].

    flash-attn when requested/available on CUDA with half precision; torch SDPA otherwise, with its cuDNN backend
    alone for backend "cudnn" (CUDA only).
    """
    use_flash = backend == "flash" or (
        backend == "auto" and _HAS_FLASH and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    )
    if use_flash:
        if not _HAS_FLASH:
            raise RuntimeError("model.attention='flash' but flash_attn is not installed (pip install '.[flash]')")
        # optional (`flash` extra, CUDA only)
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, causal=True)
    if backend == "cudnn" and not q.is_cuda:
        raise RuntimeError("model.attention='cudnn' is torch SDPA's cuDNN backend, which needs a CUDA device; "
                           "use 'auto' or 'sdpa' here")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if backend == "cudnn" else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=k.shape[2] != q.shape[2]
        )
    return out.transpose(1, 2)
