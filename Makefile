# One entry point for set-up, the default job and the tests. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines: the torch wheel on local disk (no multi-GB CUDA download). GPU images keep their own torch.
TORCH_CPU ?= torch==2.13.0
NPROC ?= 2
CONFIG ?= examples/config_tiny_llama.yaml
# Optional extras on top of the test set-up, one flag: make setup EXTRAS=eval (lm-eval), EXTRAS=eval,flash, ...
EXTRAS ?=
comma := ,
STAMP := $(VENV)/.installed$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))

.PHONY: setup train-tiny lint test test-quick clean-venv gpu-wheels gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml patches/series $(wildcard patches/*.patch)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "$(TORCH_CPU)"; fi
	$(BIN)/pip install -q -e '.[dev$(if $(EXTRAS),$(comma)$(EXTRAS))]'
	$(BIN)/python patches/apply.py
	touch $@

# The main job: prepare the embedded corpus, train the tiny Llama on $(NPROC) CPU processes, print a summary.
train-tiny: setup
	$(BIN)/python -m nanotron_ext.data prepare --config-file $(CONFIG)
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) -m nanotron_ext.train --config-file $(CONFIG)

lint: setup
	$(BIN)/ruff check .

# Two pytest workers (pytest-xdist): multi-process tests spend much of their time starting processes and waiting
# on each other, so a second worker fills the idle core (the full suite on 2 cores from a fresh clone: 14 min 39 s in
# two, 2026-11-28; before this day's cuts 33 min in one, 20-28 in two, 34.5 in three: docs/testing.md).
TEST_WORKERS ?= 2
# NANOTRON_EXT_EXTRAS: the extras this set-up installed (dev: the test set-up, pyproject.toml); a test of one of them
# fails, not skips, when it is missing
# OMP_NUM_THREADS=1: one intra-op thread per process (as torchrun gives each rank): torch's default of one per core
# makes two workers and their single-process jobs oversubscribe the cores, and OpenMP threads spin while they wait
PYTEST = NANOTRON_EXT_EXTRAS=dev$(if $(EXTRAS),$(comma)$(EXTRAS)) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q \
	-p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

test: setup
	$(PYTEST) --durations=25

test-quick: setup
	$(PYTEST) -m "not slow"

clean-venv:
	rm -rf $(VENV)

# GPU check (benchmarks/gpu_check.py; README "GPU check"). Here, with network: fill .whl/ for a GPU machine that
# has none. There: make gpu-check [STAGES=throughput,profile,throughput_1b,memory,techniques,codecs,boost]
# [GPU_CHECK_ARGS="--copy-to DIR"] (every stage by default, <= 540 s),
# with the machine's own python3 + torch, the carried wheels installed into $(GPU_SITE) and the patches applied.
# DRY_RUN=1: the same plan on CPU with tiny shapes, in .venv (CI runs it through tests/test_gpu_check.py).
GPU_SITE ?= /tmp/site
STAGES ?=
GPU_CHECK_ARGS ?=
GPU_CHECK = benchmarks/gpu_check.py $(if $(STAGES),--stages $(STAGES)) $(GPU_CHECK_ARGS)

gpu-wheels: setup
	$(BIN)/python scripts/gpu_wheels.py fill --dest .whl

ifneq ($(filter 1 yes true,$(DRY_RUN)),)
gpu-check: setup
	$(BIN)/python $(GPU_CHECK) --dry-run
else
gpu-check:
	$(PYTHON) scripts/gpu_wheels.py install --dest .whl --site $(GPU_SITE)
	PYTHONPATH="$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) $(GPU_CHECK)
endif
