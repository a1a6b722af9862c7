"""The WAN meter: which system reaches a given validation loss soonest over a preset's links
(`python -m nanotron_ext.bench.wan`; docs/links-and-wan-meter.md). Its model clock lives in bench/clock/.

    systems   the meter's rows: each system's real layout (processes, config keys)
    runs      real-sleep runs (`--clock emulated`): each system trained in its real layout over emulated links
    presets   calibrated link presets (a paper's communication / compute ratio scaled to this machine)
    results   each run's curve, seeds pooled per (preset, system), the table, headline and figure, --merge
    args      every argument checked before the first run
    cli       the command line
    modelled  the meter with the model clock (`--clock model`): curves, replayed steps, time to target
    losses    the model clock's learning curves, each system in its cheapest equivalent layout
    model_results   the model clock's table, headline and figure
    validate  the model clock against the real-sleep emulator (`--validate-clock`)
    scales    loss runs at more than one model size: the per-token penalty against dense 3D by size
              (`python -m nanotron_ext.bench.wan.scales`; results/loss_scales.md)
    scales_report   the papers' published penalties at their scale and the loss-scale Markdown
"""
