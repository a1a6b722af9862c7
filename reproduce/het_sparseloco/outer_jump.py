"""The loss jump after each SparseLoCo outer sync (issue 30): what explains it, measured.

In every CPU run of SparseLoCo the validation loss rises right after each outer sync (reproduce/wan,
cpu_three_tiers and cpu_internet-200m-50ms). This script measures the jump at every sync with simulated replicas
(nanotron_ext.sparseloco.simulate.run_simulated, equal to the trainer bit for bit): the validation loss of each
replica's local weights just before the sync (mean over replicas) and of the global weights every replica takes
just after it, and how far the global weights moved relative to the replicas' mean progress,

    moved = ||g_new - g_old|| / ||mean_r(local_r) - g_old||      (1.0 for plain averaging, DiLoCo at outer lr 1)

for the paper's SparseLoCo (k = 32 of 4096, error feedback beta 0.95, outer lr 1) against a dense DiLoCo outer step
at the same H (k = 4096, fp32 values: the replicas are averaged), and with one factor changed at a time: no error
feedback (beta 0), outer lr 0.8 (the paper's tuned runs) and 2, density k = 128 and 512. Gradients averaged every
step (dense DP) give the loss to beat. Same model, data, seeds and steps for every variant; nothing tuned.

    python reproduce/het_sparseloco/outer_jump.py --seeds 1 2 --out reproduce/het_sparseloco/results/cpu_outer_jump.json
    python reproduce/het_sparseloco/outer_jump.py --from-json reproduce/het_sparseloco/results/cpu_outer_jump.json \
        --out reproduce/het_sparseloco/results/cpu_outer_jump.json
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Sequence

import torch

from nanotron_ext.bench import report as br
from nanotron_ext.bench.paper import mean_se
from nanotron_ext.cli_flags import one_line_refusals
from nanotron_ext.config.loader import load_config
from nanotron_ext.data.loader import build_validation_loader
from nanotron_ext.sparseloco.outer import ReplicaHook
from nanotron_ext.sparseloco.simulate import run_simulated
from nanotron_ext.train.replica import Replica

VARIANTS: Dict[str, List[str]] = {  # label -> sparseloco.* overrides ("dense DP": gradients averaged every step)
    "dense DP (every step)": [],
    "DiLoCo (k = 4096, fp32)": ["topk=4096", "value_dtype=fp32"],
    "SparseLoCo k = 32 (paper)": [],
    "k = 32, no error feedback": ["beta=0.0"],
    "k = 32, outer lr 0.8": ["outer_lr=0.8"],
    "k = 32, outer lr 2": ["outer_lr=2.0"],
    "k = 128": ["topk=128"],
    "k = 512": ["topk=512"],
}
BASE = ["tokens.sequence_length=64", "tokens.train_steps=200", "optimizer.warmup_steps=30",
        "sparseloco.inner_steps=10", "tokens.val_steps=4", "logging.progress_bar=false"]


def jump_observer(batches: Sequence[Any], syncs: List[Dict[str, float]]) -> Callable[[List[Replica]], ReplicaHook]:
    """A hook factory for run_simulated: per sync, the mean validation loss of the replicas' local weights before
    it, the global weights' after it, and `moved` (the module docstring)."""
    def mean_val(rep: Replica) -> float:
        with torch.no_grad():
            return statistics.fmean(float(x) for x in rep.validation_losses(list(batches)))

    def make(reps: List[Replica]) -> ReplicaHook:
        g_old = [p.detach().float().clone() for p in reps[0].model.parameters() if p.requires_grad]
        before: List[float] = []
        local: List[List[torch.Tensor]] = []

        def hook(r: int, params: Sequence[torch.Tensor], moment: str) -> None:
            nonlocal g_old
            if moment == "before_encode":
                before.append(mean_val(reps[r]))
                local.append([p.detach().float().clone() for p in params])
            elif moment == "after_apply":
                progress = sum(float(((sum(ps) / len(ps)) - g).square().sum()) for *ps, g in zip(*local, g_old))
                moved = sum(float((g_new.float() - g).square().sum()) for g_new, g in zip(params, g_old))
                syncs.append({"before": statistics.fmean(before), "moved": (moved / progress) ** 0.5})
                g_old = [p.detach().float().clone() for p in params]
                before.clear()
                local.clear()
            elif moment == "after_sync" and r == 0:
                syncs[-1]["after"] = mean_val(reps[0])
        return hook
    return make


