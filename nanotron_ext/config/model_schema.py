"""The `model:` section of the run configuration and the sections nested in it: low-rank and TP
strategy (BOOST), the boundary codec and its techniques' options (ResBM, MAPL, lossy baselines), the
token embedding, output-projection constraints and Subspace Models. Schema conventions: schema.py."""
from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import List, Literal, Optional, Union

from nanotron_ext.config.checks import require, require_finite, require_registered
from nanotron_ext.registry import CODECS, EMBEDDINGS, OUTPUT_CONSTRAINTS, TP_STRATEGIES


@dataclasses.dataclass(kw_only=True)
class LowRankConfig:
    """Low-rank factorisation of the attention and MLP linears (BOOST paper)."""

    kind: Literal["none", "svd", "cola", "lax"] = "none"
    """none = full rank; svd y=A(Bx); cola y=A silu(Bx); lax y_i=B_i(A_i x_i + A_{i-1} x_{i-1})."""
    rank: Optional[int] = None
    """Bottleneck width r; default hidden_size // 4 (BOOST Table 8)."""
    targets: List[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    """Which linears are factorised."""

    def __post_init__(self) -> None:
        allowed = {"q", "k", "v", "o", "gate", "up", "down"}
        bad = set(self.targets) - allowed
        require(not bad, "model.low_rank.targets", f"unknown {sorted(bad)}; allowed: {sorted(allowed)}")
        require(self.rank is None or self.rank >= 1, "model.low_rank.rank", f"must be >= 1, got {self.rank}")


@dataclasses.dataclass(kw_only=True)
class BoostConfig:
    """How tensor parallelism splits the model (BOOST paper)."""

    tp_strategy: str = "megatron"
    """megatron: full-rank column/row pairs; vanilla: each low-rank pair one chunk (collective on d);
    btp: bottleneck-aware chunks (collective on r, residual stream sharded on d)."""
    rmsnorm: Literal["online", "sync"] = "online"
    """Norms inside a BTP chunk: online (statistic rides in the next all-reduce) or sync (own all-reduce)."""
    group_linears: bool = True
    """Concatenate down-projections sharing an input; batch up-projections with distinct inputs."""
    lowrank_checkpointing: bool = False
    """Keep only the r-wide chunk boundaries; recompute inside chunks in backward (no collectives)."""

    def __post_init__(self) -> None:
        require_registered(TP_STRATEGIES, self.tp_strategy)


@dataclasses.dataclass(kw_only=True)
class MaplCodecConfig:
    """MAPL's learned per-boundary Stiefel projection with anchor embeddings (model.codec.kind: mapl)."""

    rank: Optional[int] = None
    """Wire width r of each boundary projection A_p [d, r]; default hidden_size // 4."""
    anchor_width: Optional[int] = None
    """Width m of the trainable anchor table E_small_p [V, m] (the text does not give it); default r."""
    vq_groups: int = 0
    """Residual vector quantisation of Z: groups G per token (0 = off, send Z itself); divides r."""
    vq_rounds: int = 2
    """RVQ rounds R per group."""
    vq_codebook: int = 256
    """Entries K per codebook (indices of ceil(log2 K) bits cross the link)."""
    vq_decay: float = 0.99
    """EMA decay of the sender's k-means codebook update."""
    grad_bits: int = 8
    """With RVQ, bits per value of the quantised gradient sent back (absmax, one fp32 scale per token)."""
    shared_sync: Literal["rows", "dense"] = "rows"
    """How both copies of A_p and E_small_p stay equal: rows = the receiver sends the anchor-gradient rows of
    the step's ids and the A partials are swapped, in the wire dtype ((d r + U m) per step back, d r forth);
    dense = full fp32 gradients of both swapped ((d r + V m) x 4 B each way; nanotron_ext/mapl/codec.py)."""

    def __post_init__(self) -> None:
        for key in ("rank", "anchor_width"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"model.codec.mapl.{key}", f"must be >= 1, got {value}")
        require(self.vq_groups >= 0, "model.codec.mapl.vq_groups", f"must be >= 0, got {self.vq_groups}")
        require(self.vq_rounds >= 1, "model.codec.mapl.vq_rounds", f"must be >= 1, got {self.vq_rounds}")
        require(2 <= self.vq_codebook <= 2**16, "model.codec.mapl.vq_codebook", f"must be in [2, 65536], got {self.vq_codebook}")
        require(0 < self.vq_decay < 1, "model.codec.mapl.vq_decay", f"must be in (0, 1), got {self.vq_decay}")
        require(self.grad_bits in (2, 4, 8, 16), "model.codec.mapl.grad_bits", f"must be 2, 4, 8 or 16, got {self.grad_bits}")
@dataclasses.dataclass(kw_only=True)
class ResBMConfig:
    """ResBM bottlenecks ("ResBM: Residual Bottleneck Models for Low-Bandwidth Pipeline Parallelism",
    arXiv:2604.11947), used when model.codec.kind = resbm. The paper leaves m, the nonlinearity and the
    norm placement open; the defaults here are our choices."""

    h: Optional[int] = None
    """Wire width h (< hidden_size); or give `ratio` instead."""
    ratio: Optional[float] = None
    """Compression hidden_size / h (h = round(hidden_size / ratio)); e.g. 128 -> h = 32 at d = 4096."""
    m: Optional[int] = None
    """Hidden width of the encoder (d -> m -> h) and decoder (h -> m -> d); default hidden_size // 4."""
    nonlinearity: Literal["silu", "gelu", "relu", "tanh", "identity"] = "silu"
    """Between the two linears of the encoder and of the decoder."""
    norm: Literal["none", "encoder", "decoder", "both"] = "none"
    """Extra RMSNorm on the encoder input (d wide) and/or the decoder input (h wide). The receiving
    attention's own pre-norm always normalises D(b)."""
    zero_init_encoder: bool = True
    """Zero-init the encoder's last linear: at init b = trunc_h(x_attn), the pure identity path."""
    zero_init_decoder: bool = False
    """Zero-init the decoder's last linear (then the receiving attention sees 0 at init)."""

    def __post_init__(self) -> None:
        require((self.h is None) != (self.ratio is None), "model.codec.resbm",
                 "give exactly one of model.codec.resbm.h and model.codec.resbm.ratio")
        require(self.h is None or self.h >= 1, "model.codec.resbm.h", f"must be >= 1, got {self.h}")
        require(self.ratio is None or self.ratio > 1, "model.codec.resbm.ratio", f"must be > 1, got {self.ratio}")
        require(self.m is None or self.m >= 1, "model.codec.resbm.m", f"must be >= 1, got {self.m}")

    def width(self, hidden_size: int) -> int:
        """The wire width h for model width `hidden_size`."""
        h = self.h if self.h is not None else max(1, round(hidden_size / self.ratio))
        require(h < hidden_size, "model.codec.resbm.h", f"{h} must be < model.hidden_size={hidden_size}")
        return h


@dataclasses.dataclass(kw_only=True)
class CodecConfig:
    """What crosses a codec boundary. Technique codecs (resbm, subspace, mapl) add their options here."""

    kind: str = "identity"
    """identity: the hidden state as is; or any registered codec."""
    boundaries: Union[Literal["stages", "every_layer"], List[int]] = "stages"
    """Where the codec sits, as the indices of the layers that send through it: stages = every pipeline
    boundary; every_layer = after every layer but the last (on one process too); or a list. A pipeline
    boundary outside the list sends the plain hidden state."""
    mapl: MaplCodecConfig = field(default_factory=MaplCodecConfig)
    """Options of the mapl codec."""
    resbm: ResBMConfig = field(default_factory=lambda: ResBMConfig(ratio=4))
    """ResBM options (model.codec.kind = resbm)."""
    ratio: float = 8.0
    """Target compression ratio of the lossy baselines topk and lowrank (int8/int4 are fixed by their bits)."""

    def __post_init__(self) -> None:
        require_registered(CODECS, self.kind)
        require(self.ratio >= 1, "model.codec.ratio", f"must be >= 1, got {self.ratio}")


@dataclasses.dataclass(kw_only=True)
class EmbeddingConfig:
    """The token embedding: how input ids become the first hidden state."""

    kind: str = "standard"
    """standard: the TP strategy's embedding table; techniques register others (e.g. fixed + trainable parts)."""

    def __post_init__(self) -> None:
        require_registered(EMBEDDINGS, self.kind)


@dataclasses.dataclass(kw_only=True)
class OutputConstraintConfig:
    """Constraints on every layer's attention output and MLP down projections."""

    kind: str = "none"
    """none; or a registered constraint (applied when the model is built and after every optimiser step)."""

    def __post_init__(self) -> None:
        require_registered(OUTPUT_CONSTRAINTS, self.kind)


@dataclasses.dataclass(kw_only=True)
class SubspaceConfig:
    """Subspace (Protocol) Models, nanotron_ext.subspace: one shared basis U (d x k) confines what every
    compressed block writes into the residual stream, so a boundary sends k coordinates and the token ids.
    Used when model.codec.kind / model.embedding.kind / model.output_constraint.kind = subspace."""

    k: Optional[int] = None
    """Subspace width k (columns of U); default hidden_size // 8."""
    seed: int = 0
    """Seed of U (QR of a Gaussian) and of the fixed embedding T_fixed: identical on every rank."""
    parameterisation: Literal["projection", "reparam"] = "reparam"
    """projection: full output weights kept in span(U) by projection; reparam: W_out = U W_small (exact by
    construction)."""
    reproject: bool = True
    """projection only: project the output weights onto span(U) after every optimiser step."""
    modified_adamw: bool = False
    """projection only: the paper's sec. 5 AdamW (second moment averaged to one scalar per input column)."""
    fixed_embedding_std: Optional[float] = None
    """Std of the seeded T_fixed (not trained); default model.init_std."""
    last_block_uncompressed: bool = True
    """Leave the last decoder block's output projections unconstrained (it feeds the head, never a boundary)."""
    grassmann_every: int = 0
    """Optimiser steps between Grassmann updates of U (0 = U stays fixed)."""
    grassmann_lr: float = 0.1
    """Step size of the Grassmann update, on the accumulated A normalised to unit spectral norm."""
    grassmann_reset: bool = True
    """Reset the accumulated A = sum G^T G after each Grassmann update."""

    def __post_init__(self) -> None:
        require(self.k is None or self.k >= 1, "model.subspace.k", f"must be >= 1, got {self.k}")
        require(self.grassmann_every >= 0, "model.subspace.grassmann_every", "must be >= 0")
        require(self.grassmann_lr > 0, "model.subspace.grassmann_lr", f"must be > 0, got {self.grassmann_lr}")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
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
    attention: Literal["auto", "sdpa", "flash"] = "auto"
    """auto: flash-attn when installed and on CUDA, else torch SDPA."""
    compile: bool = False
    """torch.compile each decoder layer in place (one compiled graph serves every layer of the same shape;
    parameter names and checkpoints are unchanged); the first steps pay the compile time."""
    low_rank: LowRankConfig = field(default_factory=LowRankConfig)
    boost: BoostConfig = field(default_factory=BoostConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    output_constraint: OutputConstraintConfig = field(default_factory=OutputConstraintConfig)
    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)
    init_from: Optional[str] = None
    """hf:DIR starts the run from a transformers Llama folder (Qwen3 when qk_norm) instead of the seeded init;
    its config.json must match this section. Factorised linears start from a truncated SVD of the dense weights;
    the per-layer reconstruction error is printed. A resumed run loads its checkpoint instead."""

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
        r = self.codec.mapl.rank
        require(r is None or r <= self.hidden_size, "model.codec.mapl.rank",
                 f"{r} exceeds model.hidden_size={self.hidden_size} (A_p must have orthonormal columns)")
        g = self.codec.mapl.vq_groups
        require(not g or (r or self.hidden_size // 4) % g == 0, "model.codec.mapl.vq_groups",
                 f"{g} does not divide the wire width r={r or self.hidden_size // 4}")
        require(self.subspace.k is None or self.subspace.k <= self.hidden_size, "model.subspace.k",
                 f"{self.subspace.k} exceeds model.hidden_size={self.hidden_size}")
        if self.init_from is not None:
            from nanotron_ext.hf.names import check_init_from  # reads the folder's config.json

            check_init_from(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rank(self) -> int:
        """Low-rank bottleneck width (default d/4)."""
        return self.low_rank.rank or self.hidden_size // 4

    @property
    def subspace_k(self) -> int:
        """Subspace Models' width k (default d/8)."""
        return self.subspace.k or max(1, self.hidden_size // 8)
