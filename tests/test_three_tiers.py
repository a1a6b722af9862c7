"""Three bandwidth tiers in one job (issue 17): {megatron, btp} x {identity, resbm, subspace, mapl} x
{allreduce, sparseloco, heterogeneous sparseloco} at dp = 2 x tp = 2 x pp = 2. Every combination either
loads or fails at config load with one line naming both keys (exit 2 from the command line), never as a
traceback from a rank that builds the model."""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from nanotron_ext.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
HET = REPO / "examples" / "config_tiny_het_sparseloco.yaml"  # d = 128, 4 layers, dp = 2, pp = 2, compressed_replicas [0]

STRATEGIES = ("megatron", "btp")
CODECS = ("identity", "resbm", "subspace", "mapl")
SYNCS = ("allreduce", "sparseloco", "het_sparseloco")


def overrides(strategy: str, codec: str, sync: str, tp: int = 2) -> List[str]:
    sets = [f"parallelism.tp={tp}", "parallelism.pp=2", "parallelism.dp=2", f"model.codec.kind={codec}"]
    if strategy == "btp":
        sets += ["model.low_rank.kind=cola", "model.tp_strategy=btp"]
    if sync == "allreduce":
        sets += ["parallelism.dp_sync=allreduce", "sparseloco=null"]
    elif sync == "sparseloco":
        sets += ["sparseloco.compressed_replicas=[]"]
    return sets


def refusal(strategy: str, codec: str, sync: str) -> Optional[str]:
    """What the config loader must say about this combination at tp = 2 (None: it loads). Written from the
    techniques' constraints, not read back from the loader."""
    if sync == "het_sparseloco" and codec != "identity":
        # meaningless: heterogeneous SparseLoCo sets each replica's codec itself (subspace or none)
        return f"model.codec.kind: '{codec}': with sparseloco.compressed_replicas the per-replica model is set by sparseloco"
    if strategy == "btp" and codec != "identity":
        return f"model.codec.kind: '{codec}' cannot run with model.tp_strategy='btp' at parallelism.tp=2"
    if sync == "het_sparseloco" and strategy == "btp":
        return ("model.codec.kind: 'subspace' cannot run with model.tp_strategy='btp' at parallelism.tp=2"
                "|sparseloco.compressed_replicas=[0]")
    if sync == "het_sparseloco":
        return ("parallelism.tp: 2 with model.embedding.kind='subspace_adapted'"
                "|sparseloco.compressed_replicas=[0] sets model.embedding.kind='subspace_adapted'")
    return None


MATRIX = list(itertools.product(STRATEGIES, CODECS, SYNCS))


@pytest.mark.parametrize("strategy,codec,sync", MATRIX)
def test_every_combination_loads_or_fails_at_load_naming_both_keys(strategy: str, codec: str, sync: str) -> None:
    expected = refusal(strategy, codec, sync)
    if expected is None:
        cfg = load_config(HET, overrides(strategy, codec, sync))
        assert (cfg.model.codec.kind, cfg.parallelism.tp) == (codec, 2)
        return
    with pytest.raises(ConfigError) as e:
        load_config(HET, overrides(strategy, codec, sync))
    message = str(e.value)
    assert "\n" not in message and all(part in message for part in expected.split("|")), message


def test_the_sharded_residual_rule_leaves_tp_1_alone() -> None:
    """At tp = 1 BTP's shard is the whole residual stream: the rule does not refuse (the layout BOOST's own
    tests and the het example with a low-rank model use)."""
    load_config(HET, overrides("btp", "identity", "het_sparseloco", tp=1))
    load_config(HET, overrides("btp", "resbm", "allreduce", tp=1))


@pytest.mark.parametrize("strategy,codec,sync", [("btp", "mapl", "allreduce"), ("megatron", "identity", "het_sparseloco")])
def test_command_line_prints_one_line_and_exits_2(strategy: str, codec: str, sync: str) -> None:
    """The two the issue found as per-rank tracebacks: MAPL under BTP, heterogeneous SparseLoCo at tp = 2."""
    out = subprocess.run([sys.executable, "-m", "nanotron_ext.config", "show", "--config-file", str(HET),
                          *[a for kv in overrides(strategy, codec, sync) for a in ("--set", kv)]],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    first = refusal(strategy, codec, sync).split("|")[0]
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and first in out.stderr, out.stderr
