"""Which system, at which layout, reaches a target loss soonest on given hardware (`python -m nanotron_ext.advise`).

Every baseline gets the layout, precision and optimizer its best user would choose (issue 51): each of the WAN
meter's systems is searched over the layouts that have its loss runs' math, on any subset of the hardware's nodes
(the datacenter alone counts), its step priced by the model clock and its steps to target taken from loss runs.

    hardware   the hardware description (nodes, GPUs, datacenter, three links), a YAML or a model-clock preset
    layouts    each system's layouts with its loss runs' math, and where its ranks sit
    search     plans per (system, tp, pp) reshaped per layout; the three step bounds; the best layout
    penalties  steps to target from loss runs (ours at each size, or the papers' published penalties)
    ranking    the systems ranked by time to target, the committed layout beside; the text table
    regime     the regime map: the winner per model size, link speed and datacenter share
"""
