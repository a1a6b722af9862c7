"""The section of a codec kind the config does not run (`model.codec.resbm.*` with `model.codec.kind: identity`) is
kept and value-checked, never refused or warned about (issue 53: `config show --set model.codec.resbm.h=16` was
reported as accepted silently). That is the project's rule for every such section: the core's own
`model.codec.ratio` (topk / lowrank only) and MAPL's anchor width (tests/test_config_rules.py) are checked whatever
the kind, and reproduce/resbm/cpu_base.yaml keeps ResBM's settings under `kind: identity` for its uncompressed
baseline, switched per run by `--set model.codec.kind=resbm` (reproduce/resbm/table2_convergence.py). A refusal
would break that file; a warning would fire on every baseline run. `config show` names the codec that does run
(its tier comment), so the unused section is not silent about having no effect."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nanotron_ext.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "config_tiny_llama.yaml"


def test_an_unused_codec_section_is_kept_as_given_and_the_codec_that_runs_is_named() -> None:
    done = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "show", "--config-file", str(TINY),
                           "--set", "model.codec.resbm.h=16"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    resbm = done.stdout.split("\n    resbm:\n", 1)[1]
    assert resbm.startswith("      h: 16\n      ratio: null\n"), resbm[:200]  # h given: ratio stays unset
    assert "kind: identity" in done.stdout and "identity (core)" in done.stdout, done.stdout[-800:]


@pytest.mark.parametrize("sets, message", [
    (["model.codec.resbm.h=0"], "model.codec.resbm.h: must be >= 1, got 0"),
    (["model.codec.resbm.h=16", "model.codec.resbm.ratio=4"],
     "give exactly one of model.codec.resbm.h and model.codec.resbm.ratio"),
])
def test_an_unused_codec_sections_values_are_still_checked(sets: list, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(str(TINY), sets)


def test_the_resbm_baseline_config_keeps_resbm_settings_under_identity() -> None:
    cfg = load_config(str(REPO / "reproduce" / "resbm" / "cpu_base.yaml"), [])
    assert cfg.model.codec.kind == "identity" and cfg.model.codec.resbm.h == 8 and cfg.model.codec.resbm.m == 64
