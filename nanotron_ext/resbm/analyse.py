"""Effective rank and normalised singular-value spectra of chosen weights per layer ("ResBM: Residual
Bottleneck Models for Low-Bandwidth Pipeline Parallelism", arXiv:2604.11947, appendix B.1, table B.1,
fig. B.1):

    r_eff = sum_i s_i^2 / max_i s_i^2        (1 when one direction dominates, rank when all s_i are equal)

    python -m nanotron_ext.resbm.analyse --checkpoint checkpoints/run_a [--checkpoint checkpoints/run_b] \
        [--label muon --label adamw] [--pattern 'boundary_encoder\\.net\\.fc2\\.weight'] [--out DIR]

A checkpoint is a `step_<N>/` folder or a checkpoint root (its latest complete step). The default
pattern is the bottleneck output projection (the encoder's last linear, whose output is the wire);
`mlp.down_proj.weight` gives the FFN output projections of the paper's fig. 1. Weights are read from
the tp-rank-0, dp-rank-0 file of every pipeline stage (ResBM's E and D are replicated over TP, but for
E's first and D's last linear under btp; a TP-sharded weight would be only rank 0's shard, so the tool
refuses one). Writes <out>/effective_rank.json and <out>/spectra.png, and prints the table.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from nanotron_ext.cli_checks import ArgumentError, Writer, output_files, refuse
from nanotron_ext.cli_flags import InputFolder, OutputFolder, Parser, Regex, Text, one_line_refusals


def _earlier_result(obj: Any) -> bool:
    """effective_rank.json written before files carried a marker: {label: {parameter: {"r_eff", "spectrum", ...}}}."""
    return bool(obj) and all(isinstance(rows, dict) and rows and all(
        isinstance(r, dict) and {"r_eff", "spectrum"} <= set(r) for r in rows.values()) for rows in obj.values())


# --out's effective_rank.json and spectra.png replace only files this tool wrote (cli_checks.Writer)
ANALYSE = Writer("python -m nanotron_ext.resbm.analyse", legacy_shape=_earlier_result)
DEFAULT_PATTERN = r"boundary_encoder\.net\.fc2\.weight"
BTP_SHARDED = r"boundary_encoder\.net\.fc1\.|boundary_decoder\.net\.fc2\."  # split on d under btp (codec.py)


def singular_values(weight: torch.Tensor) -> torch.Tensor:
    """Singular values (descending) in float64."""
    return torch.linalg.svdvals(weight.detach().double())


def effective_rank(s: torch.Tensor) -> float:
    """r_eff = sum(s^2) / max(s^2) of singular values `s` (appendix B.1)."""
    s2 = s.double().pow(2)
    return float(s2.sum() / s2.max())


def normalised_spectrum(s: torch.Tensor) -> List[float]:
    """s_i / s_1 (fig. B.1's y-axis)."""
    s = s.double()
    return (s / s.max()).tolist()


def _step_dir(path: Path) -> Path:
    if (path / "meta.json").exists():
        return path
    steps = sorted((p for p in path.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and (p / "meta.json").exists()),
                   key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        raise FileNotFoundError(f"--checkpoint {path}: neither a step_<N>/ folder nor a root holding one")
    return steps[-1]


def load_weights(checkpoint: Path, pattern: str) -> Dict[str, torch.Tensor]:
    """Weights whose name matches `pattern`, from every pipeline stage's tp0/dp0 file, by name."""
    step = _step_dir(Path(checkpoint))
    meta = json.loads((step / "meta.json").read_text())
    files = sorted(step.glob("pp*_dp0_tp0.pt"))
    if not files:
        raise FileNotFoundError(f"{step}: no pp*_dp0_tp0.pt files")
    out: Dict[str, torch.Tensor] = {}
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=True)["model"]
        for name, tensor in state.items():
            if re.search(pattern, name) and tensor.ndim == 2:
                out[name] = tensor
    if not out:
        raise ValueError(f"{step}: no 2-D weight matches --pattern {pattern!r}")
    tp = int(meta.get("layout", meta).get("tp", 1))  # checkpoint.py writes {"layout": {"tp": ...}}
    if tp > 1 and not re.search("boundary_", pattern):
        raise ValueError(f"{step}: tp={tp}; only TP-replicated weights (ResBM's E/D) can be read from one file")
    btp = (meta.get("config") or {}).get("model", {}).get("tp_strategy") == "btp"
    sharded = [n for n in out if re.search(BTP_SHARDED, n)] if tp > 1 and btp else []
    if sharded:
        raise ValueError(f"{step}: tp={tp} under model.tp_strategy=btp shards {sharded[0]} over TP; one file holds "
                         "only rank 0's part")
    return out


def _layer(name: str) -> int:
    m = re.search(r"decoder\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def analyse(checkpoints: Sequence[Path], labels: Sequence[str], pattern: str) -> Dict[str, Dict[str, dict]]:
    """{label: {weight name: {"layer", "shape", "r_eff", "spectrum"}}}."""
    result: Dict[str, Dict[str, dict]] = {}
    for ckpt, label in zip(checkpoints, labels):
        rows = {}
        for name, w in sorted(load_weights(ckpt, pattern).items(), key=lambda kv: _layer(kv[0])):
            s = singular_values(w)
            rows[name] = {"layer": _layer(name), "shape": list(w.shape), "r_eff": effective_rank(s),
                          "spectrum": normalised_spectrum(s)}
        result[label] = rows
    return result


def format_table(result: Dict[str, Dict[str, dict]]) -> str:
    """Table B.1's layout: one row per layer (1-based, as the paper), one r_eff column per checkpoint."""
    labels = list(result)
    layers = sorted({r["layer"] for rows in result.values() for r in rows.values()})
    by_layer = {lab: {r["layer"]: r["r_eff"] for r in rows.values()} for lab, rows in result.items()}
    lines = ["layer " + " ".join(f"{lab + ' r_eff':>16}" for lab in labels)]
    for layer in layers:
        lines.append(f"{layer + 1:<5} " + " ".join(
            f"{by_layer[lab][layer]:>16.2f}" if layer in by_layer[lab] else f"{'-':>16}" for lab in labels))
    means = [sum(v.values()) / len(v) for v in by_layer.values()]
    lines.append("mean  " + " ".join(f"{m:>16.2f}" for m in means))
    return "\n".join(lines)


def plot_spectra(result: Dict[str, Dict[str, dict]], path: Path, title: str) -> None:
    # matplotlib only when plotting (seconds to import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({r["layer"] for rows in result.values() for r in rows.values()})
    cols = min(4, len(layers))
    nrows = (len(layers) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False)
    for ax, layer in zip(axes.flat, layers):
        for label, rows in result.items():
            for r in rows.values():
                if r["layer"] == layer:
                    ax.plot(range(1, len(r["spectrum"]) + 1), r["spectrum"], label=f"{label} (r_eff {r['r_eff']:.1f})")
        ax.set_title(f"layer {layer + 1}")
        ax.set_xlabel("singular value index")
        ax.set_ylabel("s_i / s_1")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    ANALYSE.save_png(fig, path, dpi=110)
    plt.close(fig)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, dict]]:
    ap = Parser(description="Effective rank and normalised spectra per layer (ResBM appendix B.1)")
    ap.add_argument("--checkpoint", action="append", required=True, type=InputFolder(as_path=True),
                    help="step_<N>/ folder or checkpoint root")
    ap.add_argument("--label", action="append", default=None, type=Text(),
                    help="one per --checkpoint (default: folder names)")
    ap.add_argument("--pattern", default=DEFAULT_PATTERN, type=Regex(), help="regex on parameter names")
    ap.add_argument("--out", type=OutputFolder(as_path=True), default=Path("runs/resbm_analysis"),
                    help="folder for effective_rank.json and spectra.png")
    ap.add_argument("--title", type=Text(), default="Normalised singular values (ResBM appendix B.1)")
    args = ap.parse_args(argv)
    labels = args.label or [c.name for c in args.checkpoint]
    if len(labels) != len(args.checkpoint):
        ap.error("--label: give one --label per --checkpoint")
    try:  # the folder was checked when parsed; its two files are replaced only when this tool wrote them
        output_files("--out", args.out / "effective_rank.json", ANALYSE, [args.out / "spectra.png"])
    except ArgumentError as e:
        refuse(e)
    result = analyse(args.checkpoint, labels, args.pattern)
    ANALYSE.write_json(args.out / "effective_rank.json", result, indent=1)
    plot_spectra(result, args.out / "spectra.png", args.title)
    print(format_table(result))
    print(f"wrote {args.out / 'effective_rank.json'} and {args.out / 'spectra.png'}")
    return result


if __name__ == "__main__":
    main()
