"""One object per technique: what a technique package declares, and the pieces it builds per model.

A technique (BOOST, ResBM, Subspace Models, MAPL, SparseLoCo, or a third-party package) is a folder
with two halves, in the spirit of torchtitan's TrainSpec:

- `Technique` (light, registered once through the `nanotron_ext.techniques` entry-point group): its
  config sections (keyword-only dataclasses mounted under the YAML keys users write, e.g.
  "model.codec.resbm"), the names it provides at each extension point (nanotron_ext.registry), the
  values it brings for model keys left unset (one switch: `model.codec.kind: subspace` brings its
  embedding and output constraint), its cross-key rules, per-replica configs, and where its pieces
  live. Importing it imports no torch and no nanotron, so loading a config stays cheap.
- `Pieces` (heavy, one object per model build, created by the core's model builder for every technique
  that owns a name the model uses): builds the TP strategy, codec, embedding, output constraint and DP
  sync it named. State its pieces share lives on this object (e.g. Subspace Models' basis U), never in a
  module-level dict, so two models in one process share nothing.

The core's own defaults (megatron, identity, standard, none, allreduce) are declared the same way
(nanotron_ext.models.technique, nanotron_ext.models.pieces.CorePieces). ARCHITECTURE.md walks through
adding a technique; tests/toy_technique/ is a complete one.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Union

if TYPE_CHECKING:  # annotations only: this module must stay importable without torch
    import torch
    from nanotron import distributed as dist
    from nanotron.parallel import ParallelContext
    from torch import nn

    from nanotron_ext.codecs.base import BoundaryCodec
    from nanotron_ext.config.schema import Config, ModelConfig, OptimizerConfig
    from nanotron_ext.metrics.tier_bytes import TierBytes
    from nanotron_ext.models.constraints import OutputConstraint
    from nanotron_ext.models.tp_strategy import TPStrategy
    from nanotron_ext.parallel.data_parallel import DataParallelSync


@dataclasses.dataclass(frozen=True)
class Section:
    """A config section a technique mounts at a dotted path, e.g. Section(ResBMConfig) at "model.codec.resbm".
    `default` builds the value when the YAML omits the section (a default that resolves the same way when the YAML
    gives part of it belongs in the class: `config doc` shows the class's defaults)."""

    cls: type
    default: Optional[Callable[[], Any]] = None

    def factory(self) -> Callable[[], Any]:
        return self.default or self.cls


@dataclasses.dataclass(frozen=True)
class GatedWork:
    """Work a technique runs only every `every` optimiser steps (a Grassmann update, an outer sync's embedding fold),
    its calls recorded in the comm ledger as `op:tag`. `python -m nanotron_ext.plan` reports it apart from the
    per-step figures, beside `bytes`: the closed form, per occurrence, of what one rank hands to the calls of that
    tag on each process group role ({"world": ..., "pp": ...}); `formula` says how."""

    tag: str
    every: int
    what: str
    bytes: Mapping[str, float]
    formula: str


def load_object(target: str) -> Any:
    """The object named "package.module:attribute" (imported on first use)."""
    module, _, attr = target.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


class Technique:
    """The registered declaration of one technique package (see module docstring). Subclass it, set the
    class attributes, instantiate it once in the package's `__init__.py` and name that object in
    pyproject.toml's `nanotron_ext.techniques` entry points."""

    name: ClassVar[str] = ""
    """Short name (the entry point's name), used in messages and by `ModelPieces.get`."""
    sections: ClassVar[Mapping[str, Union[Section, type]]] = {}
    """Config sections by mount path ("model.low_rank", "model.codec.resbm", "sparseloco"): the parent must
    be a core section (config/schema.py); the loader, `--set`, `config show` and `config doc` treat them
    like core sections."""
    provides: ClassVar[Mapping[str, Sequence[str]]] = {}
    """Names this technique provides, by extension-point key (nanotron_ext.registry), e.g.
    {"model.codec.kind": ["resbm"]}. Checked at config load without importing `pieces`."""
    requires: ClassVar[Sequence[str]] = ()
    """The techniques (by name) this one builds on, e.g. SparseLoCo's ("subspace",): heterogeneous SparseLoCo
    runs Subspace Models' codec on some replicas. A config that chooses one of this technique's names while one of
    these is not registered fails at load, naming both (nanotron_ext.config.checks.require_registered)."""
    shards_residual: ClassVar[Sequence[str]] = ()
    """The `model.tp_strategy` names (of those in `provides`) that shard the residual stream on d over the TP
    group (BOOST's btp); the core checks `needs_replicated_residual` against them at config load."""
    needs_replicated_residual: ClassVar[Mapping[str, str]] = {}
    """Pieces this technique provides that cannot run on a residual stream sharded over TP (tp > 1), by
    "key=name" (e.g. "model.codec.kind=mapl"), each with the reason; the core turns one such choice
    under a sharding strategy into one config error naming both keys (nanotron_ext.config.schema)."""
    no_output_projections: ClassVar[Sequence[str]] = ()
    """The `model.tp_strategy` names (of those in `provides`) whose layers have no single weight writing into the
    residual stream (BOOST's vanilla: Megatron TP of each factor pair), so `model.output_constraint` has nothing
    to act on; the core refuses the pair at config load, naming both keys."""
    memory_switches: ClassVar[Sequence[str]] = ()
    """Boolean config keys of this technique's sections that trade recomputation for activation memory (BOOST's
    model.boost.lowrank_checkpointing); `python -m nanotron_ext.plan` plans a config with each one flipped too."""
    resume_keys: ClassVar[Optional[Sequence[str]]] = None
    """Config keys whose change across a resume the core refuses, naming them (nanotron_ext.train.guard): each a key
    or a section path covering every key under it. None (the default): every section this technique mounts, since
    they shape the saved state or define the experiment the run continues."""
    resume_free: ClassVar[Sequence[str]] = ()
    """Keys (or section paths) under `resume_keys` that may change across a resume: the same math, or where and how
    patiently a replica meets the others (SparseLoCo's sparseloco.fault_tolerance.lighthouse)."""
    widths: ClassVar[Sequence[str]] = ()
    """Integer keys of this technique's sections holding a width that scales with the hidden size d (SM's k = d/8,
    BOOST's r = d/4): the model clock's twin at a larger model scales each by the ratio of the hidden sizes."""
    uncompressed: ClassVar[Sequence[str]] = ()
    """`--set` overrides ("key=value") beyond the core's (every extension point at its core piece: identity codec,
    standard embedding, no constraint) that make the uncompressed twin of a config, the base model the papers size
    (nanotron_ext.models.param_count.uncompressed_overrides; SparseLoCo's "sparseloco.compressed_replicas=[]")."""
    pieces: ClassVar[Union[str, type]] = ""
    """"module:Class" of this technique's `Pieces` subclass, imported when a model is built (or the class itself,
    for a technique registered in-process with nanotron_ext.config.compose.register_technique)."""
    simulated: ClassVar[str] = ""
    """"module:function" building the outer loop of this technique's DP sync over in-process replicas,
    `(cfg, replicas) -> OuterLoop or None` (nanotron_ext.train.simulated: one process trains a DP layout with the
    same math, e.g. the WAN meter's loss runs); empty: its replicas average gradients every step."""

    def section_items(self) -> Dict[str, Section]:
        return {path: s if isinstance(s, Section) else Section(s) for path, s in self.sections.items()}

    def resume_defining(self) -> List[str]:
        """`resume_keys`, or every section this technique mounts when it names none."""
        return list(self.sections) if self.resume_keys is None else list(self.resume_keys)

    def pieces_class(self) -> type:
        if not self.pieces:
            raise TypeError(f"technique {self.name!r} provides {dict(self.provides)} but names no Pieces class")
        return self.pieces if isinstance(self.pieces, type) else load_object(self.pieces)

    def resolve_model(self, model: "ModelConfig") -> None:
        """Fill model keys the user left unset (None) with what this technique brings. Runs when a
        ModelConfig is built, before the core's defaults."""

    def check_model(self, model: "ModelConfig") -> None:
        """Rules across model keys (raise nanotron_ext.config.checks.ConfigError naming the keys)."""

    def check(self, cfg: "Config") -> None:
        """Rules across sections (the parallel layout, the DP sync, ...), run by Config.validate."""

    def replica_config(self, cfg: "Config", replica: int) -> "Config":
        """The config DP replica `replica` builds its model from, when this technique owns the run's
        parallelism.dp_sync (heterogeneous SparseLoCo gives some replicas a compressing codec)."""
        return cfg

    def outer_every(self, cfg: "Config") -> int:
        """Optimiser steps between the outer steps of the DP sync this technique provides (1: it acts every step),
        read by `python -m nanotron_ext.plan` to step a rank through one outer step. By default the `inner_steps`
        field of one of this technique's own sections, where it has one (SparseLoCo's H)."""
        for path in self.sections:
            section: Any = cfg
            for part in path.split("."):
                section = getattr(section, part, None)
            every = getattr(section, "inner_steps", None)
            if isinstance(every, int) and every >= 1:
                return every
        return 1

    def outer_overlap(self, cfg: "Config") -> int:
        """Inner steps the outer sync of the DP sync this technique provides runs behind before its result is
        applied (a streaming sync's delay tau; 0: it blocks), read by the model clock's full-overlap bound."""
        return 0

    def gated_work(self, cfg: "Config") -> List[GatedWork]:
        """The work this technique runs every N > 1 optimiser steps only, tagged in the ledger (GatedWork); the
        planner takes the tagged calls out of its per-step figures and shows each at its cadence."""
        return []

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        """Bytes per optimiser step that the piece `name` (provided at extension point `key`) puts on its
        tier, by its paper's closed form (nanotron_ext.metrics.tier_bytes.TierBytes says per what), for
        `python -m nanotron_ext.config show`; None when there is none."""
        return None


class Pieces:
    """What one technique builds for one model (one object per model build; see module docstring).
    Override the methods for the extension points named in the technique's `provides`; each receives the
    name the config chose."""

    def __init__(self, cfg: "ModelConfig", tp_pg: "dist.ProcessGroup") -> None:
        self.cfg, self.tp_pg = cfg, tp_pg

    def _missing(self, what: str, name: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} declares {what} {name!r} but does not build it")

    def tp_strategy(self, name: str) -> "TPStrategy":
        """model.tp_strategy: the tensor-parallel layout (nanotron_ext.models.tp_strategy.TPStrategy)."""
        raise self._missing("tp_strategy", name)

    def codec(self, name: str, strategy: "TPStrategy") -> "BoundaryCodec":
        """model.codec.kind: what crosses a codec boundary (nanotron_ext.codecs.base.BoundaryCodec)."""
        raise self._missing("codec", name)

    def embedding(self, name: str, strategy: "TPStrategy") -> "nn.Module":
        """model.embedding.kind: input_ids [b, s] -> the residual stream's first hidden state."""
        raise self._missing("embedding", name)

    def output_constraint(self, name: str, strategy: "TPStrategy") -> "OutputConstraint":
        """model.output_constraint.kind: per-layer constraints on the output projections."""
        raise self._missing("output_constraint", name)

    def dp_sync(self, name: str, model: "nn.Module", ctx: "ParallelContext", cfg: "Config") -> "DataParallelSync":
        """parallelism.dp_sync: how this rank's replica agrees with the others (cfg: the replica's config)."""
        raise self._missing("dp_sync", name)

    @classmethod
    def optimizer(cls, tag: str, params: List["torch.nn.Parameter"], cfg: "OptimizerConfig") -> "torch.optim.Optimizer":
        """An optimizer group: the optimiser for parameters tagged `tag` (nanotron_ext.optim.param_groups)."""
        raise NotImplementedError(f"{cls.__name__} declares optimizer group {tag!r} but does not build it")
