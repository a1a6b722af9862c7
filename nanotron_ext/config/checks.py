"""What every config section shares: the error type and the checks that name the failing key."""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os

from nanotron_ext.errors import UserFacingError
from nanotron_ext.registry import ExtensionPoint


class ConfigError(UserFacingError, ValueError):
    """A configuration value that cannot work; the message names the full key."""


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def require_registered(registry: ExtensionPoint, name: str) -> None:
    """Extension names are checked against what registered techniques declare (no implementation is imported)."""
    names = registry.names()
    require(name in names, registry.config_key, f"{name!r} is not available; registered: {names}")


def require_finite(section: object, prefix: str) -> None:
    """inf/nan in any float key only shows up later as a NaN loss; reject it where it is written."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {value}")


@functools.lru_cache(maxsize=None)  # once per process and key: configs are built many times (replicas, scripts)
def warn_deprecated(old_key: str, new_key: str) -> None:
    """One line on stderr: `old_key` still works, `new_key` is its name now."""
    logging.getLogger("nanotron_ext.config").warning(
        "config: %s is deprecated, it sets %s now (rename the key to silence this)", old_key, new_key)


def machine_memory_bytes() -> int:
    """Physical memory of this machine (os.sysconf; 0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
