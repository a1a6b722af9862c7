"""The planner's memory as the target device allocates it (issue 39): `python -m nanotron_ext.plan --device cuda`
(the default) plans RMSNorm as CUDA's fused kernel keeps it, `--device cpu` as torch decomposes it on CPU.

References, not derived from the planner: torch's autograd formula for aten::_fused_rms_norm (derivatives.yaml:
the backward reads input, weight and rstd = result1, so autograd saves those and nothing else) against the
composite rms_norm that CPU and meta run (pow, mean, rsqrt, x * rstd, then * weight: autograd also keeps the
normalised x * rstd, fp32); torch's SDPA dispatch on CUDA (sdp_utils.cpp: flash and cuDNN take fp16 / bf16 only,
memory-efficient attention equal head counts only, so fp32 with grouped kv heads runs the math path).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "config_tiny_llama.yaml")  # d = 128, 4 layers, tied, fp32, mbs 8 x seq 128


def _saved_bytes(device: str, fn) -> Dict[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The tensors autograd keeps for backward while `fn` runs under the planner's kernels for `device`, by
    storage."""
    from nanotron_ext.plan.kernels import MetaKernels

    kept: Dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage()._cdata] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), MetaKernels(None, device):
        fn()
    return kept


def _nbytes(kept: Dict[int, torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in kept.values())


def test_fused_rms_norm_keeps_what_cudas_autograd_formula_reads() -> None:
    n, d = 6 * 10, 32  # rows normalised, features
    x = torch.empty(6, 10, d, device="meta", requires_grad=True)
    w = torch.empty(d, device="meta", requires_grad=True)
    run = lambda: F.rms_norm(x, (d,), w, 1e-5)  # noqa: E731
    cuda, cpu = _nbytes(_saved_bytes("cuda", run)), _nbytes(_saved_bytes("cpu", run))
    assert cuda == 4 * n * d + 4 * d + 4 * n  # input, weight, rstd (one fp32 per row)
    assert cpu - cuda == 4 * n * d  # the composite also keeps x * rstd
    from nanotron_ext.plan.kernels import MetaKernels

    with MetaKernels(None, "cuda"):  # the fused backward returns both gradients
        F.rms_norm(x, (d,), w, 1e-5).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_cuda_attention_in_fp32_with_grouped_kv_heads_is_planned_on_its_math_path() -> None:
    b, h, kv, s, hd = 2, 4, 2, 16, 8
    q = torch.empty(b, h, s, hd, device="meta", requires_grad=True)
    k = torch.empty(b, kv, s, hd, device="meta", requires_grad=True)
    v = torch.empty(b, kv, s, hd, device="meta", requires_grad=True)
    run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    scores = b * h * s * s * 4  # the fp32 attention weights, kept for backward (by storage: bmm views them)

    def keeps_scores(device: str, fn) -> bool:  # type: ignore[no-untyped-def]
        return any(t.untyped_storage().nbytes() == scores for t in _saved_bytes(device, fn).values())

    assert keeps_scores("cuda", run)
    assert not keeps_scores("cpu", run)  # CPU's fused flash kernel: output + log-sum-exp
    with_bf16 = lambda: F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),  # noqa: E731
                                                       is_causal=True, enable_gqa=True)
    assert not keeps_scores("cuda", with_bf16)  # flash attention


def _plan_json(tmp_path: Path, name: str, sets: List[str], *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    got = subprocess.run([sys.executable, "-m", "nanotron_ext.plan", "--config-file", TINY, "--rank", "0",
                          "--json", str(out), *[a for s in sets for a in ("--set", s)], *args],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_cuda_plan_is_the_cpu_plan_less_every_norms_normalised_output(tmp_path: Path) -> None:
    """The tiny model with equal head counts (attention fused on both devices) under AFAB, whose 2 micro-batches
    are all in flight at the peak: the CUDA plan's peak is the CPU plan's less 4 N d bytes per norm (2 per layer +
    the final one) and micro-batch (N = tokens per micro-batch); the plan says which device it is for."""
    sets = ["parallelism.dp=1", "model.num_kv_heads=4", "parallelism.pp_engine=afab"]
    cuda = _plan_json(tmp_path, "cuda", sets)  # the default
    cpu = _plan_json(tmp_path, "cpu", sets, "--device", "cpu")
    assert (cuda["device"], cpu["device"]) == ("cuda", "cpu")
    norms, in_flight, n, d = 2 * 4 + 1, 2, 8 * 128, 128
    assert cpu["ranks"][0]["peak_bytes"] - cuda["ranks"][0]["peak_bytes"] == norms * in_flight * 4 * n * d
    assert cpu["ranks"][0]["parameter_bytes"] == cuda["ranks"][0]["parameter_bytes"]
