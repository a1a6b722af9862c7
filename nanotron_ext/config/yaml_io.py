"""YAML reading and writing for configs: YAML 1.2 exponent floats, duplicate keys refused, aliases, size and nesting
bounded.

Split from loader.py (which turns the parsed data into typed sections): everything here is about the text.
"""
from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any, Dict

import yaml

from nanotron_ext.config.schema import ConfigError

# PyYAML implements YAML 1.1, whose float needs a dot and a signed exponent: `3e-4` and `1.0e5`
# load as strings. This is the YAML 1.2 exponent form that 1.1 misses.
EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


# A config has a few hundred values; aliases may repeat a section (`<<: *base`), never blow it up
# exponentially (a 1 KB "billion laughs" file: 9 aliases of 9 aliases of ... expands to 9^9 values).
MAX_YAML_NODES = 100_000
# The largest config we ship is ~3 KB. PyYAML parses ~200 KB/s of keys, so a 10 MB file kept a command busy for
# minutes (and /dev/zero until MemoryError): anything this much larger than a config is refused unread.
MAX_CONFIG_BYTES = 256 * 1024
# Configs nest ~5 deep (parallelism.link.per_stage_pair.0-1.bandwidth_mbps); PyYAML's composer recurses per
# level, so 10,000 nested `[` ran into a RecursionError only after the scanner's quadratic work (49 s).
MAX_YAML_DEPTH = 32


def _expanded_size(node: yaml.Node, sizes: Dict[int, int], open_: set) -> int:
    """Nodes `node` stands for once every alias is expanded; memoised per node, so linear in the file."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise yaml.composer.ComposerError(None, None, "an alias refers to a node that contains it (a recursive "
                                          "alias); configs must be trees", node.start_mark)
    open_.add(key)
    children: list = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_)
        if total > MAX_YAML_NODES:  # stop counting: the answer is already "too many"
            break
    open_.discard(key)
    sizes[key] = total
    return total


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads `3e-4` as a float, rejects duplicate keys and bounds what aliases expand to."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"values nested more than {MAX_YAML_DEPTH} deep, far beyond any config",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        if node is not None and _expanded_size(node, {}, set()) > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"its aliases (*name) expand to more than {MAX_YAML_NODES:,} values, far beyond any "
                "config (an alias bomb?); write the sections out or use fewer aliases", node.start_mark)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # PyYAML keeps the last of two equal keys silently; a second `model:` section would
        # then replace the first wholesale. Only the node's own keys count (not `<<` merges).
        seen: dict = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                ident = (key_node.tag, key_node.value)
                if ident in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key_node.value!r} (first at line {seen[ident].line + 1})",
                        key_node.start_mark)
                seen[ident] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


class ConfigDumper(yaml.SafeDumper):
    """SafeDumper whose resolver matches `ConfigLoader`, so a string like "1e3" is written quoted."""


for _cls in (ConfigLoader, ConfigDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", EXP_FLOAT, list("-+.0123456789"))


def yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if mark is None:
        return problem
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and context_mark is not None and context_mark.line != mark.line:
        # e.g. an unclosed `[` is only noticed at the end of the file; say where it opened.
        text += f" ({context} at line {context_mark.line + 1})"
    return text


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISSOCK, "a socket"))


def _too_big(path: Path, size: str) -> str:
    return (f"config file {path} is {size}, more than the {MAX_CONFIG_BYTES:,} a config may have (a run config is a "
            "few KB); is it the right file?")


def read_config_text(path: Path) -> str:
    """The text of config file `path`, checked before reading: a regular file (a FIFO would block, /dev/zero never
    ends), at most MAX_CONFIG_BYTES, UTF-8. Any problem is a one-line ConfigError naming the file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"config file {path} is a folder; give a YAML file")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "a special file")
        raise ConfigError(f"config file {path} is {kind}, not a file; give a YAML file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(_too_big(path, f"{st.st_size:,} bytes"))
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # bounded even if the file grows after stat
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(_too_big(path, f"over {MAX_CONFIG_BYTES:,} bytes"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                          "a YAML config is text") from None


def read_yaml(path: Path) -> Any:
    """The YAML document in `path` (None when empty); any problem is a ConfigError naming the file and line."""
    text = read_config_text(path)
    try:
        return yaml.load(text, Loader=ConfigLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML at {yaml_problem(e)}") from None


def dump_yaml(data: Any, flow: bool = False) -> str:
    """YAML text that `load_config` reads back to equal values (keys kept in schema order);
    `flow` writes one line (`[q, k]`, `{}`) for showing a single value."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=False, default_flow_style=flow, allow_unicode=True,
                     width=10_000 if flow else 80)
