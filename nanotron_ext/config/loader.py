"""Strict YAML -> typed dataclass loading for the run configuration (see schema.py).

Every problem is a `ConfigError` that names the full dotted key, what was expected and what was
given, so a typo in a 200-line YAML file points at the line to fix. `--set a.b=value` overrides
are merged into the parsed YAML before building, so they are checked exactly like file keys.
"""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, TypeVar, Union

import yaml

from nanotron_ext.cli_flags import InputFile, KeyValue
from nanotron_ext.config.compose import composed, core_class
from nanotron_ext.config.schema import Config, ConfigError
from nanotron_ext.config.yaml_io import EXP_FLOAT, ConfigLoader, dump_yaml, read_yaml, yaml_problem
from nanotron_ext.fileio import write_text_atomic

T = TypeVar("T")
_NoneType = type(None)
MAX_LISTED_UNKNOWN = 10  # a file of 20,000 stray keys is one mistake, not 20,000 lines to read



class _Mismatch(ConfigError):
    """A value of the wrong type at `path`; lets unions retry other members before reporting."""

    def __init__(self, path: str, expected: Any, value: Any, hint: str = "") -> None:
        self.path = path
        what = "a mapping (section)" if dataclasses.is_dataclass(expected) else type_name(expected)
        super().__init__(f"{path or 'config'}: expected {what}, got {_given(value)}{hint}")


def _given(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (bool)"  # spelled as in YAML
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def type_name(tp: Any) -> str:
    """A readable name for an annotation: `int`, `optional int`, `list of str`, `one of 'a', 'b'`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if tp is _NoneType:
        return "null"
    if dataclasses.is_dataclass(tp):
        return "section"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_union(tp):
        rest = [a for a in args if a is not _NoneType]
        inner = " or ".join(type_name(a) for a in rest)
        if len(rest) < len(args):
            return f"optional {inner}" if len(rest) == 1 else f"optional ({inner})"
        return inner
    if origin is list or tp is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}" if args else "mapping"
    return getattr(tp, "__name__", repr(tp))


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    # The schema uses `from __future__ import annotations`: field.type is a string, so resolve.
    return typing.get_type_hints(composed(cls))


def _init_fields(cls: type) -> List[dataclasses.Field]:
    """The keys of section `cls`, technique sections mounted under it included (compose.py)."""
    return [f for f in dataclasses.fields(composed(cls)) if f.init]


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp` and return it as the field should hold it."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(value, tp, path)
    if origin is Literal:
        return _convert_literal(value, tp, path)
    if _is_union(tp):
        return _convert_union(value, tp, path)
    if origin is list or tp is list:
        return _convert_list(value, tp, path)
    if origin is dict or tp is dict:
        return _convert_dict(value, tp, path)
    for scalar, convert in _SCALARS:
        if tp is scalar:
            return convert(value, path)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch(path, tp, value)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in the config schema")


def _convert_dataclass(value: Any, tp: Any, path: str) -> Any:
    """A nested section: a mapping (or None: every field takes its default)."""
    if value is not None and not isinstance(value, Mapping):
        raise _Mismatch(path, tp, value)
    return from_dict(tp, value, path)


def _convert_literal(value: Any, tp: Any, path: str) -> Any:
    # Compare types too: `True == 1`, so a bool would otherwise match Literal[1].
    if any(type(value) is type(a) and value == a for a in typing.get_args(tp)):
        return value
    raise _Mismatch(path, tp, value)


def _convert_union(value: Any, tp: Any, path: str) -> Any:
    """Optional[X] / Union[...]: the first member that accepts the value; a member's error from inside the value
    (e.g. one list item) is reported rather than the whole value's mismatch, being more precise."""
    args = typing.get_args(tp)
    if value is None and _NoneType in args:
        return None
    members = [a for a in args if a is not _NoneType]
    deeper: Optional[ConfigError] = None
    for member in members:
        try:
            return _convert(value, member, path)
        except _Mismatch as e:
            if e.path != path and deeper is None:
                deeper = e  # wrong inside the value (e.g. one list item): more precise
    raise deeper if deeper is not None else _Mismatch(path, tp, value)


def _convert_list(value: Any, tp: Any, path: str) -> List[Any]:
    """list / List[X]: a YAML list (or a tuple), each item converted to X."""
    if not isinstance(value, (list, tuple)):
        raise _Mismatch(path, tp, value)
    args = typing.get_args(tp)
    item_tp = args[0] if args else Any
    return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]


