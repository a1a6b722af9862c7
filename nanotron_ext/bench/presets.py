"""`--preset gpu` for the convergence scripts: the paper's experiment on one 80 GB GPU, one command per
table.

A script keeps its CPU scale as the default (`--preset cpu`); `--preset gpu` switches every run to the
script's paper-scale YAML (reproduce/<paper>/*.yaml: the paper's batch, bf16, the largest model of the
paper that fits one 80 GB GPU), trains on a real jsonl corpus (`--data`, or the config's data.paths),
repeats each run over `--seeds`, and `--dry-run` resolves every run's config and prints it with its
parameter count (meta device) without training.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from nanotron_ext.cli_flags import SEED, InputPath
from nanotron_ext.models.param_count import count_params, fmt_count

GPU_COMMON = ["model.dtype=bf16", "general.backend=auto", "logging.progress_bar=true"]


def add_preset_args(parser: argparse.ArgumentParser, gpu_what: str, seeds: Sequence[int] = (42,)) -> None:
    """--preset, --data, --seeds and --dry-run; `gpu_what` says what the GPU preset runs."""
    parser.add_argument("--preset", choices=["cpu", "gpu"], default="cpu",
                        help=f"cpu: the CPU scale of the committed results; gpu: {gpu_what} (default: %(default)s)")
    parser.add_argument("--data", metavar="JSONL", type=InputPath(),
                        help="gpu preset: a local jsonl file or folder to train on (sets data.paths; prepared "
                             "beside it); default: the paper config's data.paths")
    parser.add_argument("--seeds", type=SEED, nargs="+", default=list(seeds),
                        help="one run per seed (general.seed); verdicts need two or more (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and print every run's config and parameter count, train nothing (default: off)")


def data_overrides(data: Optional[str]) -> List[str]:
    """A jsonl corpus for a GPU run: its prepared shards and tokenizer in `<data>_prepared/`."""
    if not data:
        return []
    prepared = f"{str(data).rstrip('/')}_prepared"
    return ["data.source=jsonl", f"data.paths=[{data}]", f"data.prepared_dir={prepared}",
            f"tokenizer.path={prepared}/tokenizer.json"]


def gpu_overrides(args: argparse.Namespace) -> List[str]:
    """What every GPU-preset run adds to its paper config."""
    return GPU_COMMON + data_overrides(getattr(args, "data", None))


def with_seed(overrides: Sequence[str], seed: int) -> List[str]:
    return [*overrides, f"general.seed={seed}"]


def dry_run(runs: Mapping[str, Tuple[str | Path, Sequence[str]]]) -> int:
    """Print each run's resolved config (the keys a reader checks first) and parameter count."""
    from nanotron_ext.config.loader import load_config

    print(f"{len(runs)} run(s), nothing trained (--dry-run):")
    for name, (config_file, overrides) in runs.items():
        cfg = load_config(config_file, list(overrides))
        m, t, p = cfg.model, cfg.tokens, cfg.parallelism
        batch = p.dp * t.micro_batch_size * t.batch_accumulation_per_replica
        n = count_params(cfg)
        data = cfg.data.paths if cfg.data.source != "sotu" else "embedded sotu corpus"
        print(f"- {name}: {config_file} {' '.join(overrides)}\n"
              f"    parameters {n:,} ({fmt_count(n)}); d={m.hidden_size} layers={m.num_layers} dtype={m.dtype} "
              f"codec={m.codec.kind}; dp={p.dp} tp={p.tp} pp={p.pp}; batch {batch} x {t.sequence_length} tokens, "
              f"{t.train_steps:,} steps ({batch * t.sequence_length * t.train_steps / 1e9:.2f}B tokens); "
              f"optimizer {cfg.optimizer.name}; seed {cfg.general.seed}; data {data}")
    return 0


def runs_for_seeds(base: Mapping[str, Tuple[str | Path, Sequence[str]]],
                   seeds: Sequence[int]) -> Dict[str, Tuple[str | Path, List[str]]]:
    """Each run once per seed, named '<run> seed <s>'."""
    return {f"{name} seed {s}": (cfg, with_seed(ovr, s)) for name, (cfg, ovr) in base.items() for s in seeds}


def script_main(argv: Optional[Sequence[str]], build_parser: Callable[[], argparse.ArgumentParser],
                measure: Callable[[argparse.Namespace, List[str]], Dict[str, Any]],
                render: Callable[[Dict[str, Any]], Dict[str, Any]], title: str) -> int:
    """main() of a training reproduction script: its own options before `--`, torchrun's after; `--from-json`
    re-renders, `--dry-run` (measure returns {"dry_run": code}) plans only, else measure, render, publish."""
    import sys

    from nanotron_ext.bench import report as br
    from nanotron_ext.bench.launch import split_argv

    own, torchrun_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    args.argv = own
    saved = br.read_saved(args.from_json) if args.from_json else measure(args, torchrun_args)
    if "dry_run" in saved:
        return saved["dry_run"]
    br.publish_rendered(args.out, saved, title, render(saved))
    return 0
