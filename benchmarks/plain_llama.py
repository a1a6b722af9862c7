"""A plain-PyTorch Llama and its training step: the throughput reference of benchmarks/gpu_check.py.

Written by hand on purpose (issue 23): nn.Embedding, nn.Linear, F.rms_norm, torch SDPA, F.cross_entropy,
torch.optim.AdamW and torch.nn.utils.clip_grad_norm_, nothing from nanotron or nanotron_ext. It gets every public
torch feature ours uses (issue 29): the same AdamW implementation (fused on CUDA), and with compile, the same
per-block torch.compile plus a compiled cross-entropy. The tokens/s
ratio of nanotron_ext's model to this one is what our layers cost at TP = PP = 1 (nanotron's TP linears and
pipeline blocks, the comm-ledger hooks, the trainer's step), on the same shape, batch and precision:
pre-norm GQA attention with one fused qkv projection and RoPE ("rotate half"), SwiGLU with one fused
gate/up projection, RMSNorm statistics in fp32, a tied or untied head, fp32 cross-entropy, bf16 autocast
over fp32 weights when the config says bf16, AdamW with decay on matrices only, global-norm clipping.
`load_from` copies a nanotron_ext model's weights, so both start from the same function (gpu_check
compares their first loss before it compares their speed).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int, eps: float, max_seq: int, theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, d // heads, eps
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.outer(torch.arange(max_seq, dtype=torch.float64), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        cos, sin = self.cos[:s, None, :], self.sin[:s, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1).float() * sin).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd, nq, nkv = self.head_dim, self.heads, self.kv_heads
        q, k, v = self.qkv(rms_norm(x, self.attn_norm, self.eps)).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = self.rope(q.view(b, s, nq, hd)), self.rope(k.view(b, s, nkv, hd))
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.view(b, s, nkv, hd).transpose(1, 2),
                                             is_causal=True, enable_gqa=nkv != nq)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, nq * hd))
        gate, up = self.gate_up(rms_norm(x, self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class CrossEntropy(nn.Module):
    """Mean token cross-entropy in fp32; a module so that compile_blocks compiles it as model.compile does ours."""

    def forward(self, logits: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), label_ids.flatten())


class PlainLlama(nn.Module):
    def __init__(self, m: Any) -> None:
        """`m`: a nanotron_ext ModelConfig (only its numbers are read)."""
        super().__init__()
        self.eps, self.tied = m.rms_norm_eps, m.tie_embeddings
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        self.blocks = nn.ModuleList(Block(m.hidden_size, m.num_heads, m.num_kv_heads, m.ffn_size, m.rms_norm_eps,
                                          m.max_seq_len, m.rope_theta) for _ in range(m.num_layers))
        self.final_norm = nn.Parameter(torch.ones(m.hidden_size))
        self.head = None if self.tied else nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        self.loss = CrossEntropy()
        with torch.no_grad():  # GPT-2 init as nanotron_ext's: N(0, std), residual outputs / sqrt(2 L)
            for name, p in self.named_parameters():
                if p.ndim == 2:
                    scaled = name.endswith(("o.weight", "down.weight"))
                    p.normal_(0.0, m.init_std / (math.sqrt(2 * m.num_layers) if scaled else 1.0))

    def compile_blocks(self) -> None:
        """torch.compile each block and the loss in place, as model.compile does for nanotron_ext's decoder layers
        and (at TP = 1) its cross-entropy."""
        for block in [*self.blocks, self.loss]:
            block.compile()

    def forward(self, input_ids: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        x = rms_norm(x, self.final_norm, self.eps)
        logits = F.linear(x, self.embed.weight) if self.tied else self.head(x)
        return self.loss(logits, label_ids)

    @torch.no_grad()
    def load_from(self, ours: nn.Module) -> None:
        """Copy the weights of a nanotron_ext Llama (TP = PP = 1, megatron strategy) into this model."""
        names = {"token_embedding.pp_block.embedding.weight": "embed.weight",
                 "lm_head.pp_block.final_norm.weight": "final_norm",
                 "lm_head.pp_block.lm_head.weight": "head.weight"}
        per_layer = {"attn.norm.weight": "attn_norm", "attn.qkv_proj.weight": "qkv.weight",
                     "attn.o_proj.weight": "o.weight",
                     "mlp.norm.weight": "mlp_norm", "mlp.gate_up_proj.weight": "gate_up.weight",
                     "mlp.down_proj.weight": "down.weight"}
        mine = dict(self.named_parameters())
        copied = set()
        for name, p in ours.named_parameters():
            if name.startswith("decoder."):
                _, i, _, rest = name.split(".", 3)
                target = f"blocks.{i}.{per_layer[rest]}"
            else:
                target = names[name]
            mine[target].copy_(p)
            copied.add(target)
        missing = set(mine) - copied
        if missing:
            raise ValueError(f"weights not copied from the nanotron_ext model: {sorted(missing)}")


def make_optimizer(model: nn.Module, opt: Any) -> torch.optim.AdamW:
    """AdamW as nanotron_ext's optimizer.adamw: decay on matrices, none on norms, and the same torch implementation
    (`opt.adamw_impl`; auto: fused on CUDA, the for-loop elsewhere) (`opt`: OptimizerConfig)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    impl = opt.adamw_impl
    if impl == "auto":
        impl = "fused" if decay[0].is_cuda else "for_loop"
    return torch.optim.AdamW([{"params": decay, "weight_decay": opt.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, fused=impl == "fused",
                             foreach=impl == "foreach")


def train_step(model: PlainLlama, optimizer: torch.optim.Optimizer, batches: List[Dict[str, torch.Tensor]],
               clip: float, bf16: bool) -> torch.Tensor:
    """One optimiser step over the micro-batches (the mean loss), as nanotron_ext's trainer steps."""
    device = model.embed.weight.device
    total = torch.zeros((), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    for mb in batches:
        with autocast:
            loss = model(mb["input_ids"].to(device), mb["label_ids"].to(device)) / len(batches)
        loss.backward()
        total += loss.detach()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def eval_loss(model: PlainLlama, batches: List[Dict[str, torch.Tensor]], bf16: bool) -> float:
    device = model.embed.weight.device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        losses = [model(mb["input_ids"].to(device), mb["label_ids"].to(device)) for mb in batches]
    return float(torch.stack(losses).mean())
