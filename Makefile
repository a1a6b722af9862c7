# One entry point for set-up, the default job and the tests. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines: the torch wheel on local disk (no multi-GB CUDA download). GPU images keep their own torch.
TORCH_CPU ?= torch==2.13.0
NPROC ?= 2
CONFIG ?= examples/config_tiny_llama.yaml

.PHONY: setup train-tiny lint test test-quick clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml patches/series $(wildcard patches/*.patch)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "$(TORCH_CPU)"; fi
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python patches/apply.py
	touch $@

# The main job: prepare the embedded corpus, train the tiny Llama on $(NPROC) CPU processes, print a summary.
train-tiny: setup
	$(BIN)/python -m nanotron_ext.data prepare --config-file $(CONFIG)
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) -m nanotron_ext.train --config-file $(CONFIG)

lint: setup
	$(BIN)/ruff check nanotron_ext reproduce benchmarks tests

test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-quick: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

clean-venv:
	rm -rf $(VENV)
