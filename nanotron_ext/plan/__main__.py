"""Will my layout fit? Step ranks of a config's real layout on this machine, with nothing real allocated.

    python -m nanotron_ext.plan --config-file X.yaml [--set key=value ...] [--rank R | --rank all]
                                [--gpu-memory 80] [--device cuda|cpu] [--json plan.json]

Each planned rank is built as rank R of the dp x tp x pp world over torch's fake process group, on the meta
device, and steps one full training iteration (nanotron_ext.plan.rank). Printed per rank: parameters, weights,
gradients, optimizer state, a DP sync's own state, activations at peak, the peak (torch's MemTracker), FLOPs
(torch's FlopCounterMode); and bytes per step on each tier from the comm ledger beside the closed forms of
`python -m nanotron_ext.config show`. A config whose techniques have recompute switches (BOOST's low-rank
checkpointing) is planned with them flipped too. Exit 2 with one line when a rank's peak exceeds --gpu-memory.
Memory is planned as --device allocates it (default cuda, the GPU of the --gpu-memory verdict; cpu to compare with a
CPU run); the plan records which. A model whose weights alone exceed --gpu-memory on every rank is refused before
anything is planned (nanotron_ext.plan.size_check).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from nanotron_ext.cli_checks import Writer
from nanotron_ext.cli_flags import Float, Int, OutputFile, Parser
from nanotron_ext.config.loader import add_config_args, config_from_args
from nanotron_ext.errors import UserFacingError, one_line

DEVICES = ("cuda", "cpu")  # nanotron_ext.plan.kernels.DEVICES (not imported here: it imports torch)

# --json replaces only a plan it wrote (a run's metrics.jsonl and summary.json were once replaced by the plan)
PLAN = Writer("python -m nanotron_ext.plan", legacy_keys=("layout", "ranks", "tiers", "tokens_per_replica_step"))


def main(argv: Optional[List[str]] = None) -> int:
    parser = Parser(prog="python -m nanotron_ext.plan", description=__doc__.split("\n\n")[0])
    add_config_args(parser)
    parser.add_argument("--rank", default=None, type=Int(0, words=("all",)),
                        help="a global rank, or 'all' (default: every stage of each distinct replica, TP rank 0)")
    parser.add_argument("--gpu-memory", type=Float(0.0, low_open=True), default=80.0,
                        help="GiB per GPU (default: %(default)s)")
    parser.add_argument("--device", choices=DEVICES, default="cuda",
                        help="memory as this device allocates it: where an op's saved tensors differ (RMSNorm's fused "
                             "CUDA kernel), as it runs there; cpu to compare with a CPU run (default: %(default)s, "
                             "the GPU the --gpu-memory verdict is for)")
    parser.add_argument("--json", default=None, type=OutputFile(PLAN),  # checked when parsed: before the plan runs
                        help="also write the plan to this JSON file (replaces only a plan written before)")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
        p = cfg.parallelism
        world = p.dp * p.tp * p.pp
        cfg.validate(world_size=world)
        from nanotron_ext.plan.size_check import too_large

        problem = too_large(cfg, args.gpu_memory)  # before the planner's minutes: the weights alone do not fit
        if problem:
            raise UserFacingError(problem)
        from nanotron_ext.plan.run import default_ranks

        if args.rank is None:
            ranks = default_ranks(cfg)
        elif args.rank == "all":
            ranks = list(range(world))
        else:  # (an integer >= 0 or 'all': checked when parsed)
            ranks = [args.rank]
            if ranks[0] >= world:
                raise UserFacingError(f"--rank {ranks[0]}: the layout dp={p.dp} x tp={p.tp} x pp={p.pp} has ranks "
                                      f"0..{world - 1}")
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    summary = plan(args.config_file, list(args.overrides), cfg, ranks, args.device)
    sys.stdout.write(_render(summary, args.config_file, args.overrides))
    if args.json:
        try:
            PLAN.write_json(args.json, summary, indent=1)
        except OSError as e:  # a full disk: the plan is printed above
            print(f"error: --json: {e}", file=sys.stderr)
            return 2
    from nanotron_ext.plan.report import too_big

    problem = too_big(summary, args.gpu_memory)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


def plan(config_file: str, overrides: List[str], cfg, ranks: List[int],  # type: ignore[no-untyped-def]
         device: str = "cuda") -> dict:
    """The plan of `ranks` as JSON (nanotron_ext.plan.report.summarise), with the memory switches flipped too; memory
    as `device` (cuda, cpu) allocates it."""
    from nanotron_ext.config.loader import load_config
    from nanotron_ext.plan.report import summarise
    from nanotron_ext.plan.run import flipped, memory_switches, plan_ranks

    alternative = None
    flips = flipped(memory_switches(cfg))
    if flips:
        other = load_config(config_file, overrides + flips)
        alternative = {"set": flips, **summarise(other, plan_ranks(config_file, overrides + flips, other, ranks,
                                                                   device=device), device=device)}
        del alternative["tiers"]
    return summarise(cfg, plan_ranks(config_file, overrides, cfg, ranks, device=device), alternative, device)


def _render(summary: dict, config_file: str, overrides: List[str]) -> str:
    from nanotron_ext.plan.report import render

    return render(summary, " ".join([config_file, *(f"--set {o}" for o in overrides)]))


if __name__ == "__main__":
    sys.exit(main())
