"""Parameter counts of the BOOST Table 8 configs, computed from each config, and the formula tested
against real models.

    python reproduce/boost/param_counts.py                 # every reproduce/boost/*.yaml + the check at TP=1
    python reproduce/boost/param_counts.py --check-tp 2    # also check sharded models on 2 gloo ranks
    python reproduce/boost/param_counts.py --json out.json

The analytic count (per decoder layer: two RMSNorms of d; per linear in x out either in*out or, when
factorised, r*(in + out); qk-norm weights when enabled; plus embedding, untied head and final norm)
is checked against tiny models actually built with build_model for every registered TP strategy
and low-rank kind: the sum over the model's distinct parameters of their UNSHARDED shapes
(nanotron's sharded-parameter info), so at TP > 1 the check also covers the sharding metadata.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nanotron_ext.cli_checks import Writer
from nanotron_ext.cli_flags import InputFile, Int, OutputFile, Parser, one_line_refusals

HERE = Path(__file__).resolve().parent
# --json replaces only a result this script wrote (cli_checks.Writer)
COUNTS = Writer("reproduce/boost/param_counts.py", legacy_keys=("configs", "checks"))

# tiny shapes for the built-model check: MHA and GQA, qk-norm, tied and untied embeddings, a rank
# that is not d/4, and a partial set of factorised linears
CHECK_SHAPES: List[Dict[str, Any]] = [
    {"hidden_size": 32, "ffn_size": 88, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "vocab_size": 320},
    {"hidden_size": 48, "ffn_size": 128, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 384,
     "qk_norm": True, "tie_embeddings": True, "low_rank": {"rank": 10}},
    {"hidden_size": 32, "ffn_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "vocab_size": 288,
     "low_rank": {"targets": ["q", "o", "up", "down"]}},
]


def analytic_params(model: Any) -> Dict[str, int]:
    """Parameter count of a ModelConfig by component (unsharded, tied parameters once)."""
    d, f, v = model.hidden_size, model.ffn_size, model.vocab_size
    q_out, kv_out = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes = {"q": (d, q_out), "k": (d, kv_out), "v": (d, kv_out), "o": (q_out, d),
              "gate": (d, f), "up": (d, f), "down": (f, d)}
    low = model.low_rank.kind != "none"
    r = model.low_rank.width(model.hidden_size)

    def linear(name: str) -> int:
        i, o = shapes[name]
        return r * (i + o) if low and name in model.low_rank.targets else i * o

    attn = sum(linear(n) for n in ("q", "k", "v", "o"))
    mlp = sum(linear(n) for n in ("gate", "up", "down"))
    norms = 2 * d + (2 * model.head_dim if model.qk_norm else 0)
    out = {
        "embedding": v * d,
        "head": 0 if model.tie_embeddings else v * d,
        "final_norm": d,
        "attention": model.num_layers * attn,
        "mlp": model.num_layers * mlp,
        "layer_norms": model.num_layers * norms,
    }
    out["total"] = sum(out.values())
    out["non_embedding"] = out["total"] - out["embedding"] - out["head"]
    return out


def built_params(model: Any) -> int:
    """Distinct parameters of a built (possibly sharded) model, counted at their unsharded shapes."""
    from nanotron_ext.models.init import full_shape

    unique = {id(p): p for p in model.parameters()}.values()
    return sum(full_shape(p).numel() for p in unique)


def check_cases(strategies: Sequence[str], tp: int) -> List[Tuple[Dict[str, Any], str, str]]:
    """(shape, strategy, low-rank kind) combinations the check builds at TP = `tp`."""
    out = []
    for shape in CHECK_SHAPES:
        if any(shape[k] % tp for k in ("hidden_size", "ffn_size", "num_heads", "num_kv_heads", "vocab_size")):
            continue
        for strategy in strategies:
            for kind in (["none"] if strategy == "megatron" else ["svd", "cola", "lax"]):
                out.append((shape, strategy, kind))
    return out


def build_and_compare(shape: Dict[str, Any], strategy: str, kind: str, ctx: Any) -> Tuple[int, int]:
    """(analytic, built) parameter counts of one tiny model on this rank's layout."""
    from nanotron_ext.config.loader import from_dict
    from nanotron_ext.config.schema import Config
    from nanotron_ext.models.build import build_model

    model = dict(shape)
    low_rank = dict(model.pop("low_rank", {}))
    low_rank["kind"] = kind
    if kind == "none":
        low_rank.pop("rank", None)
        low_rank.pop("targets", None)
    tp = ctx.tp_pg.size()
    cfg = from_dict(Config, {"parallelism": {"tp": tp},
                             "model": {**model, "max_seq_len": 16, "low_rank": low_rank, "tp_strategy": strategy},
                             "tokenizer": {"vocab_size": 260}, "tokens": {"sequence_length": 16}})
    return analytic_params(cfg.model)["total"], built_params(build_model(cfg, ctx))


