"""Model FLOPs per token and MFU (the PaLM appendix B accounting)."""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from nanotron_ext.config.schema import ModelConfig
from nanotron_ext.parallel.shards import full_shape

# dense bf16 tensor-core peaks (TFLOP/s) of GPUs people train on; MFU needs the device's peak
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def matmul_weights(named_params: Iterable[Tuple[str, torch.Tensor]], tied_head: bool) -> int:
    """Unsharded size of the 2-D weights used in matmuls. The embedding is a lookup, not a matmul,
    but a tied head multiplies by that same weight, which named_parameters() lists only once."""
    total = 0
    for name, param in named_params:
        if param.ndim != 2:
            continue
        if "token_embedding" not in name or tied_head:
            total += full_shape(param).numel()
    return total


def flops_per_token(cfg: ModelConfig, matmul_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus causal-attention score/value products."""
    return 6.0 * matmul_params + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len


def device_peak_tflops(override: Optional[float]) -> Optional[float]:
    """The configured peak, else a known GPU's bf16 peak, else None (CPU: MFU is not reported)."""
    if override is not None:
        return override
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in PEAK_BF16_TFLOPS.items():
            if key in name:
                return peak
    return None


def mfu(tokens_per_s_per_device: float, flops_token: float, peak_tflops: Optional[float]) -> Optional[float]:
    if peak_tflops is None:
        return None
    return tokens_per_s_per_device * flops_token / (peak_tflops * 1e12)
