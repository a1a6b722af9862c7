"""A plan's figures per rank and per tier, beside `config show`'s closed forms, and the fit check.

Bytes follow the comm ledger (nanotron_ext.parallel.comm): the payload a rank hands to a call. Per tier:
- TP: one TP rank's TP-group sends over all stages of its pipeline (the closed form's unit), the pipeline's
  all-gather of scatter-gathered wires ("pp-wire") shown apart;
- PP: per stage link, the pipeline's data both ways (activations forward, gradients back, a codec's own
  exchanges) summed over the TP ranks of the stages (TP ranks send equal shares: tp x TP rank 0's), headers
  (nanotron's shape messages, an emulated link's clock) apart;
- DP: one replica's DP-group sends (tp x TP rank 0's, all stages) at the reported step, which is the DP sync's
  outer step when it has one; per inner step = that / H, the closed form's unit.
Work a technique runs every N steps only (Technique.gated_work: a Grassmann update, an outer sync's embedding fold)
is left out of those figures and shown in rows of its own, per occurrence and group, one rank's (stage 0, TP rank
0 of the replica), beside its closed form. The planned step runs it: a step counter on the meta device reads 0
(SM's `steps % grassmann_every == 0` holds), and the reported step is the DP sync's outer step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

GIB = 2**30
HEADER_OPS = ("send:meta", "send:link-clock")


def gated(cfg: Any) -> Dict[str, Any]:
    """{ledger tag: GatedWork} of the techniques `cfg` uses (nanotron_ext.technique.Technique.gated_work)."""
    from nanotron_ext.plan.run import used_techniques

    return {w.tag: w for t in used_techniques(cfg) for w in t.gated_work(cfg)}


def _tag(op: str) -> str:
    return op.rsplit(":", 1)[1] if ":" in op else ""


def _sent(ledger: Dict[str, Dict[str, Dict[str, int]]], group: str, keep: Any = lambda op: True,
          skip: Sequence[str] = ()) -> int:
    """Bytes this rank handed to `group`'s calls (receives left out), ops of the tags in `skip` left out."""
    return sum(c["bytes"] for op, c in ledger.get(group, {}).items()
               if not op.startswith("recv") and _tag(op) not in skip and keep(op))


