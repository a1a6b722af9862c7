"""The registered techniques and the extension points they plug into: the mechanism only (register, look up),
importing nothing of the package but `nanotron_ext.technique`.

Every technique package declares one `Technique` object (nanotron_ext.technique) under the
`nanotron_ext.techniques` entry-point group (pyproject.toml), the standard Python plug-in mechanism, so
a third-party package plugs in the same way. The core never imports a technique: `techniques()` loads
the declared objects on first use. Those imports are light (config dataclasses and names, no torch): a
name is checked at config load against what techniques *declare*; the implementation is imported when a
model is built (`ExtensionPoint.owner(name).pieces_class()`).

An extension point is a config key whose value names an implementation, e.g. `model.codec.kind`. The
core's own entries are declared the same way, by the entry point `core` (nanotron_ext.models.technique,
built by nanotron_ext.models.pieces.CorePieces).
"""
from __future__ import annotations

import importlib.metadata
from typing import Dict, List, Optional

from nanotron_ext.technique import Technique

ENTRY_POINT_GROUP = "nanotron_ext.techniques"


class _Techniques:
    """name -> Technique, filled from the entry points on first use. `generation` changes whenever the
    set changes (the config composition caches on it)."""

    def __init__(self) -> None:
        self._by_name: Dict[str, Technique] = {}
        self._loaded = False
        self.generation = 0

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            obj = ep.load()
            if not isinstance(obj, Technique):
                raise TypeError(f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}) is a {type(obj).__name__}, "
                                "not a nanotron_ext.technique.Technique instance")
            self._add(obj, ep.value)

    def _add(self, technique: Technique, where: str) -> None:
        old = self._by_name.get(technique.name)
        if old is not None and type(old) is not type(technique):
            raise ValueError(f"technique {technique.name!r} is registered twice ({type(old).__qualname__}, {where})")
        for key, names in technique.provides.items():
            for other in self._by_name.values():
                clash = set(names) & set(other.provides.get(key, ())) if other.name != technique.name else set()
                if clash:
                    raise ValueError(f"{key}: {sorted(clash)} provided by both {other.name!r} and {technique.name!r}")
        self._by_name[technique.name] = technique
        self.generation += 1

    def register(self, technique: Technique) -> Technique:
        """Add a technique in this process, unchecked against the config sections (plug-ins installed as
        packages use entry points instead; nanotron_ext.config.compose.register_technique checks that its
        sections mount first). A name another technique already provides is refused, and nothing is added."""
        self._load()
        self._add(technique, "register_technique")
        return technique

    def all(self) -> List[Technique]:
        self._load()
        return list(self._by_name.values())

    def get(self, name: str) -> Optional[Technique]:
        self._load()
        return self._by_name.get(name)


TECHNIQUES = _Techniques()
techniques = TECHNIQUES.all


def residual_sharded(tp_strategy: str, tp: int) -> bool:
    """Whether `model.tp_strategy` shards the residual stream on d over the TP group at parallelism.tp = `tp`
    (Technique.shards_residual: BOOST's btp at tp > 1)."""
    return tp > 1 and any(tp_strategy in t.shards_residual for t in techniques())


class ExtensionPoint:
    """A config key whose value names a piece some technique provides."""

    def __init__(self, config_key: str) -> None:
        self.config_key = config_key

    def names(self) -> List[str]:
        return sorted({n for t in techniques() for n in t.provides.get(self.config_key, ())})

    def owner(self, name: str) -> Technique:
        """The technique that provides `name`; ValueError naming the key and the choices when none does."""
        for t in techniques():
            if name in t.provides.get(self.config_key, ()):
                return t
        raise ValueError(f"{self.config_key}={name!r} is not available; registered: {self.names()}")

    def __contains__(self, name: str) -> bool:
        return name in self.names()


# The extension points. Each piece's contract is the matching method of nanotron_ext.technique.Pieces.
TP_STRATEGIES = ExtensionPoint("model.tp_strategy")
"""TP layouts (Pieces.tp_strategy): megatron; BOOST's vanilla and btp."""
CODECS = ExtensionPoint("model.codec.kind")
"""What crosses a codec boundary (Pieces.codec)."""
EMBEDDINGS = ExtensionPoint("model.embedding.kind")
"""Token embeddings (Pieces.embedding)."""
OUTPUT_CONSTRAINTS = ExtensionPoint("model.output_constraint.kind")
"""Per-layer constraints on the output projections (Pieces.output_constraint)."""
OPTIMIZER_GROUPS = ExtensionPoint("optimizer group")
"""Optimisers for parameters a technique tagged (nanotron_ext.optim.param_groups.tag_parameter; Pieces.optimizer)."""
DP_SYNCS = ExtensionPoint("parallelism.dp_sync")
"""How DP replicas agree (Pieces.dp_sync); its owner's Technique.replica_config gives each replica's config."""
