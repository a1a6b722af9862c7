"""Heterogeneous SparseLoCo ("Heterogeneous Low-Bandwidth Pre-Training of LLMs", sec. 2.3, 2.4): some DP
replicas run their pipeline with the subspace codec (nanotron_ext.subspace), the others uncompressed,
all inside one SparseLoCo outer loop.

- Per-replica model config (technique.SparseLoCoTechnique.replica_config, applied by the core's
  models.build.replica_config for dp_sync "sparseloco"): replicas listed in sparseloco.compressed_replicas
  get the subspace codec and constraint (parameterisation "projection": the full output weights, so every
  replica has the same parameter names and shapes and SparseLoCo can average them); every replica gets
  embedding.kind = subspace_adapted (T_S [V, d] trained + T_fixed [V, d] state). Subspace owns those keys
  (nanotron_ext.subspace.technique.heterogeneous_replica); the switches of Table 4 map onto them:
  weight_projection -> reproject, modified_adamw -> modified_adamw.
- Embedding adaptation (sec. 2.4, `split_`, `fold_step`): at start T_S = T U U^T, T_fixed = T - T U U^T;
  after every outer sync T_fixed += T_S - T_S U U^T, T_S <- T_S U U^T (eq. 3-4), where T_S is the synced
  table, i.e. SparseLoCo's global copy of it (outer.SparseLoCoOuter.global_params): the global copy is
  projected too. Were only the replicas' copies projected, the global copy would keep the out-of-span part
  already folded into T_fixed, every later pseudo-gradient (global - local) would carry it again and it would
  be folded again (its norm grew from 0.03 to 1.15 over 10 syncs in a tiny run). With the global copy
  projected, T_fixed + T_S follows plain SparseLoCo's table exactly (the same pseudo-gradients: the
  uncompressed replicas' forward uses T_fixed + T_S; tests/test_sparseloco_hetero.py, float64 reference).
  Since the global T_S is in span(U) before the sync, the fold only touches the rows the outer step u
  changed: f = u U U^T - u on those rows, T_fixed += f, T_S -= f (all rows when a Grassmann update moved U).
  The sum T_fixed + T_S is unchanged and, as every replica applies the same f, so is T_fixed everywhere.
- Grassmann updates with one U shared by all replicas (`sparseloco.grassmann_every`, Table 4c): the
  compressed replicas' last codec decoders accumulate A = sum G^T G during the inner steps; at every
  outer sync that ends a multiple of grassmann_every inner steps, A is averaged over them (one world
  all-reduce; in the simulated mode over the in-process hubs), every replica takes the same new U
  (nanotron_ext.subspace.grassmann.grassmann_update without moving weights, which must stay identical
  across replicas), and embedding adaptation then re-splits the synced table on the new U.
- `HeteroHook` runs both once per sync on the global copy ("after_apply", before the replicas take it) and
  folds f into each replica's T_fixed ("after_sync"), in both drivers (SparseLoCoSync, SimulatedReplicas).
  The later stages of a compressed pipeline decode with T_fixed (X = Z U^T + T_fixed[ids]) but hold no
  T_S: the embedding's stage sends them what changed over the replica's pp group, counted by the ledger as
  pp `broadcast:embedding_fold` (outer-sync traffic outside the SparseLoCo payload): at start T_fixed
  (V d x 4 B); at a sync the outer step's nonzero entries (8 B count + 8 B per entry: int32 flat index, fp32
  value), from which they compute f with the same ops; at a Grassmann sync f itself (V d x 4 B: U moved,
  every row changes). The step has at most M k nonzeros per 4096-element chunk (M replicas' top-k), e.g.
  6.25% of the table at M = 8, k = 32: 0.5 B per table element against 4 B for the whole T_fixed; sending
  changed rows instead would not help at the paper's M = 8, where 1 - (1 - 1/64)^(M k) ~ 98% of the rows of
  a 64 x 64 tile receive an entry.
- With the streaming sync (sparseloco.streaming.delay = tau > 0) the fold runs at arrival (t + tau), on the global
  copy as above; each replica then merges, T_S = alpha T_S + (1 - alpha) (global T_S - f), and takes alpha f more at
  "after_sync" (`HeteroHook.keep` = alpha; 0 for the blocking sync, where a replica takes the global copy), so f
  leaves every copy of T_S as T_fixed takes it and T_fixed + T_S is plain streaming SparseLoCo's merged table. A
  replica's T_S stays off span(U) by what it trained during the delay (as within any inner loop): only its span
  part reaches a compressed pipeline's later stages (tests/test_sparseloco_streaming_hetero.py, float64 reference).
- Under TP (Megatron's, or BOOST's btp, for whose sharded residual stream the lookup is sliced:
  nanotron_ext.subspace.embedding.AdaptedSplitEmbedding) the table T_S is vocab-sharded (each TP rank holds
  rows [min_id, max_id), and SparseLoCo syncs each shard over its own DP group) while T_fixed is replicated. Adaptation
  is row-wise in V: the initial split and the fold act on this rank's rows, and the TP group all-gathers the rest
  (`_gather_rows`; the outer step, or f after a Grassmann update, V d x 4 B per sync over the fast TP link, ledger tp
  `all_gather:embedding_fold`), so every TP rank computes the same f for every row and T_fixed stays replicated.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
from nanotron import distributed as dist
from torch import nn

from nanotron_ext.config.schema import Config
from nanotron_ext.parallel.comm import get_ledger
from nanotron_ext.sparseloco.accounting import fold_entries_bound
from nanotron_ext.subspace.basis import SubspaceHub
from nanotron_ext.subspace.embedding import AdaptedSplitEmbedding
from nanotron_ext.subspace.grassmann import grassmann_update
from nanotron_ext.subspace.pieces import hub_of


def find_embedding(model: nn.Module) -> Optional[AdaptedSplitEmbedding]:
    """This rank's adapted embedding (None on ranks without the first stage)."""
    return next((m for m in model.modules() if isinstance(m, AdaptedSplitEmbedding)), None)


