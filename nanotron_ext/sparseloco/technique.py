"""SparseLoCo's Technique: the `sparseloco` section, the "sparseloco" DP sync, the per-replica model
configs of heterogeneous SparseLoCo, and the rules across sections."""
from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, List, Optional, Tuple

from nanotron_ext.config.checks import ConfigError, check_residual_layout, require
from nanotron_ext.registry import techniques
from nanotron_ext.sparseloco.config import SparseLoCoConfig
from nanotron_ext.subspace.technique import grassmann_work, heterogeneous_replica
from nanotron_ext.technique import GatedWork, Technique

if TYPE_CHECKING:
    from nanotron_ext.config.schema import Config
    from nanotron_ext.metrics.tier_bytes import TierBytes


class SparseLoCoTechnique(Technique):
    name = "sparseloco"
    sections = {"sparseloco": SparseLoCoConfig}
    provides = {"parallelism.dp_sync": ["sparseloco"]}
    requires = ("subspace",)  # heterogeneous SparseLoCo runs Subspace Models on its compressed replicas
    # where and how patiently a fault-tolerant replica meets the others: free across a resume
    resume_free = tuple(f"sparseloco.fault_tolerance.{k}" for k in (
        "lighthouse", "min_replicas", "timeout_s", "quorum_timeout_s", "max_retries"))
    uncompressed = ("sparseloco.compressed_replicas=[]",)  # every replica the full model
    pieces = "nanotron_ext.sparseloco.pieces:SparseLoCoPieces"
    simulated = "nanotron_ext.sparseloco.simulate:outer_loop"

    def check(self, cfg: "Config") -> None:
        s, m, p = cfg.sparseloco, cfg.model, cfg.parallelism
        if p.dp_sync != "sparseloco":
            default = SparseLoCoConfig()
            changed = [f.name for f in dataclasses.fields(s) if getattr(s, f.name) != getattr(default, f.name)]
            if changed:
                others = f" (also set: {', '.join(changed[1:])})" if changed[1:] else ""
                raise ConfigError(f"sparseloco.{changed[0]}: {getattr(s, changed[0])!r} is set{others}, but "
                                  f"parallelism.dp_sync={p.dp_sync!r} ignores the sparseloco section; set "
                                  "parallelism.dp_sync=sparseloco, or drop the section (--set sparseloco=null). "
                                  "Per-step averaging of mixed replicas runs only in the simulated mode "
                                  "(sparseloco.simulate.run_simulated, mode 'dense')")
            return
        if s.fault_tolerance.enabled:
            require(p.dp == 1, "parallelism.dp", f"{p.dp}: with sparseloco.fault_tolerance.enabled each replica is "
                    "its own job (parallelism.dp = 1); start one job per replica with its "
                    "sparseloco.fault_tolerance.replica")
            require(not (s.compressed_replicas and s.grassmann_every), "sparseloco.grassmann_every",
                    f"{s.grassmann_every}: with sparseloco.fault_tolerance.enabled the shared U would need the "
                    "compressed replicas' gradient statistics averaged across replica jobs (not built); set it to 0")
        if s.churn.down_syncs:
            require(not s.fault_tolerance.enabled, "sparseloco.churn.down_syncs",
                    f"{s.churn.down_syncs}: emulated churn is for one job; with sparseloco.fault_tolerance.enabled "
                    "replicas really leave and rejoin (kill one); set sparseloco.churn.down_syncs=0")
            require(p.dp >= 2, "sparseloco.churn.down_syncs", f"{s.churn.down_syncs}: emulated churn drops one of the "
                    f"replicas from some syncs; parallelism.dp={p.dp} has no other to go on with (set dp >= 2)")
        if not s.compressed_replicas:
            return
        n, key = replicas(cfg)
        bad = [r for r in s.compressed_replicas if r >= n]
        require(not bad, "sparseloco.compressed_replicas", f"{bad} are not replicas ({key}={n})")
        for key, value, default in (("model.codec.kind", m.codec.kind, "identity"),
                                    ("model.embedding.kind", m.embedding.kind, "standard"),
                                    ("model.output_constraint.kind", m.output_constraint.kind, "none")):
            require(value == default, key, f"{value!r}: with sparseloco.compressed_replicas the per-replica model is "
                                           f"set by sparseloco; leave {key} at {default!r}")
        if m.subspace.grassmann_every:
            raise ConfigError("model.subspace.grassmann_every: with sparseloco.compressed_replicas each replica's U "
                              "would follow its own gradients; set sparseloco.grassmann_every (one U for all replicas)")
        require(bool(cfg.codec_boundaries()), "sparseloco.compressed_replicas",
                f"{s.compressed_replicas} compress nothing: their subspace codec sits at model.codec.boundaries="
                f"{m.codec.boundaries!r}, and parallelism.pp={p.pp} has no such boundary; set parallelism.pp >= 2, or "
                "model.codec.boundaries=every_layer (or a list of sending layers)")
        self._check_replica_models(cfg)

    def _check_replica_models(self, cfg: "Config") -> None:
        """The keys replica_config sets must pass the rules the run's own keys pass (the TP layout, the split
        table's): a compressed and an uncompressed replica each, so a refusal is one config error here
        rather than a traceback on every rank of the replicas that build it."""
        s = cfg.sparseloco
        plain = [r for r in range(replicas(cfg)[0]) if r not in s.compressed_replicas]
        for replica in [s.compressed_replicas[0], *plain[:1]]:
            rc = self._replica_model(cfg, replica in s.compressed_replicas)
            try:
                check_residual_layout(rc.model, rc.parallelism.tp)
                for t in techniques():
                    if t is not self:
                        t.check(rc)
            except ConfigError as e:
                raise ConfigError(f"{e} [heterogeneous SparseLoCo: "
                                  f"sparseloco.compressed_replicas={s.compressed_replicas} sets "
                                  f"model.embedding.kind={rc.model.embedding.kind!r}"
                                  + (f", model.codec.kind={rc.model.codec.kind!r}" if replica in s.compressed_replicas
                                     else "") + f" on replica {replica}]") from None

    def replica_config(self, cfg: "Config", replica: int) -> "Config":
        """Heterogeneous (sec. 2.3): replicas in sparseloco.compressed_replicas run the subspace codec, the
        others uncompressed, every one with the adapted split table (a copy; the run's config otherwise)."""
        s = cfg.sparseloco
        if not s.compressed_replicas:
            return cfg
        if s.fault_tolerance.enabled:  # one job per replica (dp = 1): this job's is fault_tolerance.replica
            replica = s.fault_tolerance.replica
        return self._replica_model(cfg, replica in s.compressed_replicas)

    def _replica_model(self, cfg: "Config", compressed: bool) -> "Config":
        s = cfg.sparseloco
        out = copy.deepcopy(cfg)
        heterogeneous_replica(out.model, compressed, reproject=s.weight_projection,
                              modified_adamw=s.modified_adamw, grassmann_every=s.grassmann_every)
        return out

    def outer_overlap(self, cfg: "Config") -> int:
        """The streaming sync's delay tau (sparseloco.streaming.delay): its all_gather runs behind tau inner steps."""
        return cfg.sparseloco.streaming.delay if cfg.sparseloco is not None else 0

    def gated_work(self, cfg: "Config") -> List[GatedWork]:
        """Heterogeneous SparseLoCo's work at outer syncs: the embedding fold (every H steps: over a compressed
        pipeline the step's nonzero entries, at their bound, and at tp > 1 the step's rows over TP), and the
        Grassmann update of the shared U (every sparseloco.grassmann_every steps)."""
        from nanotron_ext.sparseloco.accounting import fold_entries_bound

        s, p, m = cfg.sparseloco, cfg.parallelism, cfg.model
        if not s.compressed_replicas:
            return []
        out = []
        if s.embedding_adaptation:
            n = fold_entries_bound(m.vocab_size, m.hidden_size, p.tp, replicas(cfg)[0], s)
            shard = m.vocab_size // p.tp * m.hidden_size * 4
            out.append(GatedWork(
                "embedding_fold", s.inner_steps, "embedding fold (heterogeneous SparseLoCo)",
                {"pp": 8 + 8 * n, **({"tp": shard} if p.tp > 1 else {})},
                f"pp (compressed pipelines): an 8 B count + 8 B per entry of the outer step, at most {n:,} (every "
                f"TP shard's {s.chunk}-chunks x min(chunk, dp x top-{s.topk})"
                f"{'; outer momentum keeps every entry' if s.outer_momentum else ''}; the whole V x d x 4 B at a "
                "Grassmann sync)" + ("; tp: the step's V / tp x d rows in fp32" if p.tp > 1 else "")))
        if s.grassmann_every:
            out.append(grassmann_work(s.grassmann_every, m.hidden_size,
                                      "Grassmann update of the shared U (sparseloco.grassmann_every)"))
        return out

    def closed_form_bytes(self, key: str, name: str, cfg: "Config") -> Optional["TierBytes"]:
        """One outer sync's compressed pseudo-gradient (indices + values of the top-k per chunk), spread over
        its inner steps."""
        from nanotron_ext.metrics.tier_bytes import TierBytes
        from nanotron_ext.models.param_count import param_shapes
        from nanotron_ext.sparseloco.accounting import outer_sync_bytes

        s = cfg.sparseloco
        payload = outer_sync_bytes(param_shapes(self.replica_config(cfg, 0)), s)  # every replica: the same shapes
        values = f"{s.quant_bits}-bit codes" if s.quant_bits else f"{s.value_dtype} values"
        extra = ("; + the changed rows of T_fixed on compressed replicas (data-dependent)"
                 if s.compressed_replicas and s.embedding_adaptation else "")
        if cfg.parallelism.tp > 1:  # each TP rank compresses its own shards (tests/test_composed_matrix.py)
            extra += ("; the unsharded model's tensors: at tp > 1 every TP rank compresses its own shards (more "
                      "chunks) and sends its copy of replicated tensors, so the ledger reads more")
        return TierBytes(payload / s.inner_steps, 0.0,
                         f"top-{s.topk} of every {s.chunk}-chunk ({s.index_bits}-bit indices, {values}): "
                         f"{payload:,} B per outer sync / {s.inner_steps} inner steps{extra}")


def replicas(cfg: "Config") -> Tuple[int, str]:
    """The replicas of the outer loop and the key that sets them: the DP ranks, or with fault tolerance (one job
    per replica, dp = 1) sparseloco.fault_tolerance.replicas."""
    ft = cfg.sparseloco.fault_tolerance
    if ft.enabled:
        return ft.replicas, "sparseloco.fault_tolerance.replicas"
    return cfg.parallelism.dp, "parallelism.dp"


technique = SparseLoCoTechnique()
