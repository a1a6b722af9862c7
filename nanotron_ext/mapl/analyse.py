"""MAPL's analyses of trained boundary projections (paper sec. 3.1 and "Key findings"):

- the fraction of boundary-activation energy a basis keeps, ||(X - anchor) A||^2 / ||X - anchor||^2,
  for the learned A_p and for a random orthonormal basis of the same rank;
- principal angles between the learned subspaces of different boundaries;
- the rank the boundary activations need for 99% of their energy (sec. 3.1: ~250 of d = 1024), as they are
  and centred (a direction common to all tokens can hold most of the energy on its own);
- isometry: the Pearson correlation of token-pair cosine similarities before and after projection
  (paper: r = 0.992), for the learned and for a random basis;
- how far A_p is from the Stiefel manifold, max |A^T A - I| (the manifold-unaware ablation).

    torchrun --standalone --nproc_per_node 1 -m nanotron_ext.mapl.analyse \
        --config-file runs/<run>/config.yaml --checkpoint checkpoints/<run>/step_<N> --out runs/<run>/mapl_analysis.json

The checkpoint must come from a single-process run (boundaries simulated in one process, as the
reproduction's convergence runs are); it writes JSON + markdown + PNG.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from nanotron_ext.cli_flags import one_line_refusals
from nanotron_ext.codecs.energy import energy_kept


def principal_angles_deg(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Principal angles (degrees, ascending) between span(a) and span(b), both with orthonormal columns."""
    cosines = torch.linalg.svdvals(a.double().T @ b.double()).clamp(-1.0, 1.0)
    return torch.rad2deg(torch.arccos(cosines))  # svdvals descend, so the angles ascend


def rank_for_energy(x: torch.Tensor, fraction: float = 0.99) -> int:
    """Smallest k whose best rank-k basis (top right singular vectors) keeps `fraction` of the energy of
    the rows of x [N, d]."""
    s2 = torch.linalg.svdvals(x.double()).square()
    kept = torch.cumsum(s2, 0) / s2.sum()
    return int(torch.searchsorted(kept, torch.tensor([fraction], dtype=kept.dtype) - 1e-12)[0]) + 1


def pair_cosine_pearson(x: torch.Tensor, basis: torch.Tensor, pairs: int = 4096, seed: int = 0) -> float:
    """Pearson r between cos(x_i, x_j) and cos(x_i B, x_j B) over `pairs` random pairs of distinct rows
    of x [N, d] (MAPL's isometry finding)."""
    g = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    i = torch.randint(0, n, (pairs,), generator=g)
    j = (i + torch.randint(1, n, (pairs,), generator=g)) % n  # j != i
    x = x.double()
    z = x @ basis.double()

    def cos(v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(v[i], v[j], dim=1)

    return float(torch.corrcoef(torch.stack([cos(x), cos(z)]))[0, 1])


def stiefel_error(a: torch.Tensor) -> float:
    """max |A^T A - I|: 0 on the Stiefel manifold."""
    a = a.double()
    return float((a.T @ a - torch.eye(a.shape[1], dtype=a.dtype)).abs().max())


def random_basis(d: int, r: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))[0]


def analyse(projections: Dict[int, torch.Tensor], activations: Dict[int, torch.Tensor], seed: int = 0,
            initial: Optional[Dict[int, torch.Tensor]] = None) -> Dict[str, object]:
    """Per boundary: energy kept by the learned and by a random basis, the rank for 99% energy, the pair-cosine
    Pearson r through each basis, A's distance from the manifold (and, given the initial bases, how far
    training turned each); per pair: mean principal angle."""
    rows: List[Dict[str, object]] = []
    for b in sorted(projections):
        a = projections[b]
        x, rand = activations[b], random_basis(a.shape[0], a.shape[1], seed + b)
        row = {"boundary": b, "rank": a.shape[1], "energy_learned": energy_kept(x, a),
               "energy_random": energy_kept(x, rand), "rank_99": rank_for_energy(x, 0.99), "d": a.shape[0],
               "rank_99_centred": rank_for_energy(x - x.mean(0), 0.99),  # without the tokens' common direction
               "pearson_learned": pair_cosine_pearson(x, a, seed=seed + b),
               "pearson_random": pair_cosine_pearson(x, rand, seed=seed + b), "stiefel_error": stiefel_error(a)}
        if initial is not None:
            row["mean_angle_to_init_deg"] = float(principal_angles_deg(a, initial[b]).mean())
        rows.append(row)
    angles = {f"{i}-{j}": float(principal_angles_deg(projections[i], projections[j]).mean())
              for i, j in itertools.combinations(sorted(projections), 2)}
    d, r = next(iter(projections.values())).shape
    # what unrelated subspaces of this size give: the yardstick for "stage-specific" angles
    chance = float(principal_angles_deg(random_basis(d, r, seed + 10_001), random_basis(d, r, seed + 10_002)).mean())
    return {"boundaries": rows, "mean_principal_angle_deg": angles, "random_pair_mean_angle_deg": chance}


