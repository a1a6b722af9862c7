"""What every config section shares: the error type and the checks that name the failing key."""
from __future__ import annotations

import dataclasses
import math

from nanotron_ext.errors import UserFacingError
from nanotron_ext.registry import Registry


class ConfigError(UserFacingError, ValueError):
    """A configuration value that cannot work; the message names the full key."""


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def require_registered(registry: Registry, name: str) -> None:
    """Extension names are checked against the registry (technique packages included), not a fixed list."""
    names = registry.names()
    require(name in names, registry.config_key, f"{name!r} is not available; registered: {names}")


def require_finite(section: object, prefix: str) -> None:
    """inf/nan in any float key only shows up later as a NaN loss; reject it where it is written."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {value}")
