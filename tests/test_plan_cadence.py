"""Work a technique runs every N steps only, planned at its cadence (issue 39): `python -m nanotron_ext.plan` took SM's
Grassmann update (a world all-reduce of d x d float64) as per-step traffic, and heterogeneous SparseLoCo's embedding
fold (the outer step's nonzero entries of T_S, broadcast over a compressed pipeline) at 8 B, the count alone (a
meta tensor has no entries to count), and never in the tier table.

References, not derived from the planner: the same config's plan without the gated work (grassmann_every 0,
embedding_adaptation false) for the per-step figures; hand formulas for what one occurrence sends (the Grassmann
update: an int64 boundary index, then d x d + 1 float64; the fold: an 8 B count + 8 B per entry, at most dp x top-k
entries per 4096-element chunk); the outer steps of a real (simulated, in-process) heterogeneous run, whose nonzero
entries stay within that bound.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.conftest import SMALL_VOCAB
from tests.test_trainer import _small_overrides

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "config_tiny_llama.yaml")
pytestmark = pytest.mark.slow  # each test plans with several processes


def _summary(sets: List[str]) -> Dict[str, Any]:
    from nanotron_ext.config import load_config
    from nanotron_ext.plan.__main__ import plan
    from nanotron_ext.plan.run import default_ranks

    cfg = load_config(TINY, sets)
    return plan(TINY, sets, cfg, default_ranks(cfg))


def _gated_rows(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [t for t in summary["tiers"] if t["tier"].startswith("every")]


SM = ["parallelism.dp=1", "parallelism.pp=2", "model.codec.kind=subspace", "model.subspace.k=16",
      "model.tie_embeddings=false"]


def test_the_grassmann_update_is_planned_once_every_grassmann_every_steps() -> None:
    d, every = 128, 5
    gated = _summary(SM + [f"model.subspace.grassmann_every={every}"])
    plain = _summary(SM + ["model.subspace.grassmann_every=0"])
    for g, p in zip(gated["ranks"], plain["ranks"]):  # per step: what a run without Grassmann updates sends
        assert g["sent"] == p["sent"], (g["sent"], p["sent"])
        assert g["gated_sent"] == {"grassmann": {"world": 8 + 8 * (d * d + 1)}}
    assert [t["tier"] for t in gated["tiers"] if not t["tier"].startswith("every")] == \
        [t["tier"] for t in plain["tiers"]]
    rows = _gated_rows(gated)
    assert [(r["every"], r["group"], r["ledger_bytes"], r["ratio"]) for r in rows] == \
        [(every, "world", 8 + 8 * (d * d + 1), 1.0)]
    assert not _gated_rows(plain)


def _het(corpus: Path, out: Path, adaptation: bool = True) -> List[str]:
    """The tiny model at d = 32 (tests.test_trainer): dp = 2 replicas, replica 0 compressed, top-8 of 4096, H = 2."""
    return _small_overrides(corpus, out, 2, 1, 2, 4) + [
        "parallelism.dp_sync=sparseloco", "sparseloco.inner_steps=2", "sparseloco.topk=8",
        "sparseloco.compressed_replicas=[0]", "model.subspace.k=8",
        f"sparseloco.embedding_adaptation={str(adaptation).lower()}"]


def test_the_embedding_fold_is_planned_at_its_bound(small_corpus: Path, tmp_path: Path) -> None:
    # T_S [V, 32]: 32 is no multiple of 64, so no 64 x 64 tiles: runs of at most 4,096 elements, in each of which the
    # outer step (the mean of dp = 2 replicas' top-8) has at most 2 x 8 entries
    bound = math.ceil(SMALL_VOCAB * 32 / 4096) * 2 * 8
    sets = _het(small_corpus, tmp_path)
    folded, unfolded = _summary(sets), _summary(_het(small_corpus, tmp_path, adaptation=False))
    rows = _gated_rows(folded)
    assert [(r["replica"], r["every"], r["group"], r["ledger_bytes"]) for r in rows] == [(0, 2, "pp", 8 + 8 * bound)]
    assert rows[0]["ratio"] == 1.0
    per_step = [t for t in folded["tiers"] if not t["tier"].startswith("every")]
    assert [(t["tier"], t["ledger_bytes"]) for t in per_step] == \
        [(t["tier"], t["ledger_bytes"]) for t in unfolded["tiers"]]
    assert sum(r["gated_sent"].get("embedding_fold", {}).get("pp", 0) for r in folded["ranks"]) == 2 * (8 + 8 * bound)
    # a real run's outer steps (two replicas trained in this process, H = 2, 4 steps: 2 syncs) stay within it
    nonzeros = _real_outer_step_entries(_het(small_corpus, tmp_path / "real") + ["parallelism.pp=1",
                                                                                 "model.codec.boundaries=[1]"])
    assert len(nonzeros) == 2 and all(bound * 0.9 <= n <= bound for n in nonzeros), nonzeros


def _real_outer_step_entries(sets: List[str]) -> List[int]:
    """The nonzero entries of T_S's outer step at every sync of a simulated run (what the fold would send)."""
    from nanotron_ext.config import load_config
    from nanotron_ext.sparseloco.hetero import HeteroHook
    from nanotron_ext.sparseloco.simulate import run_simulated

    seen: List[int] = []
    plain = HeteroHook._fold_global

    def recording(self: HeteroHook, table: Any, grassmann: bool) -> Any:
        rows, f, step = plain(self, table, grassmann)
        seen.append(int(step.ne(0).sum()))
        return rows, f, step

    HeteroHook._fold_global = recording  # type: ignore[method-assign]
    try:
        run_simulated(load_config(TINY, sets), 2, "sparseloco")
    finally:
        HeteroHook._fold_global = plain  # type: ignore[method-assign]
    return seen
