"""The reproduction harness: what every paper's table and figure scripts share.

A script under `reproduce/<paper>/` is one file with two roles: run plainly it is the
*orchestrator* (resolves configs, launches `torchrun ... <script> --worker ...`, reads back the
JSON the worker wrote, prints and saves the table); under torchrun with `--worker` it is the
*worker* (builds the models on each rank, measures, global rank 0 writes the result JSON).

    launch      torchrun jobs: split argv at `--`, the torchrun command, one job with a log and a
                timeout, save configs + run a worker job + read its result, worker-side set-up
    timing      warm-up and spread (Summary), pooled rounds, speedups with standard errors,
                per-iteration timing between barriers with ledger bytes per group, interleaved rounds
    workload    model/batch options shared by scripts, config resolution, the registered TP
                strategies, building a model + optimizer, the precision of a block timed outside the
                trainer (timing_precision: a paper's pure bf16, or autocast), memory probes
    training    whole training runs as rows: the trainer under torchrun, its summary and validation curve
    presets     `--preset gpu` for the convergence scripts: the paper's experiment at paper scale
    configs     generated reproduction configs: written from their one source, or checked against it
    slow_link   the slow-link throughput benchmark every boundary codec shares (ResBM Table 3 style)
    report      text and markdown tables, JSON/CSV rows, PNG figures titled with device and date
    paper       PaperClaim: the paper's number beside ours, and whether its ordering held
    clock/      the model clock: a step's time replayed from its planned ranks on named hardware (replay, pricing,
                the WAN meter's and the papers' hardware, the compute check); one public entry, its __init__.py
    step_time   `python -m nanotron_ext.bench.step_time`: a config's step time on named hardware (plan + clock)
    netns_hosts/  hosts on one machine: N network namespaces on a bridge, a shaped link and a disk each
                (`python -m nanotron_ext.bench.netns_hosts --hosts N ... -- CMD`)
    multi_host  one job over several such hosts (`--nnodes`, per-host checkpoints); its step over the shaped link
                beside the model clock (`python -m nanotron_ext.bench.multi_host`)
    wan/        the WAN meter (`python -m nanotron_ext.bench.wan`): time to a target loss over a preset's links,
                measured (real-sleep runs) or by the model clock (clock/); its own index in wan/__init__.py

This package is core: it imports no technique package (tests/test_layout.py). Techniques are
named by strings (`model.tp_strategy=btp`) and built by the techniques that provide them, and a paper's
own helpers (closed forms, module names) live in `reproduce/<paper>/common.py`.
"""
