"""Rank analysis for Subspace Models (paper sec. 4.1, Figs. 1 and 7; the energy a basis keeps, sec. 4.2):

    python -m nanotron_ext.subspace.analyse --config-file X.yaml [--set key=value ...]
        [--checkpoint DIR] [--batches 2] [--random-tokens] [--out DIR]

On one process (the layout is forced to dp = tp = pp = 1; a checkpoint must have been saved that way)
it runs forward/backward on `--batches` micro-batches and reports, for every decoder layer's attention
output and MLP down projection, the stable rank ||M||_F^2 / ||M||_2^2 of the effective weight and of its
gradient, and for the residual stream entering each layer (minus T_fixed[ids] for the split embedding)
the fraction of its energy that U keeps (subspace models) and that the best rank-k basis keeps (PCA, any
model). Writes analysis.json and analysis.png to --out and prints the table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from nanotron_ext.cli_checks import ArgumentError, Writer, output_files, refuse
from nanotron_ext.cli_flags import InputFolder, Int, OutputFolder, Parser, one_line_refusals
from nanotron_ext.codecs.energy import energy_kept
from nanotron_ext.config.loader import add_config_args, config_from_args

# --out's analysis.json and analysis.png replace only files this tool wrote (cli_checks.Writer)
ANALYSE = Writer("python -m nanotron_ext.subspace.analyse", legacy_keys=("k", "rows"))


def stable_rank(m: torch.Tensor) -> float:
    """||M||_F^2 / ||M||_2^2 (between 1 and rank(M))."""
    m = m.detach().double().reshape(m.shape[0], -1)
    top = torch.linalg.matrix_norm(m, ord=2)
    return float(m.square().sum() / top.square()) if top > 0 else 0.0


def best_basis(x: torch.Tensor, k: int) -> torch.Tensor:
    """The rank-k basis keeping the most energy of rows X: the top-k right singular vectors."""
    return torch.linalg.svd(x.detach().double().reshape(-1, x.shape[-1]), full_matrices=False)[2][:k].T


def analyse_model(model: torch.nn.Module, micro: List[Dict[str, torch.Tensor]], ctx, k: int) -> List[Dict[str, object]]:
    """One row per decoder layer (single-process model)."""
    # nanotron only to build a model: the functions above run without it
    from nanotron_ext.train.pipeline_step import forward_backward, make_engine

    hub = None
    emb = model.token_embedding.pp_block.embedding
    if hasattr(emb, "hub"):
        hub = emb.hub
    inputs: Dict[int, List[torch.Tensor]] = {}
    ids_seen: List[torch.Tensor] = []
    handles = []
    for i, block in enumerate(model.decoder):
        handles.append(block.pp_block.attn.register_forward_pre_hook(
            lambda m, args, i=i: inputs.setdefault(i, []).append(args[0].detach())))
    handles.append(model.token_embedding.pp_block.register_forward_pre_hook(
        lambda m, args, kwargs: ids_seen.append(kwargs.get("input_ids", args[0] if args else None)), with_kwargs=True))
    model.zero_grad(set_to_none=True)
    forward_backward(model, make_engine("1f1b"), micro, ctx)
    for h in handles:
        h.remove()
    ids = torch.cat([i.reshape(-1) for i in ids_seen])
    rows = []
    for i, block in enumerate(model.decoder):
        layer = block.pp_block
        row: Dict[str, object] = {"layer": i}
        for key, lin in (("attn_out", layer.attn.o_proj), ("mlp_down", layer.mlp.down_proj)):
            small = getattr(lin, "weight_small", None)
            grad = small.grad if small is not None else lin.weight.grad
            row[f"{key}_stable_rank"] = stable_rank(lin.weight)
            row[f"{key}_grad_stable_rank"] = stable_rank(grad) if grad is not None else float("nan")
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[i]])
        if hub is not None:
            x = x - hub.fixed[ids].to(x.dtype)
            row["energy_kept_by_U"] = energy_kept(x, hub.basis)
        row["energy_kept_by_best_rank_k"] = energy_kept(x, best_basis(x, k))
        rows.append(row)
    return rows


def _plot(rows: List[Dict[str, object]], path: Path) -> None:
    # matplotlib only when plotting (seconds to import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    layers = [r["layer"] for r in rows]
    for key in ("attn_out_stable_rank", "mlp_down_stable_rank", "attn_out_grad_stable_rank",
                "mlp_down_grad_stable_rank"):
        axes[0].plot(layers, [r[key] for r in rows], marker="o", label=key)
    axes[0].set(xlabel="layer", ylabel="stable rank", title="projection matrices and gradients")
    axes[0].legend(fontsize=7)
    for key in ("energy_kept_by_U", "energy_kept_by_best_rank_k"):
        if key in rows[0]:
            axes[1].plot(layers, [r[key] for r in rows], marker="o", label=key)
    axes[1].set(xlabel="layer", ylabel="fraction of energy", ylim=(0, 1.05), title="residual stream (minus T_fixed)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    ANALYSE.save_png(fig, path, dpi=120)
    plt.close(fig)


@one_line_refusals
def main(argv: Optional[List[str]] = None) -> int:
    parser = Parser(prog="python -m nanotron_ext.subspace.analyse", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--checkpoint", default=None, type=InputFolder(),
                        help="checkpoint folder saved with dp = tp = pp = 1")
    parser.add_argument("--batches", type=Int(1), default=2, help="micro-batches to analyse")
    parser.add_argument("--random-tokens", action="store_true", help="uniform random tokens instead of the data")
    parser.add_argument("--out", default="runs/analyse", type=OutputFolder(),
                        help="folder for analysis.json and analysis.png")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:  # the folder was checked when parsed; its two files are replaced only when this tool wrote them
        output_files("--out", out / "analysis.json", ANALYSE, [out / "analysis.png"])
    except ArgumentError as e:
        refuse(e)
    cfg = config_from_args(args)
    cfg.parallelism.dp = cfg.parallelism.tp = cfg.parallelism.pp = 1
    cfg.parallelism.layers_per_stage = None
    # nanotron only to build a model: the functions above run without it
    from nanotron_ext.models.build import build_model
    from nanotron_ext.parallel.context import standalone_context

    ctx = standalone_context()
    model = build_model(cfg, ctx)
    if args.checkpoint:
        # nanotron only to build a model: the functions above run without it
        from nanotron_ext.train.checkpoint import load_checkpoint

        load_checkpoint(args.checkpoint, ctx, model=model)
    t = cfg.tokens
    if args.random_tokens:
        g = torch.Generator().manual_seed(cfg.general.seed)
        rows = torch.randint(0, cfg.tokenizer.vocab_size,
                             (args.batches * t.micro_batch_size, t.sequence_length + 1), generator=g)
        micro = [{"input_ids": rows[i * t.micro_batch_size:(i + 1) * t.micro_batch_size, :-1],
                  "label_ids": rows[i * t.micro_batch_size:(i + 1) * t.micro_batch_size, 1:]}
                 for i in range(args.batches)]
    else:
        # datatrove / tokenizers only when preparing or reading data (seconds to import)
        from nanotron_ext.data.loader import build_validation_loader

        loader = iter(build_validation_loader(cfg, dp_rank=0, dp_size=1, config_file=args.config_file))
        micro = [next(loader) for _ in range(args.batches)]
    rows = analyse_model(model, micro, ctx, cfg.model.subspace.width(cfg.model.hidden_size))
    ANALYSE.write_json(out / "analysis.json", {"k": cfg.model.subspace.width(cfg.model.hidden_size), "rows": rows},
                       indent=1)
    _plot(rows, out / "analysis.png")
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in keys))
    print(f"wrote {out / 'analysis.json'} and {out / 'analysis.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
