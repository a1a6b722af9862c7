"""Named hardware for the model clock: the device's effective throughput, a link per tier and where each replica sits.

Two families, one type (`ClockPreset`):
- `CLOCK_PRESETS`, the WAN meter's (`python -m nanotron_ext.bench.wan --clock model --clock-preset NAME`): the
  heterogeneous SparseLoCo 512M model over an internet stage link, one replica in a datacenter;
- `HARDWARE`, the papers' (`python -m nanotron_ext.bench.step_time --preset NAME`), each timed on the config given,
  as configured (no scale config). A paper's device throughput is the one number fitted to it:
  reproduce/paper_scale.py fits it on ONE named baseline row of the paper's table (the step time the clock replays
  equals the paper's there) and holds it for every other row; the value here is that fit, rounded, and the script
  says when it no longer matches.

Every datacenter tier is a `parallel/link.py` collective model (`COLLECTIVE_MODELS`: NCCL's own latency and bus
bandwidth model, each constant with its source): a collective pays a base per call, a latency per ring step and its
volume at the bus bandwidth, so a small message costs more than its bytes. The internet links are the papers' stated
ones, and what a paper leaves out (latency, duplex) is said in each source.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from nanotron_ext.errors import UserFacingError
from nanotron_ext.parallel.link import COLLECTIVE_MODELS

# A100 bf16 dense peak 312 TFLOP/s at about a third: the assumption reproduce/het_sparseloco/stage_link.py uses
A100_EFFECTIVE_TFLOPS = 100.0


def _collective(name: str) -> Tuple[float, float, float]:
    """A `parallel/link.py` collective model (NCCL's: COLLECTIVE_MODELS) as the clock's (bus Mbit/s, ms per ring
    step, ms per call): the TP / DP tiers' collectives pay all three (replay.ring_seconds), a stage hop the first
    two."""
    m = COLLECTIVE_MODELS[name]
    return (m.bus_mbps, m.step_ms, m.base_ms)


# -- the model clock's presets (`--clock model`): hardware, links per tier and where each replica sits ----------

@dataclasses.dataclass(frozen=True)
class ClockPreset:
    """Named hardware for the model clock (bench/clock/replay.py): the device's effective throughput, a link per tier,
    and the placement: replicas listed in `datacenter_replicas` run their stages over `datacenter_stage` (a full
    replica inside one datacenter), the others over `stage` (a pipeline of poorly connected participants). A node
    holds one stage's TP group and has one uplink. `scale_config`: the paper-scale YAML whose model and batch each
    system is timed at (its layout and techniques stay the meter's: bench/clock/pricing.py)."""

    source: str
    scale_config: str
    device: str
    tflops: float
    tp: Tuple[float, ...]  # (Mbit/s, one-way ms[, ms per collective call]) of every link below; duplex full unless
    stage: Tuple[float, ...]  # `duplex` says; a datacenter tier is NCCL's collective model (`_collective`)
    datacenter_stage: Tuple[float, ...]
    dp: Tuple[float, ...]
    datacenter_replicas: Tuple[int, ...] = (1,)
    duplex: str = "full"
    latency_holds_wire: bool = False  # the stage links' latency keeps the wire busy (clock.Link)
    # TFLOP/s of the work an optimiser does once per step (Muon's Newton-Schulz: large square bf16 GEMMs), from a
    # stated source, not fitted; 0: the device's effective throughput `tflops`
    update_tflops: float = 0.0


INFINIBAND = _collective("infiniband")  # one NDR port under NCCL's model
NVLINK3 = _collective("nvlink3")  # A100 NVLink 3 under NCCL's model: 240 GB/s bus bandwidth
SCALE_512M = "reproduce/het_sparseloco/sparseloco_512m.yaml"
CLOCK_PRESETS: Dict[str, ClockPreset] = {
    "internet-1g": ClockPreset(
        "Heterogeneous SparseLoCo (arXiv:2601.02360) Fig. 3(b): 1 Gbit/s stage links between the participants that "
        "share a replica, the same link and 10 ms between replicas; its placement: the uncompressed replica (1) a "
        "full replica in a datacenter (InfiniBand between its stages), the compressed one (0) over the internet",
        SCALE_512M, f"A100 at {A100_EFFECTIVE_TFLOPS:g} effective TFLOP/s (assumed, as stage_link.py)",
        A100_EFFECTIVE_TFLOPS, NVLINK3, (1000.0, 10.0), INFINIBAND, (1000.0, 10.0)),
    "protocolnanogpt-200m-50ms": ClockPreset(
        "ProtocolNanoGPT: 200 Mbit/s and 50 ms per pipeline stage link over the internet, the same between "
        "replicas; replica 1 a datacenter replica (InfiniBand between its stages), replica 0 over the internet",
        SCALE_512M, f"A100 at {A100_EFFECTIVE_TFLOPS:g} effective TFLOP/s (assumed, as stage_link.py)",
        A100_EFFECTIVE_TFLOPS, NVLINK3, (200.0, 50.0), INFINIBAND, (200.0, 50.0)),
}


NONE = (0.0, 0.0)  # a tier the layout does not use (0 Mbit/s = unlimited: the clock charges it nothing)
SLINGSHOT11 = _collective("slingshot11")  # Perlmutter between nodes
RESBM = ("ResBM (arXiv:2604.11947) Table 3: 8 x A10G, one block per GPU, GPipe over PyTorch/NCCL, batch 16 x 1024, "
         "'designed to measure steady-state throughput' (sec. 4.3): the clock's steady state; the stage link's budget "
         "shared by both directions (its 609 tok/s = 80e6 / (2 x 4096 x 16 bit)), no latency stated; A10G "
         "throughput fitted on the centralised row (10 Gbit/s, 7530 tok/s) by reproduce/paper_scale.py; Muon's "
         "Newton-Schulz, once per step, at the bf16 dense tensor peak of NVIDIA's A10 datasheet (125 TFLOP/s; the "
         "A10G is AWS's A10 and has no datasheet of its own): a peak, so the Muon rows' update time is a lower bound")
A10_BF16_PEAK = 125.0
SM = ("Protocol Models (arXiv:2506.01260) Table 1: 8 x A10G, one layer per GPU, 2B model, 'GPipe ... via "
      "torch.distributed.pipelining' (sec. 7; a flushed step); duplex and latency not stated (full duplex, none), "
      "context length, batch and k lost in the text (our sm_2b_*.yaml CHOICEs); A10G "
      "throughput fitted on the centralised row (100 Gbit/s, 602.57 tok/s) by reproduce/paper_scale.py")
PNG = ("ProtocolNanoGPT (github.com/PluralisResearch/ProtocolNanoGPT, records 20260917/20260918): one 8 x H100 "
       "machine, one stage per GPU, every stage link simulated as 200 Mbit/s + 50 ms by a receiver-side meter that "
       "puts every message a rank receives, both directions, on one wire and holds it for the transfer and the "
       "latency (SimPipelineStage.add_delay): half duplex with the latency holding the wire. The dense row "
       "(100.475 s/step) cannot fit a throughput: its compute is < 1% of the step and the links alone replay to "
       "100.97 s; H100 at 307 effective TFLOP/s instead, our 125M model's measured 31.0% MFU of the 989 TFLOP/s "
       "dense bf16 peak (flash + compile, 1 x H200, whose compute is the H100 SXM's; gpu-check 2026-11-27)")
BOOST = ("BOOST (arXiv:2512.12131) sec. 5.2: NERSC Perlmutter, 4 x A100-80GB per node on NVLink 3, Slingshot 11 "
         "between nodes (stages), pure bf16, seq 4096, batch 4, TP 4; both tiers under NCCL's collective model "
         "(parallel/link.py COLLECTIVE_MODELS: 240 GB/s bus bandwidth on NVLink 3, 8.4 us per call, 3.4 us per step); "
         "A100 throughput fitted on Table 3's per-block time (CoLA 7B, ungrouped, bz = 4: 7577 us, taken as the "
         "forward) by reproduce/paper_scale.py")
HET = ("Heterogeneous SparseLoCo (arXiv:2601.02360) Fig. 2 / 3(b): 1 Gbit/s stage links for the compressed "
       "replicas (4-7 of sparseloco_512m.yaml with HET_HALF), the uncompressed ones (0-3) inside a datacenter "
       "(InfiniBand between their stages), 1 Gbit/s + 10 ms between replicas; the paper names no device: A100 at "
       f"{A100_EFFECTIVE_TFLOPS:g} effective TFLOP/s assumed (not fitted: the figure gives no time to fit on)")

HARDWARE: Dict[str, ClockPreset] = {
    "resbm-a10g-10g": ClockPreset(RESBM, "", "8 x A10G (fitted)", 18.1, NONE, (1e4, 0.0), NONE, NONE, (), "half",
                                  update_tflops=A10_BF16_PEAK),
    "resbm-a10g-80m": ClockPreset(RESBM, "", "8 x A10G (fitted)", 18.1, NONE, (80.0, 0.0), NONE, NONE, (), "half",
                                  update_tflops=A10_BF16_PEAK),
    "sm-a10g-100g": ClockPreset(SM, "", "8 x A10G (fitted)", 1.68, NONE, (1e5, 0.0), NONE, NONE, ()),
    "sm-a10g-80m": ClockPreset(SM, "", "8 x A10G (fitted)", 1.68, NONE, (80.0, 0.0), NONE, NONE, ()),
    "protocolnanogpt-h100": ClockPreset(PNG, "", "8 x H100 (its throughput measured on an H200)", 307.0, NONE,
                                        (200.0, 50.0), NONE, NONE, (), "half", latency_holds_wire=True),
    "boost-a100-nvlink": ClockPreset(BOOST, "", "4 x A100-80GB per node (fitted)", 165.0, NVLINK3, SLINGSHOT11,
                                     NONE, NONE, ()),
    "het-sparseloco-a100-1g": ClockPreset(HET, "", f"A100 at {A100_EFFECTIVE_TFLOPS:g} TFLOP/s (assumed)",
                                          A100_EFFECTIVE_TFLOPS, NVLINK3, (1000.0, 10.0), INFINIBAND, (1000.0, 10.0),
                                          (0, 1, 2, 3)),
}


def all_presets() -> Dict[str, ClockPreset]:
    """Every preset `--preset` takes: the papers' hardware and the WAN meter's clock presets."""
    return {**HARDWARE, **CLOCK_PRESETS}


def preset(name: str) -> ClockPreset:
    """The preset `name`; a one-line error naming it and listing the known ones otherwise."""
    known = all_presets()
    if name not in known:
        raise UserFacingError(f"--preset {name!r} is not a known preset; known: {', '.join(known)}")
    return known[name]
