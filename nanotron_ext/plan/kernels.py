"""What a meta tensor needs to behave like a tensor on the device the plan is for.

- Attention: torch SDPA on meta tensors takes its math path, which materialises the b x h x s x s scores; on
  CPU (and CUDA with flash / memory-efficient / cuDNN attention) a fused kernel keeps one b x h x s log-sum-exp.
  `MetaKernels` sends meta SDPA to the CPU flash kernel (its meta function and autograd formula exist), whose
  memory is the fused kernels' (output + log-sum-exp; grouped-query attention native).
- bf16: torch.autocast has no meta backend. `MetaKernels(torch.bfloat16)` casts at the torch-function level
  as CUDA autocast does (torch.amp's op lists, abridged to the ops this model calls): matmuls, linear and
  attention in bf16, a cast weight cached per step (autocast's cast cache: a bf16 copy of every weight lives
  through the step); softmax, log-softmax, cross-entropy, norms, exp/log/pow/rsqrt and sums in fp32.
- FLOPs: `FLOP_FORMULAS` gives torch's FlopCounterMode the fused CPU kernel's count (torch's formula for the
  other fused SDPA kernels: causal attention counted in full, as PaLM's 12 L d s does).
- The target device (`device`, "cuda" or "cpu"): where their saved tensors differ, ops are planned as that device
  runs them (docs/planning.md lists every op checked). RMSNorm: torch's rms_norm calls aten::_fused_rms_norm, which
  has a CUDA kernel but none for CPU or meta, where it decomposes (CompositeImplicitAutograd) and autograd also keeps
  the fp32 normalised x * rstd for the weight's gradient: 4 B per element more than CUDA, whose autograd formula
  (derivatives.yaml) saves input, weight and rstd only (`FusedRMSNorm`). Attention: SDPA on CUDA has no fused kernel
  for fp32 with grouped kv heads (flash and cuDNN take fp16 / bf16 only, memory-efficient no GQA): its math path
  then materialises the scores, and the meta math path is planned.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
T = torch.Tensor

LOWER = {F.linear, torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm,
         torch.addmm, T.addmm, torch.baddbmm, T.baddbmm, torch.einsum, F.scaled_dot_product_attention}
FP32 = {F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax, T.log_softmax, F.cross_entropy,
        F.nll_loss, F.layer_norm, F.group_norm, F.rms_norm, F.normalize, torch.exp, T.exp, torch.log, T.log,
        torch.pow, T.pow, T.__pow__, torch.rsqrt, T.rsqrt, torch.sum, T.sum, torch.cumsum, T.cumsum,
        torch.norm, T.norm, torch.linalg.vector_norm}
DEVICES = ("cuda", "cpu")


class MetaKernels(TorchFunctionMode):
    """Fused attention for meta SDPA; with `dtype`, autocast's casts; the fused RMSNorm on `device` cuda (module
    docstring)."""

    def __init__(self, dtype: Optional[torch.dtype] = None, device: str = "cuda") -> None:
        super().__init__()
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: one of {', '.join(DEVICES)}")
        self.dtype = dtype
        self.device = device
        self.cache: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __enter__(self) -> "MetaKernels":
        self._depth = getattr(self, "_depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.cache.clear()  # autocast drops its cast weights when its region ends
        super().__exit__(*exc)

    def _lower(self, x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == torch.float32):
            return x
        if isinstance(x, torch.nn.Parameter) and x.requires_grad:  # a weight: cast once per step, as autocast caches
            cast = self.cache.get(x)
            if cast is None:
                cast = self.cache[x] = x.to(self.dtype)
            return cast
        return x.to(self.dtype)

    def _backward(self, tensor: torch.Tensor, gradient: Optional[torch.Tensor] = None,
                  retain_graph: Optional[bool] = None, create_graph: bool = False, inputs: Any = None) -> None:
        """Tensor.backward run by the autograd engine with this mode on (torch.autograd.backward would hand the call
        to this mode again, which is off while it runs)."""
        with self:
            grad = torch.ones_like(tensor) if gradient is None else gradient
            torch.autograd.graph._engine_run_backward(
                (tensor,), (grad,), create_graph if retain_graph is None else retain_graph, create_graph,
                tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)

    @staticmethod
    def _widen(x: Any) -> Any:
        return x.float() if isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) else x

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is T.backward:  # a mode is off inside its own handler: the backward (and its recompute) needs it on
            return self._backward(*args, **kwargs)
        if self.dtype is not None:
            if func in LOWER:
                args, kwargs = tree_map(self._lower, args), tree_map(self._lower, kwargs)
            elif func in FP32:
                args, kwargs = tree_map(self._widen, args), tree_map(self._widen, kwargs)
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta" and not self._math_sdpa(
                *args, **kwargs):
            return _fused_attention(*args, **kwargs)
        if func is F.rms_norm and self.device == "cuda" and args[0].device.type == "meta":
            return _rms_norm(*args, **kwargs)
        return func(*args, **kwargs)

    def _math_sdpa(self, query: torch.Tensor, key: torch.Tensor, *args: Any, enable_gqa: bool = False,
                   **kwargs: Any) -> bool:
        """CUDA's SDPA takes its math path: fp32 (flash and cuDNN: fp16 / bf16 only) with grouped kv heads
        (memory-efficient attention: equal head counts only; torch's sdp_utils.cpp)."""
        return (self.device == "cuda" and query.dtype == torch.float32 and enable_gqa
                and query.shape[-3] != key.shape[-3])


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    if attn_mask is not None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, scale=scale)[0]


class FusedRMSNorm(torch.autograd.Function):
    """aten::_fused_rms_norm as CUDA runs it, on meta tensors (no values: only what is allocated and kept matters).
    Forward: the kernel's outputs, y (input's dtype) and rstd (fp32 for fp32 / bf16 / fp16, one per normalised row);
    autograd keeps input, weight and rstd (derivatives.yaml's formula reads only those); backward: the fused
    backward kernel's outputs, d input and d weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Optional[torch.Tensor], ndim: int) -> torch.Tensor:  # type: ignore[override]
        stats = x.shape[:x.dim() - ndim] + (1,) * ndim
        rstd = x.new_empty(stats, dtype=torch.promote_types(x.dtype, torch.float32))
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        x, weight, _ = ctx.saved_tensors
        return (torch.empty_like(x) if ctx.needs_input_grad[0] else None,
                torch.empty_like(weight) if ctx.needs_input_grad[1] else None, None)


def _rms_norm(x: torch.Tensor, normalized_shape: Any, weight: Optional[torch.Tensor] = None,
              eps: Optional[float] = None) -> torch.Tensor:
    """F.rms_norm on CUDA: the fused kernel, except where torch's rms_norm falls back to the composite (a weight
    of another dtype, complex input; layer_norm.cpp)."""
    if (weight is not None and weight.dtype != x.dtype) or x.is_complex():
        return F.rms_norm(x, normalized_shape, weight, eps)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return FusedRMSNorm.apply(x, weight, len(shape))


def _sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                         **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


FLOP_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops}
"""FlopCounterMode(custom_mapping=...) for the fused CPU attention kernel, which torch's table leaves out."""
