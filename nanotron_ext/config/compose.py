"""Technique sections composed into the core's config sections.

The core's sections (schema.py, model_schema.py) know the core only. A technique mounts its own
keyword-only dataclasses under them (nanotron_ext.technique.Technique.sections, e.g. ResBMConfig at
"model.codec.resbm"), so users keep writing the keys they always wrote. As torchtitan merges a custom
job config into its JobConfig, `composed(cls)` builds, once per set of registered techniques, a
dataclass subclass of a core section with one extra field per mounted section; the loader, `--set`,
`config show` and `config doc` then see technique sections exactly like core ones.

Instantiating a core section (`Config()`, `ModelConfig(hidden_size=64)`) makes its composed subclass
(`Extensible.__new__`), so code and tests construct configs as plain dataclasses. Importing this module
or schema.py imports no technique: the registered techniques are read when the first section is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, Optional, Tuple

from nanotron_ext.registry import TECHNIQUES
from nanotron_ext.technique import Section, Technique

_BY_PATH: Dict[str, type] = {}  # core section classes by dotted path (filled at class definition, never after)
_CACHE: Dict[Tuple[type, int], type] = {}  # (core class, techniques generation) -> composed class


class Extensible:
    """Base of every core config section: declares the section's dotted path (`class ModelConfig(Extensible,
    path="model")`) so techniques can mount sections under it."""

    _path: ClassVar[str]
    _core: ClassVar[type]

    def __init_subclass__(cls, path: Optional[str] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if path is not None:
            cls._path, cls._core = path, cls
            _BY_PATH[path] = cls

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(composed(cls))

    def __reduce__(self) -> Tuple[Any, ...]:
        # pickle/deepcopy rebuild through the core class (the composed one has no importable name)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return (_rebuild, (type(self)._core, values))


def _rebuild(core: type, values: Dict[str, Any]) -> Any:
    """A copy holds the values as they are: no validation again (a derived config, e.g. a heterogeneous
    replica's, need not pass the rules of a user's YAML); sections this process does not know are refused."""
    cls = composed(core)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(f"{core.__name__} has no keys {unknown} here (a technique registered where "
                        "it was built is not)")
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        else:  # a technique registered here but not where the config was built: its defaults
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        object.__setattr__(obj, f.name, value)
    return obj


def core_class(cls: type) -> type:
    """The core section class behind `cls` (itself when it is not composed)."""
    return getattr(cls, "_core", cls)


def composed(cls: type) -> type:
    """`cls` with the sections registered techniques mount under it (`cls` itself for a non-core class)."""
    core = getattr(cls, "_core", None)
    if core is None:
        return cls
    key = (core, TECHNIQUES.generation)
    if key not in _CACHE:
        TECHNIQUES.all()  # load the entry points first: that may change the generation
        key = (core, TECHNIQUES.generation)
        if key not in _CACHE:
            _CACHE[key] = _compose(core)
    return _CACHE[key]


def mounts(technique: Technique) -> Dict[str, Tuple[str, Section]]:
    """{path: (parent path, section)} of `technique`'s sections, checked: each parent is a core section and
    no section lands on a core key."""
    import nanotron_ext.config.schema  # noqa: F401  (a cycle otherwise: the schema's classes fill _BY_PATH)

    out = {}
    for path, section in technique.section_items().items():
        parent, _, name = path.rpartition(".")
        if parent not in _BY_PATH:
            raise TypeError(f"technique {technique.name!r} mounts {section.cls.__name__} at {path!r}, but "
                            f"{parent or '(top level)'!r} is not a core config section; core sections: "
                            f"{sorted(p for p in _BY_PATH if p)}")
        if name in {f.name for f in dataclasses.fields(_BY_PATH[parent])}:
            raise TypeError(f"technique {technique.name!r} mounts a section at {path!r}, which is already a key")
        out[path] = (parent, section)
    return out


def register_technique(technique: Technique) -> Technique:
    """Register a technique in this process (plug-ins installed as packages use entry points instead); a
    technique whose sections cannot mount (`mounts`) or that provides a name another already provides is
    refused, and nothing is registered."""
    TECHNIQUES.all()  # load the entry points first: a clash with one of them is this technique's
    mounts(technique)
    return TECHNIQUES.register(technique)


def _compose(core: type) -> type:
    fields, seen = [], {}
    for technique in TECHNIQUES.all():
        for path, (parent, section) in mounts(technique).items():
            if parent != core._path:
                continue
            if path in seen:
                raise TypeError(f"{path!r} is mounted by both {seen[path]!r} and {technique.name!r}")
            seen[path] = technique.name
            fields.append((path.rpartition(".")[2], section.cls, dataclasses.field(default_factory=section.factory())))
    if not fields:
        return core
    return dataclasses.make_dataclass(core.__name__, fields, bases=(core,), kw_only=True,
                                      namespace={"__module__": core.__module__, "__qualname__": core.__qualname__})
