"""Communication accounting and compute-utilisation models for SparseLoCo ("Heterogeneous Low-Bandwidth
Pre-Training of LLMs", figs. 2 and 3b: utilisation over bandwidth): over the DP link between replicas
(SparseLoCo vs dense data parallelism), and over the links between a replica's pipeline stages (the
paper's figures: uncompressed vs subspace-compressed stage boundaries).

Bytes are payload bytes as the comm ledger counts them (what one replica hands to the collective).
Time model (documented choices, not the paper's; the paper does not give its formula):
- the sync blocks compute (no overlap; the streaming sync: behind `delay_steps` inner steps); each replica has its
  own link of `bandwidth_bps` bits/s, full duplex;
- SparseLoCo's all_gather of a P-byte payload as a ring: each replica receives (and forwards) (M-1) P bytes
  in M-1 hops: t = (M-1) (8 P / B + latency);
- dense DP's ring all-reduce of N bytes: 2 (M-1) hops of N / M bytes: t = 2 (M-1) (8 N / (M B) + latency);
- utilisation = compute time / (compute time + communication time) over one outer round of H inner steps
  (dense DP: H = 1, one all-reduce per step).
Pipeline-stage links (`stage_link_bytes`, `pipeline_utilisation`; also our choices):
- every boundary has its own link of `bandwidth_bps`; per inner step it carries the activations forward
  and their gradient backward, one after the other (the two directions share the link's budget);
- every stage computes for `compute_s` per inner step; "blocking": the transfers add to it, "overlapped"
  (1F1B hiding transfers behind other micro-batches perfectly): the step takes the longer of the two;
- an outer round is H such steps and one blocking outer sync.
"""
from __future__ import annotations

from typing import Iterable, Literal, Sequence, Tuple

from nanotron_ext.sparseloco.compress import chunk_spec, payload_nbytes
from nanotron_ext.sparseloco.config import SparseLoCoConfig


def outer_sync_bytes(shapes: Iterable[Sequence[int]], cfg: SparseLoCoConfig) -> int:
    """Bytes one replica sends per outer sync: packed indices + values (or codes + lookup tables)."""
    specs = [chunk_spec(s, cfg.chunk, cfg.topk) for s in shapes]
    return payload_nbytes(specs, cfg.index_bits, cfg.quant_bits, cfg.value_dtype)


def collective_time_s(
    nbytes: float, replicas: int, bandwidth_bps: float, collective: Literal["all_gather", "all_reduce"],
    latency_s: float = 0.0,
) -> float:
    """Seconds for a ring collective of `nbytes` per replica over per-replica links (module docstring)."""
    m = replicas
    if m <= 1:
        return 0.0
    if collective == "all_gather":
        return (m - 1) * (8 * nbytes / bandwidth_bps + latency_s)
    return 2 * (m - 1) * (8 * nbytes / (m * bandwidth_bps) + latency_s)


def compute_utilisation(
    step_time_s: float, inner_steps: int, nbytes: float, replicas: int, bandwidth_bps: float,
    collective: Literal["all_gather", "all_reduce"] = "all_gather", latency_s: float = 0.0, delay_steps: int = 0,
) -> float:
    """Share of wall time spent computing: H steps of `step_time_s`, then one blocking collective; with the streaming
    sync (sparseloco.streaming.delay = `delay_steps`) the collective runs behind the next `delay_steps` inner steps
    and only what outlasts them stalls compute (encoding and the outer step are not modelled, as before)."""
    compute = inner_steps * step_time_s
    comm = collective_time_s(nbytes, replicas, bandwidth_bps, collective, latency_s)
    return compute / (compute + max(0.0, comm - delay_steps * step_time_s))


def stage_link_bytes(tokens: int, width: int, value_bytes: int = 2, id_bytes: int = 0) -> Tuple[int, int]:
    """(forward, backward) bytes one pipeline boundary carries per replica step: `tokens` activations of
    `width` values (+ the token id a subspace codec sends beside each), and their gradient back (ids have
    none). Uncompressed: width = d; subspace-compressed: width = k."""
    return tokens * (width * value_bytes + id_bytes), tokens * width * value_bytes


def pipeline_step_time_s(compute_s: float, link_bytes: float, bandwidth_bps: float, overlap: bool = False) -> float:
    """One inner step of a pipeline replica whose boundaries each move `link_bytes` (both directions) over
    their own link (module docstring)."""
    transfer = 8 * link_bytes / bandwidth_bps
    return max(compute_s, transfer) if overlap else compute_s + transfer


def pipeline_utilisation(compute_s: float, link_bytes: float, bandwidth_bps: float, inner_steps: int = 1,
                         sync_s: float = 0.0, overlap: bool = False) -> float:
    """Share of an outer round (H inner steps + a blocking sync of `sync_s`) that stages spend computing."""
    step = pipeline_step_time_s(compute_s, link_bytes, bandwidth_bps, overlap)
    return inner_steps * compute_s / (inner_steps * step + sync_s)


def fold_entries_bound(vocab: int, d: int, tp: int, replicas: int, cfg: SparseLoCoConfig) -> int:
    """The most nonzero entries one outer step of heterogeneous SparseLoCo's table T_S [vocab, d] can have: what its
    embedding fold sends over a compressed pipeline (nanotron_ext.sparseloco.hetero: an 8 B count, then an int32
    index and an fp32 value per entry). Each TP rank's shard [vocab / tp, d] is chunked as SparseLoCo chunks it,
    and a chunk's step is the mean of the `replicas`' top-k: at most min(chunk, replicas x k) entries (fewer where
    replicas keep the same positions). With outer momentum the step is the momentum buffer, which keeps every
    earlier step's entries: the whole table."""
    if cfg.outer_momentum:
        return vocab * d
    spec = chunk_spec((vocab // tp, d), cfg.chunk, cfg.topk)
    return min(vocab * d, tp * spec.n_chunks * min(spec.chunk_size, replicas * spec.k))