def measure(args: Any) -> Dict[str, Any]:
    rows = []
    for seed, (label, extra) in itertools.product(args.seeds, VARIANTS.items()):
        cfg = load_config(args.config_file, BASE + [f"general.seed={seed}"] + args.overrides
                          + [f"sparseloco.{kv}" for kv in extra])
        batches = list(itertools.islice(build_validation_loader(cfg, dp_rank=0, dp_size=1,
                                                                config_file=args.config_file),
                                        cfg.tokens.val_steps))
        syncs: List[Dict[str, float]] = []
        t0 = time.perf_counter()
        dense = label.startswith("dense DP")
        out = run_simulated(cfg, args.replicas, "dense" if dense else "sparseloco", args.config_file,
                            observe=None if dense else jump_observer(batches, syncs))
        print(f"seed {seed} {label}: final val {out['val_loss']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows.append({"variant": label, "seed": seed, "final_val_loss": out["val_loss"], "syncs": syncs,
                     "sync_bytes": (out["sync_bytes"] or [None])[0], "train_loss": out["train_loss"]})
    meta = br.run_meta({"config_file": args.config_file, "overrides": BASE + args.overrides,
                        "replicas": args.replicas, "seeds": args.seeds})
    return {"meta": meta, "rows": rows}


def _pm(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """mean ± standard error over seeds; "-" without values."""
    mean, se = mean_se(values)
    return "-" if mean is None else fmt.format(mean) + ("" if se is None else f" ± {se:.3f}")


def summarise(rows: Sequence[Dict[str, Any]]) -> List[List[Any]]:
    """Per variant: jump (after - before) over the first 5 and the last 5 syncs, `moved` likewise, final val."""
    body = []
    for label in VARIANTS:
        runs = [r for r in rows if r["variant"] == label]
        jumps = [[s["after"] - s["before"] for s in r["syncs"]] for r in runs if r["syncs"]]
        moved = [[s["moved"] for s in r["syncs"]] for r in runs if r["syncs"]]
        body.append([label, len(runs[0]["syncs"]) if runs else 0,
                     *(_pm([statistics.fmean(x[part]) for x in series], fmt)
                       for series, fmt in ((jumps, "{:+.3f}"), (moved, "{:.3f}"))
                       for part in (slice(None, 5), slice(-5, None))),
                     _pm([r["final_val_loss"] for r in runs])])
    return body


def figure(rows: Sequence[Dict[str, Any]]) -> Any:
    fig, axes = br.new_figure(2, width=6, height=4.2)
    for label in VARIANTS:
        runs = [r for r in rows if r["variant"] == label and r["syncs"]]
        if not runs:
            continue
        n = min(len(r["syncs"]) for r in runs)
        jump = [statistics.fmean(r["syncs"][i]["after"] - r["syncs"][i]["before"] for r in runs) for i in range(n)]
        moved = [statistics.fmean(r["syncs"][i]["moved"] for r in runs) for i in range(n)]
        line = axes[0].plot(range(1, n + 1), jump, marker=".", label=label)[0]
        axes[1].plot(range(1, n + 1), moved, marker=".", color=line.get_color(), label=label)
    axes[0].axhline(0, color="grey", lw=0.5)
    axes[0].set_xlabel("outer sync")
    axes[0].set_ylabel("val loss after sync - before (nats)")
    axes[1].set_xlabel("outer sync")
    axes[1].set_ylabel("||g_new - g_old|| / ||mean local - g_old||")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=6)
    return fig


@one_line_refusals
def main(argv: List[str] | None = None) -> int:
    p = br.script_parser(__doc__, "runs/het_sparseloco/outer_jump.json")
    from nanotron_ext.cli_flags import CONFIG, SEED, Int, KeyValue

    p.add_argument("--config-file", default="examples/config_tiny_sparseloco.yaml", type=CONFIG,
                   help="the base config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=KeyValue(),
                   help="config overrides")
    p.add_argument("--replicas", type=Int(1), default=2, help="M simulated replicas")
    p.add_argument("--seeds", type=SEED, nargs="+", default=[1, 2], help="general.seed of each repeat")
    args = br.help_with_defaults(p).parse_args(argv)
    saved = br.read_saved(args.from_json) if args.from_json else measure(args)
    headers = ["variant", "syncs", "jump, syncs 1-5", "jump, last 5", "moved, syncs 1-5", "moved, last 5",
               "final val loss"]
    br.publish(args.out, saved["rows"], saved["meta"],
               f"Loss jump after each outer sync, M = {saved['meta']['replicas']}",
               headers, summarise(saved["rows"]), figure=figure(saved["rows"]),
               notes=["jump: mean validation loss of the global weights right after a sync minus that of the "
                      "replicas' local weights right before it (mean ± s.e. over seeds); moved: the module docstring"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
