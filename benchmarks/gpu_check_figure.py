"""The PNG of benchmarks/gpu_check.py: the CUDA-vs-CPU check, the 125M and 1B throughput, codec overhead, BOOST's
Figure 7 and where an iteration's time goes, one panel each (a stage not run leaves its panel empty)."""
from __future__ import annotations

from typing import Any, Mapping

from nanotron_ext.bench import report as br


def figure(result: Mapping[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = result["stages"]
    fig, axes = plt.subplots(2, 3, figsize=(21, 9))
    ax = axes[0][0]
    comp = [r for r in stages.get("techniques", {}).get("comparison", []) if "worst_rel" in r]
    if comp:
        ys = range(len(comp))
        ax.barh(list(ys), [max(r["worst_rel"], 1e-9) for r in comp],
                color=["tab:green" if r["verdict"] == "pass" else "tab:red" for r in comp])
        for y, r in zip(ys, comp):
            ax.plot([r["tolerance"]] * 2, [y - 0.4, y + 0.4], "k-")
        ax.set_xscale("log")
        ax.set_yticks(list(ys))
        ax.set_yticklabels([r["name"] for r in comp], fontsize=7)
        ax.invert_yaxis()
    ax.set_title("device vs CPU: worst relative loss difference (black: tolerance)", fontsize=9)
    _throughput_panel(axes[0][1], stages.get("throughput", {}), "125M")
    ax = axes[1][0]
    rows = [r for r in stages.get("codecs", {}).get("rows", []) if r["status"] == "ok"]
    if rows:
        br.grouped_bars(ax, [r["name"] for r in rows],
                        {k: [r[f"{k}_ns_per_token"] for r in rows] for k in ("encode", "decode", "fwd_bwd")},
                        ylabel="ns per token")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_title("codec overhead per token (one boundary)", fontsize=9)
    ax = axes[1][1]
    fig7 = stages.get("boost", {}).get("fig7")
    if fig7:
        mb = fig7["meta"].get("micro_batch")
        at = [r for r in fig7["rows"] if r["micro_batch"] == mb]
        designs = list(dict.fromkeys(r["design"] for r in at))
        linears = list(dict.fromkeys(r["linear"] for r in at))
        val = {(r["design"], r["linear"]): r["seconds"] * 1e3 for r in at}
        br.grouped_bars(ax, linears, {d: [val.get((d, lin)) for lin in linears] for d in designs}, ylabel="GEMM ms")
        ax.legend(fontsize=7)
        model = "tiny layer (dry run)" if result["meta"].get("dry_run") else "LLaMA-1B layer (Table 8)"
        ax.set_title(f"BOOST Fig. 7: per-linear forward GEMM time, {model}, bz={mb}", fontsize=9)
    _profile_panel(axes[0][2], stages.get("profile", {}))
    _throughput_panel(axes[1][2], stages.get("throughput_1b", {}), "1B")
    return fig


def _profile_panel(ax: Any, body: Mapping[str, Any]) -> None:
    """One stacked bar per model: its time per iteration by kind of work."""
    row = next((r for r in body.get("rows", []) if r["status"] == "ok"), None)
    if row is None:
        ax.axis("off")
        return
    models = row["models"]
    kinds = list(dict.fromkeys(k for v in models.values() for k in v["kinds_ms"]))
    bottom = [0.0] * len(models)
    for k in kinds:
        vals = [v["kinds_ms"].get(k, 0.0) for v in models.values()]
        ax.bar(list(models), vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel(f"{next(iter(models.values()))['clock']} ms per iteration")
    ax.legend(fontsize=7)
    ax.set_title(f"where an iteration's time goes ({row['setting']})", fontsize=9)


def _throughput_panel(ax: Any, body: Mapping[str, Any], size: str) -> None:
    """Tokens/s of ours and plain per setting, ours / plain and ours' MFU above each."""
    rows = [r for r in body.get("rows", []) if r["status"] == "ok"]
    if rows:
        br.grouped_bars(ax, [r["name"] for r in rows],
                        {m: [r["models"][m]["tokens_per_s"] / 1e3 for r in rows] for m in ("nanotron_ext", "plain")},
                        ylabel="k tokens/s")
        for i, r in enumerate(rows):
            mfu = r["models"]["nanotron_ext"]["mfu"]
            ax.annotate(f"{r['ratio']:.2f}x" + (f"\nMFU {mfu:.0%}" if mfu else ""), (i, 0), ha="center", va="bottom",
                        fontsize=8)
        ax.legend(fontsize=8)
    ax.set_title(f"{size} training throughput (ours / plain, MFU)", fontsize=9)
