# One entry point for set-up, the default job and the tests. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
# Every value a user sets is checked as text before make reads anything else (command-line variables are
# recursively expanded by make, so `$(value VAR)`: never expanded), stopping make with one line naming the variable
# (exit 2) before anything runs; a recipe gets it as one single-quoted shell word ($(call sq,...)).
define nl


endef
sq = '$(subst ','\'',$(1))'
# $(call check,VAR,sh code printing something for a bad "$$v",what VAR must be); a newline is refused by make itself
# ($(shell) would turn it into nothing)
check = $(if $(or $(findstring $(nl),$(value $(1))),$(shell v=$(call sq,$(value $(1))); $(2))),$(error $(1)=$\
$(subst $(nl),\n,$(value $(1))): $(3)))
# the characters a path may not hold here: control characters and the shell's own
unsafe := *[[:cntrl:]\;\|\&\<\>\$$\`\"\'\\]*
$(call check,VENV,case "$$v" in (''|$(unsafe)|*[[:space:]]*) echo bad;; esac,a folder path without spaces or the \
shell's characters)
BIN := $(VENV)/bin
# CPU machines: the torch wheel on local disk (no multi-GB CUDA download). GPU images keep their own torch.
TORCH_CPU ?= torch==2.13.0
NPROC ?= 2
CONFIG ?= examples/config_tiny_llama.yaml
# Optional extras on top of the test set-up, one flag: make setup EXTRAS=eval (lm-eval), EXTRAS=eval,flash, ...
EXTRAS ?=
comma := ,
empty :=
space := $(empty) $(empty)

$(call check,EXTRAS,case "$$v" in (*[!a-z0-9$(comma)_-]*) echo bad;; esac,extras of pyproject.toml$(comma) \
comma-separated (eval$(comma)flash))
$(call check,TORCH_CPU,case "$$v" in (''|*[!A-Za-z0-9._+=\<\>!~$(comma)-]*) echo bad;; esac,a pip requirement \
(torch==2.13.0))
STAMP := $(VENV)/.installed$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))

.PHONY: setup train-tiny lint test test-quick clean-venv gpu-wheels gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml patches/series $(wildcard patches/*.patch)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q $(call sq,$(value TORCH_CPU)); fi
	$(BIN)/pip install -q -e '.[dev$(if $(EXTRAS),$(comma)$(EXTRAS))]'
	$(BIN)/python patches/apply.py
	touch $@

# The main job: prepare the embedded corpus, train the tiny Llama on $(NPROC) CPU processes, print a summary.
ifneq ($(filter train-tiny,$(MAKECMDGOALS)),)
$(call check,NPROC,case "$$v" in (''|0*|*[!0-9]*|????*) echo bad;; esac,a whole number of processes$(comma) 1 to 999)
$(call check,CONFIG,case "$$v" in (''|$(unsafe)) echo bad;; esac; [ -f "$$v" ] && [ -r "$$v" ] || echo bad,a \
readable YAML file without the shell's characters (examples/config_tiny_llama.yaml))
endif
train-tiny: setup
	$(BIN)/python -m nanotron_ext.data prepare --config-file $(call sq,$(value CONFIG))
	$(BIN)/torchrun --standalone --nproc_per_node=$(call sq,$(value NPROC)) -m nanotron_ext.train \
		--config-file $(call sq,$(value CONFIG))

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
ifneq ($(filter test test-quick,$(MAKECMDGOALS)),)
$(call check,TEST_WORKERS,case "$$v" in (auto|logical) ;; (''|0?*|*[!0-9]*|????*) echo bad;; esac,\
pytest-xdist's -n: a whole number 0 to 999$(comma) auto or logical)
endif
PYTEST = NANOTRON_EXT_EXTRAS=dev$(if $(EXTRAS),$(comma)$(EXTRAS)) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q \
	-p no:cacheprovider -n $(call sq,$(value TEST_WORKERS)) --dist worksteal

test: setup
	$(PYTEST) --durations=25

test-quick: setup
	$(PYTEST) -m "not slow"

# deletes only a folder make setup made (its .installed stamp): VENV=<your folder> is refused, not emptied
ifneq ($(filter clean-venv,$(MAKECMDGOALS)),)
$(call check,VENV,[ ! -e "$$v" ] || { set -- "$$v"/.installed*; [ -e "$$1" ]; } || echo bad,no .installed stamp \
of make setup in it: clean-venv deletes only a folder make setup made)
endif
clean-venv:
	rm -rf -- $(call sq,$(value VENV))

# GPU check (benchmarks/gpu_check.py; README "GPU check"). Here, with network: fill .whl/ for a GPU machine that
# has none. There: make gpu-check [STAGES=throughput,profile,throughput_1b,memory,techniques,codecs,boost; or gemm]
# [GPU_CHECK_ARGS="--copy-to DIR"] (every stage by default, <= 540 s),
# with the machine's own python3 + torch, the carried wheels (WHEELS, default .whl) installed into GPU_SITE and the
# patches applied. GPU_SITE: default a fresh folder only you can write (mktemp -d under TMPDIR), removed at the end;
# a folder you name must be yours and writable by no one else (else another user's sitecustomize.py would run).
# DRY_RUN=1: the same plan on CPU with tiny shapes, in .venv (CI runs it through tests/test_gpu_check.py).
GPU_SITE ?=
WHEELS ?= .whl
STAGES ?=
GPU_CHECK_ARGS ?=
# the stages of benchmarks/gpu_check_plan.py (tests/test_shell_fuzz.py checks they agree)
GPU_CHECK_STAGES := throughput profile throughput_1b memory techniques codecs boost gemm
ifneq ($(filter gpu-check,$(MAKECMDGOALS)),)
$(call check,STAGES,case "$$v" in (*[!a-z0-9_$(comma)]*) echo bad;; esac,stage names$(comma) comma-separated \
($(subst $(space),$(comma),$(GPU_CHECK_STAGES))))
$(if $(filter-out $(GPU_CHECK_STAGES),$(subst $(comma), ,$(value STAGES))),$(error STAGES=$(value STAGES): \
unknown stage $(firstword $(filter-out $(GPU_CHECK_STAGES),$(subst $(comma), ,$(value STAGES)))) (known: \
$(subst $(space),$(comma),$(GPU_CHECK_STAGES)))))
$(call check,GPU_SITE,case "$$v" in ('') ;; (*:*|$(unsafe)) echo bad;; (/*) ;; (*) echo bad;; esac; \
if [ -n "$$v" ] && { [ -e "$$v" ] || [ -L "$$v" ]; }; then [ -d "$$v" ] && [ ! -L "$$v" ] && [ -O "$$v" ] \
&& [ -z "$$(find "$$v" -maxdepth 0 -perm /022)" ] || echo bad; fi,an absolute path (no ':') to a folder only you \
can write (yours$(comma) not group- or other-writable)$(comma) or unset for a fresh private one)
$(call check,WHEELS,case "$$v" in (''|$(unsafe)) echo bad;; esac,the wheel folder (.whl))
endif
GPU_CHECK = benchmarks/gpu_check.py $(if $(value STAGES),--stages $(call sq,$(value STAGES))) \
	$(foreach a,$(value GPU_CHECK_ARGS),$(call sq,$(a)))

gpu-wheels: setup
	$(BIN)/python scripts/gpu_wheels.py fill --dest .whl

ifneq ($(filter 1 yes true,$(DRY_RUN)),)
gpu-check: setup
	$(BIN)/python $(GPU_CHECK) --dry-run
else
# one shell: the fresh folder is made, used and removed by the same recipe (removed only when it made it)
gpu-check:
	@site=$(call sq,$(value GPU_SITE)); made=; \
	if [ -z "$$site" ]; then site=$$(mktemp -d "$${TMPDIR:-/tmp}/nanotron_ext-site.XXXXXX") || exit 1; made=1; fi; \
	trap '[ -z "$$made" ] || rm -rf -- "$$site"' EXIT; \
	$(PYTHON) scripts/gpu_wheels.py install --dest $(call sq,$(value WHEELS)) --site "$$site" && \
	PYTHONPATH=$(call sq,$(CURDIR)):"$$site$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) $(GPU_CHECK)
endif
