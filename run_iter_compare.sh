#!/usr/bin/env bash
# Iteration-time comparison of full-rank Megatron TP, vanilla low-rank TP and BOOST (btp) on the
# same model shape and batch (BOOST issue item 6). Driver: reproduce/boost/iter_compare.py.
#
# Usage:
#   ./run_iter_compare.sh [DRIVER OPTIONS]                          # 2 CPU processes (TP=2, gloo)
#   ./run_iter_compare.sh [TORCHRUN OPTIONS] -- [DRIVER OPTIONS]    # e.g. GPUs or several nodes
#
# Everything before `--` goes to torchrun (default: --nproc_per_node 2; --standalone is added
# unless you pass rendezvous options such as --nnodes/--rdzv-*/--master-*); everything after it
# (or everything, when there is no `--`) goes to the driver. TP = world size / (dp * pp).
#
# Driver options (see --help for all):
#   --iters N (12)  --warmup W (2)  --rounds R (1)       iterations per row, dropped warm-up, repeats
#   --mode separate|interleaved (separate)                 one torchrun job per row, or one job with the
#                                                          rows' iterations alternating (fair under changing load)
#   --strategies megatron,vanilla,btp                      rows (unregistered ones print "not available")
#   --rmsnorm online|sync|both (both)                      RMSNorm mode(s) of the btp rows
#   --config-file FILE  --set KEY=VALUE ...                base config (e.g. reproduce/boost/llama_7b_btp.yaml)
#   --hidden 256 --rank 64 --layers 4 --heads 4 --ffn 688 --seq 256 --micro-batch 2 --dtype fp32
#   --low-rank-kind svd|cola|lax (cola)                    factorisation of the low-rank rows
#   --out table.json|table.csv  --log-dir DIR  --verbose    JSON gets a markdown table beside it, both with
#                                                          the paper's numbers and whether its ordering held
#   --from-json table.json                                 re-render a saved table (paper column included)
#
# Examples:
#   ./run_iter_compare.sh --out runs/boost/iter_compare_cpu.json
#   ./run_iter_compare.sh --nproc_per_node 4 -- --config-file reproduce/boost/llama_7b_btp.yaml --iters 20
#   ./run_iter_compare.sh --nproc_per_node 8 -- --config-file reproduce/boost/llama_13b_btp.yaml
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x "$here/.venv/bin/python" ]]; then
    py="$here/.venv/bin/python"
else
    py="python3"
fi

torchrun_args=()
driver_args=()
if [[ " $* " == *" -- "* ]]; then
    seen_sep=0
    for a in "$@"; do
        if [[ $seen_sep -eq 0 && "$a" == "--" ]]; then
            seen_sep=1
        elif [[ $seen_sep -eq 0 ]]; then
            torchrun_args+=("$a")
        else
            driver_args+=("$a")
        fi
    done
else
    driver_args=("$@")
fi

exec "$py" "$here/reproduce/boost/iter_compare.py" "${driver_args[@]}" -- "${torchrun_args[@]}"
