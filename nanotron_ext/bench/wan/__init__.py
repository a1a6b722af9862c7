"""The WAN meter: which system reaches a given validation loss soonest over a preset's links
(`python -m nanotron_ext.bench.wan`; docs/links-and-wan-meter.md).

    systems   the meter's rows: each system's real layout (processes, config keys)
    runs      real-sleep runs (`--clock emulated`): each system trained in its real layout over emulated links
    presets   calibrated link presets (a paper's communication / compute ratio scaled to this machine)
    results   each run's curve, seeds pooled per (preset, system), the table, headline and figure, --merge
    args      every argument checked before the first run
    cli       the command line
"""
