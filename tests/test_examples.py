"""Every YAML users start from loads with the strict loader and describes a runnable layout."""
from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_ext.config.loader import load_config

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "examples").glob("*.yaml")) + sorted((REPO / "reproduce").glob("**/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_loads_and_validates(path: Path) -> None:
    cfg = load_config(path)
    p = cfg.parallelism
    cfg.validate(world_size=p.dp * p.tp * p.pp)
