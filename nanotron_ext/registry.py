"""Named extension points that technique packages plug into.

The core builds a model, an optimiser and a training loop from registries keyed by config values
(`model.boost.tp_strategy`, `model.codec.kind`, ...). A technique package (nanotron_ext.boost,
nanotron_ext.resbm, ...) registers its entries when it is imported; the core never imports it.
Instead, the first lookup of a name that is not registered yet imports every module declared
under the `nanotron_ext.techniques` entry-point group (pyproject.toml), the standard Python
plug-in mechanism, so a third-party package can add a codec or a strategy the same way.
"""
from __future__ import annotations

import importlib.metadata
from typing import Callable, Dict, Generic, List, TypeVar

T = TypeVar("T")

ENTRY_POINT_GROUP = "nanotron_ext.techniques"
# Core modules that register the default entries (megatron, identity, standard, none, allreduce).
CORE_MODULES = (
    "nanotron_ext.models.tp_strategy",
    "nanotron_ext.codecs",
    "nanotron_ext.models.llama",
    "nanotron_ext.models.constraints",
    "nanotron_ext.parallel.data_parallel",
)
_loaded = False


def load_techniques() -> None:
    """Import the core's registering modules and every technique package declared in the entry-point
    group (once per process)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in CORE_MODULES:
        importlib.import_module(name)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


class Registry(Generic[T]):
    """Name -> entry, for one extension point; `config_key` names the YAML key that selects it."""

    def __init__(self, config_key: str) -> None:
        self.config_key = config_key
        self._entries: Dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(entry: T) -> T:
            old = self._entries.get(name)
            if old is not None and _qualname(old) != _qualname(entry):  # re-running one definition is fine
                raise ValueError(f"{self.config_key}: {name!r} is registered twice ({_qualname(old)}, {_qualname(entry)})")
            self._entries[name] = entry
            return entry

        return deco

    def get(self, name: str) -> T:
        if name not in self._entries:
            load_techniques()
        if name not in self._entries:
            raise ValueError(f"{self.config_key}={name!r} is not available; registered: {self.names()}")
        return self._entries[name]

    def names(self) -> List[str]:
        load_techniques()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _qualname(entry: object) -> str:
    return f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', repr(entry))}"


# The extension points, one per config key. Each entry's contract is documented where the core
# calls it; the toy plug-ins in tests/test_extension_points.py show the smallest valid entry.
TP_STRATEGIES: Registry = Registry("model.boost.tp_strategy")
"""name -> TPStrategy subclass (nanotron_ext.models.tp_strategy): the tensor-parallel layout."""
CODECS: Registry = Registry("model.codec.kind")
"""name -> BoundaryCodec subclass (nanotron_ext.codecs.base): what crosses a codec boundary."""
EMBEDDINGS: Registry = Registry("model.embedding.kind")
"""name -> builder(cfg: ModelConfig, strategy: TPStrategy) -> nn.Module mapping input_ids [b, s] to the
residual stream's first hidden state (nanotron_ext.models.llama.TokenEmbedding calls it)."""
OUTPUT_CONSTRAINTS: Registry = Registry("model.output_constraint.kind")
"""name -> OutputConstraint subclass (nanotron_ext.models.constraints): per-layer constraints on the
attention output and MLP down projections, applied at build time and after every optimiser step."""
OPTIMIZER_GROUPS: Registry = Registry("optimizer group tag")
"""tag -> factory(params, cfg: OptimizerConfig) -> torch.optim.Optimizer for parameters a technique
tagged with nanotron_ext.optim.param_groups.tag_parameter (e.g. Stiefel projections, constrained rows)."""
DP_SYNCS: Registry = Registry("parallelism.dp_sync")
"""name -> DataParallelSync subclass (nanotron_ext.parallel.data_parallel): how replicas agree, per
step (gradient all-reduce) or in an outer loop (SparseLoCo)."""
REPLICA_CONFIGS: Registry = Registry("parallelism.dp_sync")
"""dp_sync name -> fn(cfg: Config, replica: int) -> Config: the config DP replica `replica` builds its model
and its DP sync from (e.g. heterogeneous SparseLoCo: some replicas compress their pipeline, others do
not). A DP sync without an entry gives every replica the run's config (nanotron_ext.models.build.replica_config)."""