def _collect(cfg_file: str, checkpoint: str, batches: int) -> Dict[str, object]:
    """Load the model, run validation batches, capture X - anchor at every MAPL encoder."""
    # nanotron only to build a model: the functions above run without it
    from nanotron_ext.bench.launch import init_distributed
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.data.loader import build_validation_loader
    from nanotron_ext.mapl.codec import MaplEncoder
    from nanotron_ext.models.build import build_model
    from nanotron_ext.train.checkpoint import load_checkpoint

    cfg = load_config(cfg_file, [])
    if cfg.parallelism.pp != 1 or cfg.parallelism.tp != 1:
        raise SystemExit("mapl.analyse reads single-process checkpoints (boundaries simulated in one process)")
    cfg.parallelism.dp = 1
    ctx = init_distributed(cfg)
    model = build_model(cfg, ctx)
    load_checkpoint(checkpoint, ctx, model=model)
    model.eval()
    captured: Dict[int, List[torch.Tensor]] = {}

    def hook(module: MaplEncoder, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        x = kwargs["residual"] + kwargs["branch"] - module.projection.anchor(kwargs["input_ids"])
        captured.setdefault(module.projection.boundary, []).append(x.detach().reshape(-1, x.shape[-1]))

    encoders = [m for m in model.modules() if isinstance(m, MaplEncoder)]
    if not encoders:
        raise SystemExit(f"{cfg_file}: model.codec.kind is {cfg.model.codec.kind!r}, not mapl")
    for m in encoders:
        m.register_forward_hook(hook, with_kwargs=True)
    loader = build_validation_loader(cfg, dp_rank=0, dp_size=1, config_file=cfg_file)
    with torch.no_grad():
        for batch in itertools.islice(loader, batches):
            model(input_ids=batch["input_ids"], label_ids=batch["label_ids"])
    projections = {m.projection.boundary: m.projection.A.detach() for m in encoders}
    activations = {b: torch.cat(xs) for b, xs in captured.items()}
    initial = {}
    for m in encoders:  # the seeded initial basis of each boundary, rebuilt beside the trained one
        fresh = type(m.projection)(cfg.model, m.projection.boundary)
        fresh.init_own_parameters_(cfg.general.seed)
        initial[m.projection.boundary] = fresh.A.detach()
    return analyse(projections, activations, seed=cfg.general.seed, initial=initial)


def projections_shape(result: Dict[str, object]) -> str:
    return f"rank-{result['boundaries'][0]['rank']}"


def write(result: Dict[str, object], out: Path, title: str) -> None:
    # matplotlib only when plotting (seconds to import)
    import matplotlib.pyplot as plt

    from nanotron_ext.bench.report import REPORT, markdown_table, run_meta, save_figure, write_rows

    meta = run_meta({"what": title})
    rows = result["boundaries"]
    write_rows(out, rows, meta | {"mean_principal_angle_deg": result["mean_principal_angle_deg"],
                                  "random_pair_mean_angle_deg": result["random_pair_mean_angle_deg"]})
    headers = ["boundary", "rank", "energy kept: learned A_p", "energy kept: random basis", "rank for 99% energy",
               "pair-cosine Pearson: learned", "random", "max |A^T A - I|", "mean angle to init (deg)"]
    body = [[r["boundary"], r["rank"], f"{r['energy_learned']:.3f}", f"{r['energy_random']:.3f}",
             f"{r['rank_99']} of {r['d']}", f"{r['pearson_learned']:.4f}", f"{r['pearson_random']:.4f}",
             f"{r['stiefel_error']:.1e}", f"{r.get('mean_angle_to_init_deg', float('nan')):.1f}"] for r in rows]
    angles = [[k, f"{v:.1f}"] for k, v in result["mean_principal_angle_deg"].items()]
    angles.append(["two random bases", f"{result['random_pair_mean_angle_deg']:.1f}"])
    REPORT.write_markdown(out.with_suffix(".md"), f"# {title}\n\n" + markdown_table(headers, body) + "\n\n"
                          + markdown_table(["boundaries", "mean principal angle (deg)"], angles) + "\n")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [str(r["boundary"]) for r in rows]
    ax1.bar([i - 0.2 for i in range(len(xs))], [r["energy_learned"] for r in rows], 0.4, label="learned A_p")
    ax1.bar([i + 0.2 for i in range(len(xs))], [r["energy_random"] for r in rows], 0.4, label="random basis")
    ax1.set_xticks(range(len(xs)), xs)
    ax1.set(xlabel="boundary (sending layer)", ylabel="activation energy kept", ylim=(0, 1))
    ax1.legend()
    n = len(rows)
    grid = torch.zeros(n, n)
    for key, v in result["mean_principal_angle_deg"].items():
        i, j = (xs.index(s) for s in key.split("-"))
        grid[i, j] = grid[j, i] = v
    im = ax2.imshow(grid, vmin=0, vmax=90, cmap="viridis")
    ax2.set_xticks(range(n), xs)
    ax2.set_yticks(range(n), xs)
    ax2.set_title("mean principal angle (deg)")
    fig.colorbar(im, ax=ax2)
    save_figure(fig, out.with_suffix(".png"), title, meta)


@one_line_refusals
def main(argv: Optional[Sequence[str]] = None) -> int:
    from nanotron_ext.bench.report import REPORT
    from nanotron_ext.cli_flags import InputFile, InputFolder, Int, OutputStem, Parser

    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-file", required=True, type=InputFile(format="yaml"),
                        help="the run's resolved config (runs/<run>/config.yaml)")
    parser.add_argument("--checkpoint", required=True, type=InputFolder(),
                        help="a checkpoint folder (checkpoints/<run>/step_<N>)")
    parser.add_argument("--batches", type=Int(1), default=8, help="validation batches to collect activations from")
    # the .json, .md and .png are replaced only when this tool (bench.report) wrote them, checked before any work
    parser.add_argument("--out", default=None, type=OutputStem(REPORT), help="JSON path, the .md and .png beside it "
                        "(default: beside the config, mapl_analysis.json)")
    args = parser.parse_args(argv)
    if args.out is None:  # the default, beside the config, by the same rule
        from nanotron_ext.cli_checks import ArgumentError, output_stem, refuse

        try:
            output_stem("--out", Path(args.config_file).with_name("mapl_analysis.json"), REPORT)
        except ArgumentError as e:
            refuse(e)
    out = Path(args.out or Path(args.config_file).with_name("mapl_analysis.json"))
    result = _collect(args.config_file, args.checkpoint, args.batches)
    write(result, out, f"MAPL projections: {args.checkpoint}")
    for r in result["boundaries"]:
        print(f"boundary {r['boundary']}: energy kept learned {r['energy_learned']:.3f} vs random "
              f"{r['energy_random']:.3f}; turned {r.get('mean_angle_to_init_deg', float('nan')):.1f} deg from its "
              f"initial basis; 99% energy at rank {r['rank_99']} of {r['d']}; pair-cosine Pearson "
              f"{r['pearson_learned']:.4f} (random basis {r['pearson_random']:.4f}); max |A^T A - I| "
              f"{r['stiefel_error']:.1e}")
    for k, v in result["mean_principal_angle_deg"].items():
        print(f"mean principal angle {k}: {v:.1f} deg")
    print(f"two random {projections_shape(result)} bases: {result['random_pair_mean_angle_deg']:.1f} deg")
    return 0 if all(math.isfinite(r["energy_learned"]) for r in result["boundaries"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