def _convert_dict(value: Any, tp: Any, path: str) -> Dict[Any, Any]:
    """dict / Dict[K, V]: a mapping whose keys convert to K and values to V (each under its dotted key)."""
    if not isinstance(value, Mapping):
        raise _Mismatch(path, tp, value)
    args = typing.get_args(tp)
    key_tp, val_tp = args if args else (Any, Any)
    out = {}
    for k, v in value.items():
        try:
            k = _convert(k, key_tp, path)
        except _Mismatch:
            raise ConfigError(f"{path}: keys must be {type_name(key_tp)}, got key {_given(k)}") from None
        out[k] = _convert(v, val_tp, _join(path, k))
    return out


def _convert_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise _Mismatch(path, bool, value)


def _convert_int(value: Any, path: str) -> int:
    # bool is a subclass of int in Python; `layers: true` is a mistake, not 1.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Mismatch(path, int, value)


def _convert_float(value: Any, path: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    # Dicts loaded with plain yaml.safe_load still hold `3e-4` as a string.
    if isinstance(value, str) and EXP_FLOAT.match(value):
        return float(value.replace("_", ""))
    raise _Mismatch(path, float, value)


def _convert_str(value: Any, path: str) -> str:
    if isinstance(value, str):
        return value
    hint = " (quote it in YAML to pass it as text)" if isinstance(value, (bool, int, float)) else ""
    raise _Mismatch(path, str, value, hint)


# Scalar annotations, matched by identity (`tp is bool`, ...), each with its converter.
_SCALARS: Tuple[Tuple[type, Any], ...] = (
    (bool, _convert_bool), (int, _convert_int), (float, _convert_float), (str, _convert_str))


def from_dict(cls: type[T], data: Optional[Mapping[str, Any]], path: str = "") -> T:
    """Build dataclass `cls` from a mapping, strictly: unknown keys, wrong types and missing
    required keys raise `ConfigError` naming the dotted key under `path`. `None` means an empty
    section (a YAML section whose keys are all commented out), so every field takes its default."""
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    cls = composed(cls)
    where = f"section {path}" if path else "the top level"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping for {where}, got {_given(data)}")
    fields = _init_fields(cls)
    names = [f.name for f in fields]
    unknown = [k for k in data if k not in names]
    if unknown:
        lines = []
        for key in unknown[:MAX_LISTED_UNKNOWN]:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            lines.append(f"{_join(path, key)}: unknown key{hint}")
        if len(unknown) > MAX_LISTED_UNKNOWN:
            lines.append(f"... and {len(unknown) - MAX_LISTED_UNKNOWN:,} more unknown keys in {where}")
        lines.append(f"allowed keys in section {path}: " if path else "allowed top-level keys: ")
        lines[-1] += ", ".join(names)
        raise ConfigError("\n".join(lines))
    missing = [_join(path, f.name) for f in fields if _is_required(f) and f.name not in data]
    if missing:
        raise ConfigError(f"missing required key{'s' if len(missing) > 1 else ''} in {where}: {', '.join(missing)}")
    hints = _hints(cls)
    kwargs = {name: _convert(data[name], hints[name], _join(path, name)) for name in names if name in data}
    # A ConfigError from __post_init__ already names its key: let it through untouched.
    return cls(**kwargs)


def _annotation_at(cls: type, keys: Sequence[str]) -> Any:
    """The annotation at a dotted path of `cls`, or None when the path is not in the schema."""
    tp: Any = cls
    for key in keys:
        if _is_union(tp):
            rest = [a for a in typing.get_args(tp) if a is not _NoneType]
            if len(rest) != 1:
                return None
            tp = rest[0]
        if dataclasses.is_dataclass(tp):
            if key not in {f.name for f in _init_fields(tp)}:
                return None
            tp = _hints(tp)[key]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    return tp


def _wants_text(tp: Any) -> bool:
    if _is_union(tp):
        rest = [a for a in typing.get_args(tp) if a is not _NoneType]
        return len(rest) == 1 and _wants_text(rest[0])
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str


def _has_keys(tp: Any) -> bool:
    if _is_union(tp):
        return any(_has_keys(a) for a in typing.get_args(tp))
    return dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict or tp is dict or tp is Any


def _parse_override(text: str) -> Tuple[List[str], Any, str]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(f"override {text!r} has no '=': expected KEY=VALUE, e.g. optimizer.lr=3e-4")
    keys = key.split(".")
    if not key or not all(keys):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key like optimizer.lr")
    try:
        value = yaml.load(raw, Loader=ConfigLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({yaml_problem(e)})") from None
    return keys, value, raw.strip()


def apply_overrides(
    data: Optional[Mapping[str, Any]], overrides: Sequence[str], cls: type = Config
) -> Dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` set (value parsed as YAML; later ones win).

    Unknown keys are left in: `from_dict` rejects them exactly as it rejects the file's own.
    Text fields take the text as written, so `--set general.run=2024` or `data.text_key=yes`
    do not turn into an int or a bool."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'KEY=VALUE' strings, not one string")
    out: Dict[str, Any] = copy.deepcopy(dict(data)) if data is not None else {}
    for text in overrides:
        keys, value, raw = _parse_override(text)
        if value is not None and not isinstance(value, (str, list, dict)) and _wants_text(_annotation_at(cls, keys)):
            value = raw
        for depth in range(1, len(keys)):
            tp = _annotation_at(cls, keys[:depth])
            if tp is not None and not _has_keys(tp):
                prefix = ".".join(keys[:depth])
                raise ConfigError(f"override {text!r}: {prefix} is {type_name(tp)}, it has no key {keys[depth]!r}")
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(keys[: depth + 1])
                raise ConfigError(f"override {text!r}: {prefix} is {_given(child)}, not a section with keys")
            node = child
        node[keys[-1]] = value
    return out


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML run configuration, apply `a.b=value` overrides and build the typed `Config`.
    Any problem raises `ConfigError` naming the key. An empty file is refused (a file cut to nothing, or the wrong
    file, silently trained every default); `{}` gives every default."""
    path = Path(path)
    data = read_yaml(path)
    if data is None:
        raise ConfigError(f"config file {path} is empty (no YAML document, only blank lines or comments); give a "
                          "config with its sections (python -m nanotron_ext.config doc lists them), or {} for every "
                          "default")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {_given(data)}")
    return from_dict(Config, apply_overrides(data, overrides))


def config_to_dict(config: Config) -> Dict[str, Any]:
    """The config as plain nested dicts/lists/scalars (what the YAML file holds)."""
    return dataclasses.asdict(config)


def config_to_yaml(config: Config) -> str:
    return dump_yaml(config_to_dict(config))


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically: readers never see a half-written file."""
    write_text_atomic(Path(path), config_to_yaml(config))


def add_config_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    """Add `--config-file FILE` and repeatable `--set KEY=VALUE` (read by `config_from_args`)."""
    parser.add_argument("--config-file", required=required, metavar="FILE", type=InputFile(format="yaml"),
                        help="YAML run configuration" + ("" if required else " (default: every default)"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                        help="override one key, value parsed as YAML, e.g. --set optimizer.lr=3e-4 "
                             "--set parallelism.layers_per_stage=[2,2]; repeatable, later ones win")


def config_from_args(args: argparse.Namespace) -> Config:
    """Build the Config from the arguments `add_config_args` added."""
    overrides = getattr(args, "overrides", None) or ()
    if args.config_file is None:
        return from_dict(Config, apply_overrides(None, overrides))
    return load_config(args.config_file, overrides)


@functools.lru_cache(maxsize=None)
def _source_docs(cls: type) -> Tuple[Dict[str, str], str]:
    """(field -> docstring literal after it, class docstring) from the source of `cls` alone."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}, ""  # no source (built in a REPL, frozen app): no docs rather than a crash
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return {}, ""
    docs: Dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs, ast.get_docstring(node) or ""


def section_doc(cls: type) -> str:
    """The docstring written in the class body (not the signature dataclasses makes up)."""
    return _source_docs(core_class(cls))[1]


def describe(section_cls: type) -> List[Tuple[str, str, str]]:
    """(name, readable type, doc) for each field of a config dataclass, in declaration order.
    The doc is the string literal under the field; a section field without one gets its class docstring."""
    if not dataclasses.is_dataclass(section_cls):
        raise TypeError(f"describe needs a dataclass type, got {section_cls!r}")
    docs: Dict[str, str] = {}
    for klass in reversed(composed(section_cls).__mro__):  # base-class fields first, subclasses may re-document
        if dataclasses.is_dataclass(klass):
            docs.update(_source_docs(klass)[0])
    hints = _hints(section_cls)
    section_cls = composed(section_cls)
    rows = []
    for f in _init_fields(section_cls):
        tp = hints[f.name]
        doc = docs.get(f.name, "")
        if not doc and dataclasses.is_dataclass(tp):
            doc = section_doc(tp)
        rows.append((f.name, type_name(tp), doc))
    return rows
