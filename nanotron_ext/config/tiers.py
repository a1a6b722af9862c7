"""Which piece of a config runs on which bandwidth tier (TP inside a stage, PP between stages, DP between
replicas), and its bytes per step by closed form, asked of the technique that owns it (nanotron_ext.registry;
`Technique.closed_form_bytes`, whose forms are nanotron_ext.metrics.tier_bytes.TierBytes). `config show` prints
these (nanotron_ext/config/__main__.py); the planner and the WAN meter read their sum over the whole job
(`job_bytes_per_step`, beside the per-tier forms it adds up)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from nanotron_ext.registry import CODECS, DP_SYNCS, TP_STRATEGIES

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config
    from nanotron_ext.metrics.tier_bytes import TierBytes


def replica_codecs(cfg: "Config") -> Dict[str, Tuple[List[int], "Config"]]:
    """codec kind -> (the DP replicas that run it, the first such replica's config): heterogeneous SparseLoCo
    gives some replicas a codec of their own (the DP sync's `replica_config`)."""
    out: Dict[str, Tuple[List[int], "Config"]] = {}
    for replica in range(cfg.parallelism.dp):
        rcfg = DP_SYNCS.owner(cfg.parallelism.dp_sync).replica_config(cfg, replica)
        out.setdefault(rcfg.model.codec.kind, ([], rcfg))[0].append(replica)
    return out


def tier_forms(cfg: "Config") -> Dict[str, List[Tuple[str, Optional["TierBytes"]]]]:
    """Each tier with more than one rank: (what, closed form) from the owner of its piece; the PP tier one entry
    per codec the replicas run (heterogeneous SparseLoCo gives some replicas their own)."""
    p, m = cfg.parallelism, cfg.model
    forms: Dict[str, List[Tuple[str, Optional["TierBytes"]]]] = {}
    if p.tp > 1:
        tb = TP_STRATEGIES.owner(m.tp_strategy).closed_form_bytes("model.tp_strategy", m.tp_strategy, cfg)
        forms["tp"] = [("TP bytes per step per TP rank, all stages", tb)]
    if p.pp > 1:
        by_kind = replica_codecs(cfg)
        for kind, (replicas, rcfg) in by_kind.items():
            tb = CODECS.owner(kind).closed_form_bytes("model.codec.kind", kind, rcfg)
            on = f", replicas {replicas}" if len(by_kind) > 1 else ""
            forms.setdefault("pp", []).extend([(f"PP bytes per step per stage link ({kind}{on})", tb)] * len(replicas))
    if p.dp > 1:
        tb = DP_SYNCS.owner(p.dp_sync).closed_form_bytes("parallelism.dp_sync", p.dp_sync, cfg)
        forms["dp"] = [("DP bytes per step per replica", tb)]
    return forms


# -- the whole job: the sum the planner and the WAN meter read (kept beside the forms it adds up) --
def job_bytes_per_step(cfg: "Config") -> Dict[str, Optional[float]]:
    """Closed-form bytes per step of the whole job by tier, all ranks together (what the WAN meter's ledger
    column sums): every TP rank of every replica; every stage link of every replica (a TP-replicated wire
    crosses once, or tp times with parallelism.pp_scatter_gather=false unless its TP ranks send disjoint shards
    of it); every replica. None where a piece has no closed form."""
    p = cfg.parallelism
    out: Dict[str, Optional[float]] = {}
    for tier, entries in tier_forms(cfg).items():
        forms = [tb for _, tb in entries]
        if any(tb is None for tb in forms):
            out[tier] = None
        elif tier == "pp":
            out[tier] = (p.pp - 1) * sum(tb.total * (1 if p.pp_scatter_gather or tb.tp_sharded else p.tp)
                                         for tb in forms)  # type: ignore[union-attr]
        else:
            out[tier] = (p.tp * p.dp if tier == "tp" else p.dp) * forms[0].total  # type: ignore[union-attr]
    return out