def _gather_rows(rows: torch.Tensor, tp_pg: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The whole [V, d] from every TP rank's [V / tp, d] rows (as is at tp = 1)."""
    if tp_pg is None or tp_pg.size() == 1:
        return rows
    out = torch.empty((rows.shape[0] * tp_pg.size(), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    with get_ledger().tag(FOLD_TAG):
        dist.all_gather_into_tensor(out, rows.contiguous(), group=tp_pg)
    return out


@torch.no_grad()
def split_(emb: AdaptedSplitEmbedding, adaptation: bool) -> None:
    """Initial split of the standard table T (T_S as initialised): T_S = T U U^T, and T_fixed = T - T U U^T
    with adaptation; without it T_fixed stays the subspace package's seeded table (Table 4a 'without')."""
    t = emb.table.weight
    u = emb.hub.basis.to(t.dtype)
    in_span = (t @ u) @ u.T
    if adaptation:
        emb.hub.fixed.copy_(_gather_rows(t - in_span, emb.tp_pg))
    t.copy_(in_span)


def changed_rows(step: torch.Tensor) -> torch.Tensor:
    """Rows of an outer step [V, d] with a nonzero entry."""
    return step.ne(0).any(dim=1).nonzero().squeeze(1)


def fold_step(step_rows: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """f = s U U^T - s for the changed rows s of an outer step (T_S was in span(U) before it): what eq. 3 adds
    to T_fixed and eq. 4 takes from T_S. Every stage computes it with these ops, so the copies agree bitwise."""
    u = basis.to(step_rows.dtype)
    return (step_rows @ u) @ u.T - step_rows


def fold_nbytes(nonzeros: Optional[int], vocab: int, d: int) -> int:
    """Bytes the embedding's stage broadcasts to the later stages of a compressed pipeline for one fold: the
    step's nonzero entries (a count, int32 index + fp32 value each), or the whole V x d table (None: at start and
    after a Grassmann update)."""
    return vocab * d * 4 if nonzeros is None else 8 + 8 * nonzeros


FOLD_TAG = "embedding_fold"  # ledger: pp broadcast:embedding_fold


class HeteroHook:
    """ReplicaHook of heterogeneous SparseLoCo. `hubs[r]` / `embeddings[r]`: replica r's hub and embedding
    on this process (the distributed driver knows only its own replica; the simulated one knows all);
    `table_index`: the position of T_S among the synchronised parameters (None where no stage of this
    process holds the embedding)."""

    def __init__(self, cfg: Config, hubs: Dict[int, SubspaceHub],
                 embeddings: Dict[int, Optional[AdaptedSplitEmbedding]],
                 pp_pg: Optional[dist.ProcessGroup] = None, syncs: Optional[Callable[[], int]] = None,
                 table_index: Optional[int] = None) -> None:
        """`syncs()`: outer syncs done so far, the one just applied included (the driver's SparseLoCoOuter.syncs)."""
        self.cfg, self.hubs, self.embeddings, self.pp_pg, self.syncs = cfg, hubs, embeddings, pp_pg, syncs
        self.table_index = table_index
        st = cfg.sparseloco.streaming  # the share of its own table a replica keeps at a sync (0: takes the global)
        self.keep = st.alpha if st.delay else 0.0
        self._emb = next((e for e in embeddings.values() if e is not None), None)  # its TP group and rows
        self._previous: Optional[torch.Tensor] = None  # the global T_S after the last fold (in span(U))
        self._fold: Optional[Tuple[Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]] = None
        for hub in hubs.values():
            hub.grassmann_in_step = False  # updates happen at outer syncs, for all replicas at once

    @property
    def _basis(self) -> torch.Tensor:
        return self.hubs[min(self.hubs)].basis  # every replica's U is the same (seed, shared updates)

    def start(self, replica: int) -> None:
        """The initial split (every replica computes the same one from the same initial T)."""
        emb = self.embeddings[replica]
        if emb is not None:
            split_(emb, self.cfg.sparseloco.embedding_adaptation)
            self._previous = emb.table.weight.detach().float().clone()  # the global copy starts from it
        if self._compressed_pipeline(replica):
            with get_ledger().tag(FOLD_TAG):  # T_fixed = T - T U U^T exists only on the embedding's stage
                dist.broadcast(self.hubs[replica].fixed, src=dist.get_global_rank(self.pp_pg, 0), group=self.pp_pg)

    def __call__(self, replica: int, params: Sequence[torch.Tensor], moment: str) -> None:
        if moment == "global_loaded" and self.table_index is not None:  # resumed: the global T_S is the last fold's
            self._previous = params[self.table_index].detach().clone()
        elif moment == "after_apply":  # once per sync, on the global copies, before any replica takes them
            grassmann = self._grassmann_due()
            if grassmann:
                grassmann_update(list(self.hubs.values()), move_weights=False)
            self._fold = None
            if self.cfg.sparseloco.embedding_adaptation and self.table_index is not None:
                self._fold = self._fold_global(params[self.table_index], grassmann)
        elif moment == "after_sync" and self.cfg.sparseloco.embedding_adaptation:
            fixed = self.hubs[replica].fixed
            fold = self._share_fold(replica) if self._compressed_pipeline(replica) else self._fold
            if fold is not None:
                rows, f, _ = fold
                if rows is None:
                    fixed.add_(f)
                else:
                    fixed[rows] += f
                if self.keep and self.table_index is not None:
                    self._fold_local(params[self.table_index], self.embeddings[replica], rows, f)

    @torch.no_grad()
    def _fold_local(self, table: torch.Tensor, emb: AdaptedSplitEmbedding, rows: Optional[torch.Tensor],
                    f: torch.Tensor) -> None:
        """Streaming: the replica's T_S became alpha T_S + (1 - alpha) (global - f) at the merge; taking alpha f too
        moves f out of every copy of the table, as T_fixed took it, so T_fixed + T_S is plain streaming's merge."""
        mine = emb.local_rows()
        lo = mine.start or 0
        if rows is None:  # f over every row (after a Grassmann update)
            table.sub_(f[lo:lo + table.shape[0]], alpha=self.keep)
            return
        here = (rows >= lo) & (rows < lo + table.shape[0])
        table[rows[here] - lo] -= self.keep * f[here]

    @torch.no_grad()
    def _fold_global(self, table: torch.Tensor, grassmann: bool):
        """Project the global T_S (this TP rank's rows) back onto span(U) and return (rows or None for all, f,
        the step) over the whole vocabulary (eq. 3-4): what T_fixed, replicated over TP, takes."""
        tp_pg, mine = self._emb.tp_pg, self._emb.local_rows()
        step = self._previous - table  # this sync's outer step on these rows (zero outside the entries it sent)
        if grassmann:  # U moved: re-split every row on the new U
            u = self._basis.to(table.dtype)
            f_mine = table - (table @ u) @ u.T
            table.sub_(f_mine)
            self._previous = table.detach().clone()
            return None, _gather_rows(f_mine, tp_pg), None
        step = _gather_rows(step, tp_pg)  # every TP rank folds every row with the same ops: T_fixed stays replicated
        rows = changed_rows(step)
        f = fold_step(step[rows], self._basis)
        lo = mine.start or 0
        hi = table.shape[0] + lo
        here = (rows >= lo) & (rows < hi)
        table[rows[here] - lo] -= f[here]
        self._previous = table.detach().clone()
        return rows, f, step

    def _grassmann_due(self) -> bool:
        every = self.cfg.sparseloco.grassmann_every
        if not every or self.syncs is None:
            return False
        return self.syncs() * self.cfg.sparseloco.inner_steps % every == 0

    def _compressed_pipeline(self, replica: int) -> bool:
        return (self.pp_pg is not None and self.pp_pg.size() > 1
                and replica in self.cfg.sparseloco.compressed_replicas)

    @torch.no_grad()
    def _share_fold(self, replica: int):
        """The fold on every stage of a compressed pipeline: the embedding's stage sends the step's nonzero
        entries (or f itself after a Grassmann update) over the pp group; the later stages rebuild f."""
        src = dist.get_global_rank(self.pp_pg, 0)
        first = dist.get_rank(self.pp_pg) == 0
        fixed = self.hubs[replica].fixed
        vocab, d = fixed.shape
        with get_ledger().tag(FOLD_TAG):
            if self._grassmann_now():  # all rows changed: f itself
                f = self._fold[1] if first else torch.empty_like(fixed)
                dist.broadcast(f, src=src, group=self.pp_pg)
                return None, f, None
            if first:
                step = self._fold[2]
                flat = step.reshape(-1).ne(0).nonzero().squeeze(1)
                count = torch.tensor([flat.numel()], dtype=torch.int64, device=fixed.device)
            else:
                count = torch.zeros(1, dtype=torch.int64, device=fixed.device)
            dist.broadcast(count, src=src, group=self.pp_pg)
            # planned (python -m nanotron_ext.plan: meta tensors, no values to count): the message at its bound
            planned = fixed.device.type == "meta"
            p = self.cfg.parallelism  # T_S is vocab-sharded over TP, each shard chunked apart
            n = fold_entries_bound(vocab, d, p.tp, p.dp, self.cfg.sparseloco) if planned else int(count.item())
            packed = torch.empty(2 * n, dtype=torch.float32, device=fixed.device)
            if first and not planned:
                packed[:n] = flat.to(torch.int32).view(torch.float32)
                packed[n:] = step.reshape(-1)[flat]
            dist.broadcast(packed, src=src, group=self.pp_pg)
        if first:
            return self._fold[:2] + (None,)
        step = torch.zeros(vocab * d, dtype=torch.float32, device=fixed.device)
        step[packed[:n].view(torch.int32).long()] = packed[n:]
        step = step.view(vocab, d)
        rows = changed_rows(step)
        return rows, fold_step(step[rows], self._basis), None

    def _grassmann_now(self) -> bool:
        """Whether this sync's fold re-split every row (a Grassmann update ran at "after_apply")."""
        return self._grassmann_due()


def hetero_hook(cfg: Config, models: Dict[int, nn.Module], pp_pg: Optional[dist.ProcessGroup] = None,
                syncs: Optional[Callable[[], int]] = None) -> HeteroHook:
    """The hook for replicas `models` (replica -> this process's model of it), each built from
    its replica config (models.build.replica_config), with the initial split done; `syncs` as in HeteroHook."""
    hubs = {r: hub_of(m) for r, m in models.items()}
    embeddings = {r: find_embedding(m) for r, m in models.items()}
    table_index = None
    for r, emb in embeddings.items():
        if emb is not None:  # the position of T_S among the parameters SparseLoCo synchronises
            trainable = [p for _, p in models[r].named_parameters() if p.requires_grad]
            table_index = next(i for i, p in enumerate(trainable) if p is emb.table.weight)
    hook = HeteroHook(cfg, hubs, embeddings, pp_pg, syncs, table_index)
    for r in models:
        hook.start(r)
    return hook
