"""The `model:` section of the run configuration and the core sections nested in it: the TP layout,
the boundary codec (identity and the lossy baselines), the token embedding and output-projection
constraints. Techniques mount their own sections here (model.low_rank, model.boost, model.codec.resbm,
model.codec.mapl, model.subspace; nanotron_ext/config/compose.py). Schema conventions: schema.py."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import List, Literal, Optional, Union

from nanotron_ext.config.checks import require, require_finite, require_registered
from nanotron_ext.config.compose import Extensible
from nanotron_ext.registry import CODECS, EMBEDDINGS, OUTPUT_CONSTRAINTS, TP_STRATEGIES, techniques

# codes per 32-bit slot of the packing lossy baselines (codecs/lossy.py: 32 // bits; checked here at load,
# without importing the codec)
_PACKED_CODECS = {"int8": 4, "int4": 8}


@dataclasses.dataclass(kw_only=True)
class CodecConfig(Extensible, path="model.codec"):
    """What crosses a codec boundary. Technique codecs (resbm, mapl) mount their options here."""

    kind: str = "identity"
    """identity: the hidden state as is; the lossy baselines topk, int8, int4, lowrank; or any registered codec."""
    boundaries: Union[Literal["stages", "every_layer"], List[int]] = "stages"
    """Where the codec sits, as the indices of the layers that send through it: stages = every pipeline
    boundary; every_layer = after every layer but the last (on one process too); or a list. A pipeline
    boundary outside the list sends the plain hidden state."""
    ratio: float = 8.0
    """Target compression ratio of the lossy baselines topk and lowrank (int8/int4 are fixed by their bits)."""

    def __post_init__(self) -> None:
        require_registered(CODECS, self.kind)
        require_finite(self, "model.codec")
        require(self.ratio >= 1, "model.codec.ratio", f"must be >= 1, got {self.ratio}")


@dataclasses.dataclass(kw_only=True)
class EmbeddingConfig(Extensible, path="model.embedding"):
    """The token embedding: how input ids become the first hidden state."""

    kind: Optional[str] = None
    """standard: the TP strategy's embedding table; techniques register others (e.g. fixed + trainable
    parts). Unset: what the codec's technique brings (subspace: its split table), else standard."""


@dataclasses.dataclass(kw_only=True)
class OutputConstraintConfig(Extensible, path="model.output_constraint"):
    """Constraints on every layer's attention output and MLP down projections."""

    kind: Optional[str] = None
    """none; or a registered constraint (applied when the model is built and after every optimiser step).
    Unset: what the codec's technique brings (subspace: span(U)), else none."""


@dataclasses.dataclass(kw_only=True)
class ModelConfig(Extensible, path="model"):
    vocab_size: int = 4096
    """Embedding rows; must be >= the tokenizer's vocabulary and divisible by parallelism.tp."""
    hidden_size: int = 128
    """Model width d."""
    ffn_size: int = 352
    """SwiGLU inner width."""
    num_layers: int = 4
    """Decoder layers."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides num_heads."""
    max_seq_len: int = 512
    """Longest sequence RoPE tables are built for."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before attention."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head (needs pp = 1)."""
    init_std: float = 0.02
    """Std of the normal init; output projections are scaled by 1/sqrt(2*num_layers)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute precision: bf16 autocast over fp32 master weights, or plain fp32."""
    attention: Literal["auto", "sdpa", "flash", "cudnn"] = "auto"
    """auto: flash-attn when installed and on CUDA, else torch SDPA (the backend torch picks); sdpa: torch SDPA;
    flash: the flash-attn package; cudnn: torch SDPA's cuDNN backend only (CUDA; on one H200 with torch 2.11 our
    125M step ran 5% faster with it than with SDPA's flash backend: benchmarks/results/gpu/)."""
    compile: bool = False
    """torch.compile each decoder layer in place (one compiled graph serves every layer of the same shape;
    parameter names and checkpoints are unchanged) and, at TP = 1, the cross-entropy (fused: no fp32 logits are
    materialised); the first steps pay the compile time."""
    tp_strategy: Optional[str] = None
    """How tensor parallelism splits the model: megatron (full-rank column/row pairs, the core's); techniques
    register others (BOOST: vanilla, btp). Unset: what the model's technique brings (a low-rank model:
    BOOST's vanilla), else megatron."""
    codec: CodecConfig = field(default_factory=CodecConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    output_constraint: OutputConstraintConfig = field(default_factory=OutputConstraintConfig)
    init_from: Optional[str] = None
    """hf:DIR starts the run from a transformers Llama folder (Qwen3 when qk_norm) instead of the seeded init;
    its config.json must match this section (checked when the job starts, before any process group, not at load).
    Factorised linears start from a truncated SVD of the dense weights; the per-layer reconstruction error is
    printed. A resumed run loads its checkpoint instead."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "ffn_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len"):
            require(getattr(self, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.hidden_size % self.num_heads == 0, "model.hidden_size",
                 f"{self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                 f"{self.num_kv_heads} does not divide model.num_heads={self.num_heads}")
        require((self.hidden_size // self.num_heads) % 2 == 0, "model.hidden_size",
                 "head dim (hidden_size / num_heads) must be even for RoPE")
        require_finite(self, "model")
        require(self.rope_theta > 0, "model.rope_theta", f"must be > 0 (RoPE base, e.g. 10000), got {self.rope_theta}")
        require(self.rms_norm_eps > 0, "model.rms_norm_eps", f"must be > 0 (e.g. 1e-5), got {self.rms_norm_eps}")
        require(self.init_std > 0, "model.init_std", f"must be > 0 (e.g. 0.02), got {self.init_std}")
        if isinstance(self.codec.boundaries, list):
            b = self.codec.boundaries
            require(all(0 <= i < self.num_layers - 1 for i in b), "model.codec.boundaries",
                     f"{b}: each entry is a sending layer index in [0, {self.num_layers - 2}] (model.num_layers="
                     f"{self.num_layers}; the last layer feeds the head)")
            require(len(set(b)) == len(b), "model.codec.boundaries", f"{b} lists a layer twice")
        per_slot = _PACKED_CODECS.get(self.codec.kind)
        require(per_slot is None or self.hidden_size % per_slot == 0, "model.hidden_size",
                f"{self.hidden_size} with model.codec.kind={self.codec.kind!r}: the codec packs {per_slot} codes per "
                f"32-bit slot, so model.hidden_size must be divisible by {per_slot}")
        resolve_unset(self)
        require_registered(TP_STRATEGIES, self.tp_strategy)
        require_registered(EMBEDDINGS, self.embedding.kind)
        require_registered(OUTPUT_CONSTRAINTS, self.output_constraint.kind)
        for technique in techniques():
            technique.check_model(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def resolve_unset(model: ModelConfig) -> None:
    """Techniques fill the model keys left unset (one switch: `model.codec.kind: subspace` brings its
    embedding and output constraint); the core's defaults fill the rest. Idempotent."""
    for technique in techniques():
        technique.resolve_model(model)
    model.tp_strategy = model.tp_strategy or "megatron"
    model.embedding.kind = model.embedding.kind or "standard"
    model.output_constraint.kind = model.output_constraint.kind or "none"
