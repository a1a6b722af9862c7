"""The model clock: a system's step time on named hardware, replayed from its planned ranks.

One public entry for everything that prices a step (the WAN meter's `--clock model`, `bench/step_time.py`,
`bench/multi_host.py`, `reproduce/paper_scale*.py`): import from `nanotron_ext.bench.clock`, not its modules.

- `replay.py`: the schedule replayed over FIFO links, two bounds of a flushed step (`step_bounds`) or of the steady
  state (`steady_bounds`), ring collectives, time to target;
- `pricing.py`: a config's twin planned rank by rank (`planned`), priced into the replay's work (`replica_works`),
  one `step_bounds_of` a plan over given links;
- `hardware.py`: the named hardware (`ClockPreset`): the WAN meter's `CLOCK_PRESETS` and the papers' `HARDWARE`;
- `compute_check.py`: a CPU run's measured ranks priced on the clock, to hold the clock to a run;
- `kernels.py`: GPU kernel efficiency per GEMM shape (`make gpu-check STAGES=gemm`'s table, `--gemm-efficiency`).
"""
from nanotron_ext.bench.clock.compute_check import (
                                                    RATIO_TOLERANCE,
                                                    config_links,
                                                    job_flops,
                                                    mean_step_s,
                                                    note,
                                                    priced_at_cpu_seconds,
)
from nanotron_ext.bench.clock.compute_check import check as check_compute
from nanotron_ext.bench.clock.hardware import (
                                                    A100_EFFECTIVE_TFLOPS,
                                                    CLOCK_PRESETS,
                                                    HARDWARE,
                                                    INFINIBAND,
                                                    NONE,
                                                    NVLINK3,
                                                    ClockPreset,
                                                    all_presets,
                                                    preset,
)
from nanotron_ext.bench.clock.kernels import layer_gemms, load_table, mix_efficiency, newton_schulz_gemms
from nanotron_ext.bench.clock.pricing import (
                                                    CONTROL_BYTES,
                                                    PLANNER_VERSION,
                                                    SCALE_KEYS,
                                                    bytes_per_step,
                                                    free_step_s,
                                                    links_of,
                                                    plan_path,
                                                    planned,
                                                    replica_counts,
                                                    replica_works,
                                                    stage_broadcast_s,
                                                    step_bounds_of,
                                                    tier_link,
                                                    twin_overrides,
                                                    width_keys,
                                                    with_update_flops,
)
from nanotron_ext.bench.clock.replay import (
                                                    Link,
                                                    ReplicaWork,
                                                    Stage,
                                                    StepBounds,
                                                    Timeline,
                                                    ddp_step_s,
                                                    replay,
                                                    ring_seconds,
                                                    schedule_order,
                                                    steady_bounds,
                                                    step_bounds,
                                                    time_to_target,
                                                    with_outer_sync,
)

__all__ = [
    "A100_EFFECTIVE_TFLOPS", "CLOCK_PRESETS", "CONTROL_BYTES", "HARDWARE", "INFINIBAND", "NONE", "NVLINK3",
    "PLANNER_VERSION", "RATIO_TOLERANCE", "SCALE_KEYS", "ClockPreset", "Link", "ReplicaWork", "Stage",
    "StepBounds", "Timeline", "all_presets", "bytes_per_step", "check_compute", "config_links", "ddp_step_s",
    "free_step_s", "job_flops", "layer_gemms", "links_of", "load_table", "mean_step_s", "mix_efficiency",
    "newton_schulz_gemms", "note", "plan_path", "planned", "preset", "priced_at_cpu_seconds",
    "replay", "replica_counts", "replica_works", "ring_seconds", "schedule_order", "stage_broadcast_s", "steady_bounds",
    "step_bounds", "step_bounds_of", "tier_link", "time_to_target", "twin_overrides", "with_outer_sync",
    "with_update_flops", "width_keys",
]
