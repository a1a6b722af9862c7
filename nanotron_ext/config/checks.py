"""What every config section shares: the error type and the checks that name the failing key."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

from nanotron_ext.errors import UserFacingError
from nanotron_ext.registry import ExtensionPoint, residual_sharded, techniques

if TYPE_CHECKING:
    from nanotron_ext.config.schema import ModelConfig


class ConfigError(UserFacingError, ValueError):
    """A configuration value that cannot work; the message names the full key."""


def require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


SEED_LIMIT = 2**63  # torch generators take 64 bits (seed + 1 is drawn from too); numpy's SeedSequence no negative


def require_seed(value: int, key: str) -> None:
    """A seed torch and numpy both accept: -1 or 2^70 passed load, then each rank failed with a traceback."""
    require(0 <= value < SEED_LIMIT, key, f"must be in [0, 2^63), got {value}")


def require_registered(registry: ExtensionPoint, name: str) -> None:
    """Extension names are checked against what registered techniques declare (no implementation is imported),
    and so are the techniques the owner of `name` builds on (`Technique.requires`)."""
    names = registry.names()
    require(name in names, registry.config_key, f"{name!r} is not available; registered: {names}")
    owner = registry.owner(name)
    registered = sorted(t.name for t in techniques())
    for needed in owner.requires:
        require(needed in registered, registry.config_key,
                f"{name!r} is technique {owner.name!r}, which needs technique {needed!r}, and {needed!r} is not "
                f"registered (registered: {registered}); install the package that provides {needed!r}, or choose "
                f"another {registry.config_key}")


def require_finite(section: object, prefix: str) -> None:
    """inf/nan in any float key only shows up later as a NaN loss; reject it where it is written."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ConfigError(f"{prefix}.{f.name}: must be a finite number, got {value}")


def machine_memory_bytes() -> int:
    """Physical memory of this machine (os.sysconf; 0 where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


RESIDUAL_KEYS = ("model.codec.kind", "model.embedding.kind", "model.output_constraint.kind")


def check_residual_layout(model: "ModelConfig", tp: int) -> None:
    """One config error naming both keys when a piece that needs the residual stream replicated over TP
    (Technique.needs_replicated_residual) meets a TP strategy that shards it (Technique.shards_residual)
    at tp > 1: caught here, before any process group, instead of as a traceback on every rank. Likewise an
    output constraint on a TP strategy that exposes no output projections (Technique.no_output_projections)."""
    constraint = model.output_constraint.kind
    require(constraint in (None, "none") or not any(model.tp_strategy in t.no_output_projections for t in techniques()),
            "model.output_constraint.kind", f"{constraint!r} cannot run with model.tp_strategy={model.tp_strategy!r}: "
            "its layers have no single weight writing into the residual stream to constrain; use model.tp_strategy="
            "'btp' (or 'megatron' for a full-rank model)")
    if not residual_sharded(model.tp_strategy, tp):
        return
    for key in RESIDUAL_KEYS:
        value = model
        for part in key.split(".")[1:]:
            value = getattr(value, part)
        for t in techniques():
            reason = t.needs_replicated_residual.get(f"{key}={value}")
            require(reason is None, key,
                    f"{value!r} cannot run with model.tp_strategy={model.tp_strategy!r} at parallelism.tp={tp}: "
                    f"{reason} (the strategy shards the residual stream on d); use parallelism.tp=1 or a strategy "
                    "that keeps the residual stream replicated")