def check_built(strategies: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Build every check case on the current process group's layout (initialising a one-process
    gloo group on a free port when none exists) and return one record per case."""
    import torch.distributed as td

    from nanotron_ext.parallel.context import standalone_context
    from nanotron_ext.registry import TP_STRATEGIES

    created = not td.is_initialized()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = standalone_context(tp=world)  # a lone process: one gloo rank on a free port, no variables left behind
    strategies = [s for s in (strategies or TP_STRATEGIES.names()) if s in TP_STRATEGIES.names()]
    records = []
    try:
        for shape, strategy, kind in check_cases(strategies, world):
            analytic, built = build_and_compare(shape, strategy, kind, ctx)
            records.append({"shape": shape, "strategy": strategy, "kind": kind, "tp": world,
                            "analytic": analytic, "built": built, "ok": analytic == built})
    finally:
        if created:
            td.destroy_process_group()
    return records


def config_table(paths: Sequence[Path]) -> List[Dict[str, Any]]:
    from nanotron_ext.config.loader import load_config

    rows = []
    for path in paths:
        cfg = load_config(path)
        counts = analytic_params(cfg.model)
        m = cfg.model
        rows.append({"config": path.name, "layers": m.num_layers, "d": m.hidden_size, "d_ff": m.ffn_size,
                     "heads": m.num_heads, "low_rank": m.low_rank.kind,
                     "r": m.low_rank.width(m.hidden_size) if m.low_rank.kind != "none" else None, **counts})
    # low-rank share of the full-rank model of the same size (same file prefix)
    full = {r["config"].rsplit("_", 1)[0]: r["total"] for r in rows if r["low_rank"] == "none"}
    for r in rows:
        base = full.get(r["config"].rsplit("_", 1)[0])
        r["fraction_of_full_rank"] = r["total"] / base if base else None
    return rows


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", type=InputFile(format="yaml"),
                   help="YAML configs (default: reproduce/boost/*.yaml)")
    p.add_argument("--check-tp", type=Int(1), default=1, help="also build the check models at this TP on gloo ranks")
    p.add_argument("--json", type=OutputFile(COUNTS),  # checked when parsed: before any count
                   help="write the counts and check results here (replaces only a file it wrote)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:  # under torchrun: print this rank's check records as JSON on rank 0
        records = check_built()
        if int(os.environ.get("RANK", "0")) == 0:
            print("RECORDS " + json.dumps(records))
        return 0
    paths = [Path(c) for c in args.configs] or sorted(HERE.glob("llama_*.yaml"), key=_size_key)
    rows = config_table(paths)
    print(f"{'config':<26} {'layers':>6} {'d':>6} {'d_ff':>6} {'r':>5} {'params':>15} {'non-emb':>15} {'x full':>7}")
    for r in rows:
        frac = "-" if r["fraction_of_full_rank"] is None else f"{r['fraction_of_full_rank']:.3f}"
        print(f"{r['config']:<26} {r['layers']:>6} {r['d']:>6} {r['d_ff']:>6} {r['r'] or '-':>5} "
              f"{r['total']:>15,} {r['non_embedding']:>15,} {frac:>7}")
    records = check_built()
    if args.check_tp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.check_tp),
               __file__, "--worker"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORDS ")]
        if proc.returncode != 0 or not found:
            print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"the TP={args.check_tp} check failed (rc={proc.returncode})")
        records += json.loads(found[-1][len("RECORDS "):])
    bad = [r for r in records if not r["ok"]]
    by_tp: Dict[int, List[Dict[str, Any]]] = {}
    for r in records:
        by_tp.setdefault(r["tp"], []).append(r)
    for tp, recs in sorted(by_tp.items()):
        combos = sorted({f"{r['strategy']}/{r['kind']}" for r in recs})
        print(f"check at TP={tp}: {sum(r['ok'] for r in recs)}/{len(recs)} built tiny models match the formula "
              f"({', '.join(combos)})")
    for r in bad:
        print(f"MISMATCH {r['strategy']}/{r['kind']} tp={r['tp']} {r['shape']}: analytic {r['analytic']} "
              f"built {r['built']}", file=sys.stderr)
    if args.json:
        COUNTS.write_json(args.json, {"configs": rows, "checks": records})
    return 1 if bad else 0


def _size_key(path: Path) -> Tuple[int, str]:
    size = path.stem.split("_")[1]
    return int(size.rstrip("b")), path.stem


if __name__ == "__main__":
    raise SystemExit(main())
