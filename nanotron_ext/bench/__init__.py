"""The reproduction harness: what every paper's table and figure scripts share.

A script under `reproduce/<paper>/` is one file with two roles: run plainly it is the
*orchestrator* (resolves configs, launches `torchrun ... <script> --worker ...`, reads back the
JSON the worker wrote, prints and saves the table); under torchrun with `--worker` it is the
*worker* (builds the models on each rank, measures, global rank 0 writes the result JSON).

    launch    torchrun jobs: split argv at `--`, the torchrun command, one job with a log and a
              timeout, save configs + run a worker job + read its result, worker-side set-up
    timing    warm-up and spread (Summary), pooled rounds, speedups with standard errors,
              per-iteration timing between barriers with ledger bytes per group, interleaved rounds
    workload  model/batch options shared by scripts, config resolution, the registered TP
              strategies, building a model + optimizer, the precision of a block timed outside the
              trainer (timing_precision: a paper's pure bf16, or autocast), memory probes
    report    text and markdown tables, JSON/CSV rows, PNG figures titled with device and date
    paper     PaperClaim: the paper's number beside ours, and whether its ordering held

This package is core: it imports no technique package (tests/test_layout.py). Techniques are
named by strings (`model.tp_strategy=btp`) and built by the techniques that provide them, and a paper's
own helpers (closed forms, module names) live in `reproduce/<paper>/common.py`.
"""
