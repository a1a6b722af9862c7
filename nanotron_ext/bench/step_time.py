"""A config's step time on named hardware, from its plan and the model clock.

    python -m nanotron_ext.bench.step_time --config-file X.yaml [--set key=value ...] --preset NAME
                                           [--tflops T] [--steady-state] [--gemm-efficiency TABLE.json]
                                           [--plans DIR] [--json OUT]

The config's real layout is planned rank by rank (nanotron_ext.plan, on the meta device: FLOPs per rank, every message's
bytes; cached in --plans by the hash of what changes a plan: nanotron_ext.plan.cache_key), priced on the preset's device
throughput and links and replayed by the model clock (bench/clock/replay.py): its pipeline schedule with the bubbles,
FIFO stage links, one uplink per node, the DP tier per step or the outer sync every H steps. Printed: the device and its
throughput's source, each tier's link, the step between its two bounds (full overlap / no overlap) and tokens per
second, and the breakdown: the slowest stage's compute, the schedule's bubble, then what the TP tier, the stage links
and the DP tier each add, in that order, to each bound. A non-AdamW optimiser's update (Muon's Newton-Schulz) is the
plan less its AdamW twin's FLOPs (planned too), priced once per step at the preset's `update_tflops`. `--steady-state`:
the pipeline kept full across steps (bench/clock replay.steady_bounds). `--gemm-efficiency`: the throughput from a
measured per-GEMM-shape table (bench/clock/kernels.py). Presets: nanotron_ext/bench/clock/hardware.py (the papers'
hardware) and the WAN meter's clock presets; a sibling of `python -m nanotron_ext.plan`, which cannot import the meter
(the meter imports the planner).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from nanotron_ext.bench.clock import (
    ClockPreset,
    Link,
    all_presets,
    links_of,
    planned,
    preset,
    replica_works,
    step_bounds_of,
    with_update_flops,
)

FREE = Link(0.0)
TERMS = ("tp_s", "stage_link_s", "dp_s")  # the tiers added one after the other to the free-link step


def clock_terms(plan: Dict[str, Any], preset: ClockPreset, tflops: float, steady: bool = False) -> Dict[str, Any]:
    """The clock's step of a planned config (bench/clock's `planned` form) on `preset` at `tflops` effective
    TFLOP/s, one flushed step or with `steady` the pipeline's steady state (bench/clock replay.steady_bounds):
    "lower_s" / "upper_s" (full / no overlap) and the terms that add up to each: "compute_s" (the slowest stage's
    forwards and backwards and its once-per-step update, links free; "update_s" the update alone, priced at the
    preset's `update_tflops`), "bubble_s" (the schedule's idle time on free links), then each tier's link added in
    turn, [lower, upper]: "tp_s", "stage_link_s", "dp_s" (with the outer sync); "stage_wire_s": seconds per step the
    busiest stage link carries data (both directions on one wire when half duplex)."""
    f, u = tflops * 1e12, preset.update_tflops * 1e12
    dp = plan["layout"]["dp"]
    tiers, stage = links_of(preset, dp)
    free_tiers, free_stage = {"tp": FREE, "dp": FREE}, [FREE] * dp
    works = replica_works(plan, free_tiers, free_stage, f, u)
    busy = [(w.micro_batches * (st.fwd_s + st.bwd_s) + (list(w.update_s) or [0.0] * len(w.stages))[s],
             (list(w.update_s) or [0.0] * len(w.stages))[s]) for w in works for s, st in enumerate(w.stages)]
    compute, update = max(busy)
    tp_only = {"tp": tiers["tp"], "dp": FREE}
    steps = [step_bounds_of(plan, t, s, f, steady, u) for t, s in
             ((free_tiers, free_stage), (tp_only, free_stage), (tp_only, stage), (tiers, stage))]
    out: Dict[str, Any] = {"compute_s": compute, "update_s": update, "bubble_s": steps[0].upper_s - compute,
                           "steady": steady}
    for name, before, after in zip(TERMS, steps, steps[1:]):
        out[name] = [after.lower_s - before.lower_s, after.upper_s - before.upper_s]
    wire = 0.0
    for w, link in zip(replica_works(plan, tiers, stage, f, u), stage):
        for a, b in zip(w.stages, w.stages[1:]):  # the link between a and b: a's activations, b's gradients
            fwd, bwd = link.transmit_s(a.fwd_bytes), link.transmit_s(b.bwd_bytes)
            wire = max(wire, w.micro_batches * ((fwd + bwd) if link.duplex == "half" else max(fwd, bwd)))
    out.update(stage_wire_s=wire, free_step_s=steps[0].upper_s, lower_s=steps[-1].lower_s,
               upper_s=steps[-1].upper_s)
    return out


def describe_links(preset: ClockPreset) -> List[str]:
    """One line per tier: bandwidth, latency, duplex (0 Mbit/s: unlimited, the tier not charged)."""
    def one(spec: Any, held: bool = False) -> str:
        mbps, ms = spec[0], spec[1]
        if not mbps:
            return "unlimited (not charged)"
        bw = f"{mbps / 1e3:g} Gbit/s" if mbps >= 1e3 else f"{mbps:g} Mbit/s"
        if len(spec) > 2:  # NCCL's collective model (parallel/link.py COLLECTIVE_MODELS)
            return (f"{bw} bus bandwidth, {ms * 1e3:g} us per ring step + {spec[2] * 1e3:g} us per collective call "
                    f"(NCCL's model), {preset.duplex} duplex")
        return f"{bw}, {ms:g} ms one way, {preset.duplex} duplex" + (", latency holds the wire" if held else "")

    lines = [f"TP tier: {one(preset.tp)}", f"stage links: {one(preset.stage, preset.latency_holds_wire)}"]
    if preset.datacenter_replicas:
        lines.append(f"stage links of replicas {list(preset.datacenter_replicas)}: {one(preset.datacenter_stage)}")
    return lines + [f"DP tier: {one(preset.dp)}"]


def render(name: str, preset: ClockPreset, tflops: float, plan: Dict[str, Any], terms: Dict[str, Any],
           title: str) -> str:
    """The printed report (module docstring)."""
    lay, tokens = plan["layout"], plan["tokens_per_step"]
    src = preset.source if abs(tflops - preset.tflops) < 1e-9 else "--tflops"
    lines = [f"step time of {title} on {name}",
             f"device: {preset.device} at {tflops:.4g} effective TFLOP/s (source: {src})",
             *(f"  {line}" for line in describe_links(preset)),
             f"layout: dp {lay['dp']} x tp {lay['tp']} x pp {lay['pp']}, {plan['schedule']}, "
             f"{plan['micro_batches']} micro-batches, {tokens:,} tokens per step"
             + (f", outer sync every {plan['outer_every']} steps" if plan["outer_every"] else ""),
             f"{'steady-state ' if terms.get('steady') else ''}step: {terms['lower_s']:.4g} s (full overlap) .. "
             f"{terms['upper_s']:.4g} s (no overlap); "
             f"tokens/s {tokens / terms['lower_s']:,.0f} .. {tokens / terms['upper_s']:,.0f}",
             "breakdown (full overlap / no overlap):",
             f"  compute (slowest stage)  {terms['compute_s']:.4g} s",
             f"  bubble (free links)      {terms['bubble_s']:.4g} s"]
    for key, label in (("tp_s", "+ TP tier"), ("stage_link_s", "+ stage links"), ("dp_s", "+ DP tier / outer sync")):
        lines.append(f"  {label:<24} {terms[key][0]:.4g} / {terms[key][1]:.4g} s")
    lines.append(f"  (busiest stage link carries data {terms['stage_wire_s']:.4g} s per step)")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    from nanotron_ext.bench.clock import layer_gemms, load_table, mix_efficiency
    from nanotron_ext.cli_checks import Writer
    from nanotron_ext.cli_flags import Float, InputFile, OutputFile, OutputFolder, Parser
    from nanotron_ext.config.loader import add_config_args, config_from_args
    from nanotron_ext.errors import UserFacingError, one_line

    writer = Writer("python -m nanotron_ext.bench.step_time")  # --json replaces only a file it wrote
    parser = Parser(prog="python -m nanotron_ext.bench.step_time", description=__doc__.split("\n\n")[0])
    add_config_args(parser)
    parser.add_argument("--preset", required=True, choices=list(all_presets()),
                        help=f"named hardware: {', '.join(all_presets())}")
    parser.add_argument("--tflops", type=Float(0.0, low_open=True), default=None,
                        help="the device's effective TFLOP/s instead of the preset's")
    parser.add_argument("--steady-state", action="store_true",
                        help="the pipeline's steady state (no fill or drain: what a tokens/s meter reads over a long "
                             "run) instead of one flushed step")
    parser.add_argument("--gemm-efficiency", default=None, type=InputFile(format="json"),
                        help="a per-GEMM-shape efficiency table (`make gpu-check STAGES=gemm`): the device's "
                             "throughput is its peak x this config's decoder GEMMs' measured efficiency (not the "
                             "preset's; --tflops still wins)")
    parser.add_argument("--plans", default="runs/plans", type=OutputFolder(),
                        help="plan cache folder (default: %(default)s)")
    parser.add_argument("--json", default=None, type=OutputFile(writer),  # checked when parsed, before the plan
                        help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    try:
        hw = preset(args.preset)
        tflops = hw.tflops if args.tflops is None else args.tflops
        cfg = config_from_args(args)
        p = cfg.parallelism
        cfg.validate(world_size=p.dp * p.tp * p.pp)
        if args.gemm_efficiency and args.tflops is None:
            table = load_table(Path(args.gemm_efficiency))
            tflops = table["peak_tflops"] * mix_efficiency(table, layer_gemms(cfg))
            hw = dataclasses.replace(hw, tflops=tflops, source=f"--gemm-efficiency {args.gemm_efficiency}: "
                                     f"{table['device']}'s peak {table['peak_tflops']:g} TFLOP/s x this config's "
                                     "decoder GEMMs' measured efficiency")
    except UserFacingError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2

    t = cfg.tokens
    plan = planned(args.config_file, list(args.overrides), Path(args.plans))
    if cfg.optimizer.name != "adamw":  # its update's FLOPs (Muon's Newton-Schulz) priced once per step: less the twin's
        plan = with_update_flops(plan, planned(args.config_file, [*args.overrides, "optimizer.name=adamw"],
                                               Path(args.plans)))
    plan["tokens_per_step"] = t.sequence_length * t.micro_batch_size * t.batch_accumulation_per_replica * p.dp
    terms = clock_terms(plan, hw, tflops, steady=args.steady_state)
    title = " ".join([args.config_file, *(f"--set {o}" for o in args.overrides)])
    sys.stdout.write(render(args.preset, hw, tflops, plan, terms, title))
    if args.json:
        writer.write_json(args.json, {"preset": args.preset, "tflops": tflops, "config": title,
                                      "tokens_per_step": plan["tokens_per_step"], **terms}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