def _gated_sent(ledger: Dict[str, Dict[str, Dict[str, int]]], tags: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """{tag: {group: bytes}} of the gated work in `ledger`."""
    out: Dict[str, Dict[str, int]] = {}
    for group in ledger:
        for tag in tags:
            n = _sent(ledger, group, lambda op, t=tag: _tag(op) == t)
            if n:
                out.setdefault(tag, {})[group] = n
    return out


def _pp_data(ledger: Dict[str, Any], direction: str) -> int:
    return _sent(ledger, "pp", lambda op: op.startswith("send") and op not in HEADER_OPS and op.endswith(direction))


def rank_row(cfg: Any, plan: Dict[str, Any], skip: Sequence[str] = ()) -> Dict[str, Any]:
    """One rank's figures (bytes, FLOPs) as the table shows them; the gated work's tags `skip` apart."""
    pp, s = cfg.parallelism.pp, plan["pp_rank"]
    role = "only stage" if pp == 1 else "first stage" if s == 0 else "last stage" if s == pp - 1 else "middle stage"
    peak, ledger = plan["peak"], plan["ledger"]
    return {
        "rank": plan["rank"], "role": f"{role} ({s + 1}/{pp}), replica {plan['dp_rank']}, TP rank {plan['tp_rank']}",
        "codec": plan["codec"], "parameters": plan["parameters"], "parameter_bytes": plan["parameter_bytes"],
        "gradient_bytes": plan["gradient_bytes"], "gradient_bytes_at_peak": peak.get("Gradient", 0),
        "optimizer_state_bytes": plan["optimizer_state_bytes"],
        "optimizer_state_by_optimizer": plan["optimizer_state_by_optimizer"],
        "dp_sync_state_bytes": plan["other_state_bytes"],
        "activation_bytes_at_peak": peak.get("Activation", 0) + peak.get("Temp", 0),
        "buffer_bytes": peak.get("Buffer", 0), "peak_bytes": peak.get("Total", 0),
        "flops": plan["flops"],
        "sent": {"tp": _sent(ledger, "tp", skip=skip), "pp_data": _pp_data(ledger, "fwd") + _pp_data(ledger, "bwd"),
                 "pp_headers": _sent(ledger, "pp", lambda op: op in HEADER_OPS), "dp": _sent(ledger, "dp", skip=skip),
                 "control": _sent(ledger, "world", skip=skip) + _sent(ledger, "mp", skip=skip)},
        "gated_sent": _gated_sent(ledger, skip),
        "ledger": ledger,
    }


def tier_rows(cfg: Any, plans: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per planned pipeline (a replica's TP rank 0, every stage): each tier's bytes beside its closed form."""
    from nanotron_ext.config.tiers import tier_forms
    from nanotron_ext.registry import DP_SYNCS

    p = cfg.parallelism
    forms = tier_forms(cfg)
    every = DP_SYNCS.owner(p.dp_sync).outer_every(cfg)
    work = gated(cfg)
    skip = list(work)
    columns: Dict[int, Dict[int, Dict[str, Any]]] = {}
    for plan in plans:
        if plan["tp_rank"] == 0:
            columns.setdefault(plan["dp_rank"], {})[plan["pp_rank"]] = plan
    rows = []
    for dp_rank, stages in sorted(columns.items()):
        if len(stages) != p.pp:
            continue  # not a whole pipeline
        ledgers = [stages[s]["ledger"] for s in range(p.pp)]
        kind = stages[0]["codec"]
        if "tp" in forms:
            form = forms["tp"][0][1]
            wire = sum(_sent(g, "tp", lambda op: op.endswith(":pp-wire")) for g in ledgers)
            rows.append(_row(dp_rank, kind, "TP, one TP rank, all stages",
                             sum(_sent(g, "tp", lambda op: not op.endswith(":pp-wire"), skip) for g in ledgers), form,
                             1, f"scatter-gather all-gathers {wire:,} B"))
        for s in range(p.pp - 1):
            entries = forms.get("pp", [])
            form = entries[dp_rank][1] if dp_rank < len(entries) else None
            copies = 1 if form is None or p.pp_scatter_gather or form.tp_sharded else p.tp
            link = p.tp * (_pp_data(ledgers[s], "fwd") + _pp_data(ledgers[s + 1], "bwd"))
            headers = p.tp * (_sent(ledgers[s], "pp", lambda op: op in HEADER_OPS)
                              + _sent(ledgers[s + 1], "pp", lambda op: op in HEADER_OPS))
            rows.append(_row(dp_rank, kind, f"PP, link {s}-{s + 1}, both ways", link, form, copies,
                             f"headers {headers:,} B"))
        if "dp" in forms:
            dp = p.tp * sum(_sent(g, "dp", skip=skip) for g in ledgers)
            what = "DP, one replica" + (f", per outer step (H = {every})" if every > 1 else "")
            rows.append(_row(dp_rank, kind, what, dp, forms["dp"][0][1], every, "closed form x H" if every > 1 else ""))
        rows += _gated_rows(dp_rank, kind, stages[0]["ledger"], work)
    ran = {r["tag"] for r in rows if "tag" in r}
    for w in work.values():  # not run in the planned step (SparseLoCo's Grassmann sync at a later outer step)
        if w.tag not in ran:
            rows += [_gated_row(None, "-", w, group, None, n, "not in the planned step")
                     for group, n in w.bytes.items()]
    return rows


def _gated_rows(replica: int, codec: str, ledger: Dict[str, Any], work: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One row per gated work and group its ledger shows (stage 0, TP rank 0 of the replica), per occurrence."""
    rows = []
    for tag, groups in _gated_sent(ledger, list(work)).items():
        w = work[tag]
        for group, n in sorted(groups.items()):
            rows.append(_gated_row(replica, codec, w, group, n, w.bytes.get(group), "per occurrence"))
    return rows


def _gated_row(replica: Optional[int], codec: str, w: Any, group: str, ledger: Optional[int],
               closed: Optional[float], note: str) -> Dict[str, Any]:
    return {"replica": replica, "codec": codec, "tier": f"every {w.every} steps: {w.what}, {group}, one rank",
            "every": w.every, "tag": w.tag, "group": group, "ledger_bytes": ledger, "closed_form_bytes": closed,
            "ratio": None if ledger is None or not closed else ledger / closed, "closed_form": w.formula, "note": note}


def _row(replica: int, codec: str, what: str, ledger: int, form: Any, scale: int, note: str) -> Dict[str, Any]:
    closed = None if form is None else form.total * scale
    return {"replica": replica, "codec": codec, "tier": what, "ledger_bytes": ledger, "closed_form_bytes": closed,
            "ratio": None if not closed else ledger / closed, "closed_form": None if form is None else form.formula,
            "note": note}


def summarise(cfg: Any, plans: Sequence[Dict[str, Any]], alternative: Optional[Dict[str, Any]] = None,
              device: str = "cuda") -> Dict[str, Any]:
    """The plan as JSON: the layout, the device its memory is planned for, each rank's row, each tier's row (gated
    work at its cadence), the plan with the memory switches flipped."""
    p, t = cfg.parallelism, cfg.tokens
    tokens = t.micro_batch_size * t.sequence_length * t.batch_accumulation_per_replica
    work = gated(cfg)
    out: Dict[str, Any] = {
        "layout": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "world": p.dp * p.tp * p.pp, "pp_engine": p.pp_engine},
        "tokens_per_replica_step": tokens, "dtype": cfg.model.dtype, "device": device,
        "gated": [{"tag": w.tag, "every": w.every, "what": w.what, "bytes": dict(w.bytes), "formula": w.formula}
                  for w in work.values()],
        "ranks": [rank_row(cfg, plan, list(work)) for plan in plans],
        "tiers": tier_rows(cfg, plans),
    }
    if alternative is not None:
        out["switched"] = alternative
    return out


def too_big(summary: Dict[str, Any], gpu_gib: float) -> Optional[str]:
    """One line naming the first rank whose peak exceeds `gpu_gib` GiB and its largest part, or None."""
    parts = {"parameters": "parameter_bytes", "gradients": "gradient_bytes", "optimizer state": "optimizer_state_bytes",
             "DP sync state": "dp_sync_state_bytes", "activations": "activation_bytes_at_peak"}
    for row in summary["ranks"]:
        if row["peak_bytes"] > gpu_gib * GIB:
            name, key = max(parts.items(), key=lambda kv: row[kv[1]])
            return (f"rank {row['rank']} ({row['role']}) needs {row['peak_bytes'] / GIB:.1f} GiB at peak, more than "
                    f"--gpu-memory {gpu_gib:g} GiB; its largest part: {name} {row[key] / GIB:.1f} GiB")
    return None


def _b(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def render(summary: Dict[str, Any], title: str) -> str:
    lay = summary["layout"]
    lines = [f"plan: {title}",
             f"layout dp={lay['dp']} x tp={lay['tp']} x pp={lay['pp']} = {lay['world']} ranks ({lay['pp_engine']}); "
             f"{summary['tokens_per_replica_step']:,} tokens per replica step; {summary['dtype']}; memory as "
             f"{summary.get('device', 'cpu')} allocates it (--device)",
             "", "per rank (one iteration after the first: optimiser state exists; meta tensors, fake process groups):"]
    head = ("rank", "role", "params", "weights", "grads", "optimizer", "DP-sync state", "activations", "peak",
            "TFLOP/step")
    rows = [head]
    for r in summary["ranks"]:
        rows.append((str(r["rank"]), f"{r['role']}, {r['codec']}", f"{r['parameters'] / 1e6:,.1f}M",
                     _b(r["parameter_bytes"]), _b(r["gradient_bytes"]), _b(r["optimizer_state_bytes"]),
                     _b(r["dp_sync_state_bytes"]), _b(r["activation_bytes_at_peak"]), _b(r["peak_bytes"]),
                     f"{r['flops'] / 1e12:.3g}"))
    if "switched" in summary:
        for r in summary["switched"]["ranks"]:
            rows.append((str(r["rank"]), f"  with {', '.join(summary['switched']['set'])}", "", "", "", "", "",
                         _b(r["activation_bytes_at_peak"]), _b(r["peak_bytes"]), f"{r['flops'] / 1e12:.3g}"))
    lines += _table(rows)
    lines += ["", "bytes per step by tier (the ledger of the planned ranks) beside `config show`'s closed forms:"]
    rows = [("replica", "tier", "ledger", "closed form", "ratio", "note")]
    for t in summary["tiers"]:
        rows.append(("-" if t["replica"] is None else f"{t['replica']} ({t['codec']})", t["tier"],
                     _b(t["ledger_bytes"]), _b(t["closed_form_bytes"]),
                     "-" if t["ratio"] is None else f"{t['ratio']:.4f}", t["note"]))
    lines += _table(rows)
    for w in summary.get("gated", []):
        lines.append(f"  every {w['every']} steps: {w['what']} (left out of the per-step figures above): "
                     f"{w['formula']}")
    lines += ["", "peak = tensors alive at once (allocator figure; add the CUDA context, NCCL buffers and "
                  "fragmentation on a GPU)"]
    return "\n".join(lines) + "\n"


def _table(rows: List[Sequence[str]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
