# make demo   - the whole pipeline on the embedded default (tiny models, generated data, CPU)
# make test   - the test suite
# Both create .venv with the pinned dependencies first if needed, and are safe to run twice.

SHELL := /bin/bash
VENV := .venv
# uv installs the lock (exactly: `uv pip sync`) in under a minute, where pip took 10 minutes and more.
# --compile-bytecode: every module's .pyc is written once here. Python reads .pyc files even under
# PYTHONDONTWRITEBYTECODE=1 (set on some machines), which otherwise recompiles JAX, MaxText and DVC
# from source in every process: docs/testing.md.
UV_VERSION := 0.13.9
BIN := $(CURDIR)/$(VENV)/bin
# Python 3.12 (MaxText needs >= 3.12): a working python3.12 on PATH, else pyenv's, else say how to get one.
PY312 := $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python; do \
	  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
# headless Chromium: tests/reporting/test_plots_page.py opens the plots page in it with the network off
CHROMIUM := /usr/bin/chromium
export PATH := $(BIN):$(PATH)
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT := false
export NO_GCE_CHECK := true

.PHONY: demo test test-fast control bench bench-realsize lock lock-check clean-work

$(VENV)/.installed: requirements.lock pyproject.toml Makefile
	@test -n "$(PY312)" || { echo "Python 3.12 not found: install it (e.g. 'uv python install 3.12' or 'pyenv install 3.12')" >&2; exit 1; }
	@test -x $(BIN)/python || $(PY312) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv==$(UV_VERSION)
	$(BIN)/uv pip sync --quiet --compile-bytecode --python $(BIN)/python --require-hashes requirements.lock
	$(BIN)/python -m pip check
	@touch $@

# configure and make_embedded first, then the two branches side by side, one per core (--downstream:
# each checks its own stages only, so neither locks the shared ones); DVC lets go of its repo lock
# while a stage's command runs (--wait-for-lock: while the other branch records a stage). The last
# `dvc repro` checks that nothing is left to run.
demo: $(VENV)/.installed
	dvc repro make_embedded
	set -o pipefail; \
	  (dvc --wait-for-lock repro --downstream hf_download@sft 2>&1 | sed -u 's/^/[sft] /') & sft=$$!; \
	  (dvc --wait-for-lock repro --downstream hf_download@rl 2>&1 | sed -u 's/^/[rl]  /'); rl=$$?; \
	  wait $$sft && test $$rl = 0
	dvc repro
	dvc metrics show
	dvc plots show --out dvc_plots >/dev/null && echo "loss curves: dvc_plots/index.html (draws offline)"
	python -m mtpipe.reporting.report --out reports/latest

# The control plane alone, on any laptop (Linux, macOS): doit vm_*, dvc, publish and the report, from
# requirements-control.lock (no JAX, libtpu or MaxText's stack; MaxText's config files for the machine
# budget) in .venv-control. What needs MaxText (the embedded demo, preflight's compile) needs `make`.
CONTROL := .venv-control
control: $(CONTROL)/.installed
$(CONTROL)/.installed: requirements-control.lock
	@test -n "$(PY312)" || { echo "Python 3.12 not found: install it (e.g. 'uv python install 3.12' or 'pyenv install 3.12')" >&2; exit 1; }
	@test -x $(CONTROL)/bin/python || $(PY312) -m venv $(CONTROL)
	$(CONTROL)/bin/python -m pip install --quiet uv==$(UV_VERSION)
	$(CONTROL)/bin/uv pip sync --quiet --compile-bytecode --python $(CONTROL)/bin/python --require-hashes requirements-control.lock
	@touch $@
	@echo "control plane ready: source $(CONTROL)/bin/activate, then doit / dvc from this directory"

# two pytest-xdist workers: one builds the shared pipeline while the other runs what needs none
# (tests/conftest.py, docs/testing.md); WORKERS=0 runs everything in one process. pytest runs with the
# network cut where this machine allows it (tests/offline.py: root): the tests need no index.
test: $(VENV)/.installed $(CHROMIUM) work/.test-envs
	python tests/offline.py python -m pytest -n $(or $(WORKERS),2) --dist loadgroup --no-loadscope-reorder

test-fast: $(VENV)/.installed $(CHROMIUM) work/.test-envs
	python tests/offline.py python -m pytest -n $(or $(WORKERS),2) -m "not slow"

# What the tests would otherwise fetch from a package index: xpk's and TRL's side environments, the uv
# tests/cloud/on_vm/test_vm_lock.py runs, requirements-vm.lock in uv's cache (tests/prefetch.py; each kept while
# its marker matches).
work/.test-envs: $(VENV)/.installed requirements-vm.lock requirements-control.lock tests/prefetch.py tests/xpk_parser.py benchmarks/grpo_trl.py
	python tests/prefetch.py
	@touch $@

# Debian's chromium, installed when missing (needs root)
$(CHROMIUM):
	@test "$$(id -u)" = 0 || { echo "$(CHROMIUM) is missing: install Debian's chromium package (sudo apt-get install chromium)" >&2; exit 1; }
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

bench: $(VENV)/.installed
	python benchmarks/bench_dvc.py

# DVC vs plain tools on a gemma-3-4b-sized checkpoint (17.2 GB, needs 3.5 x that free): SIZE=1GiB for a quick run.
bench-realsize: $(VENV)/.installed
	python benchmarks/bench_realsize.py --size $(or $(SIZE),full)

# Both locks from pyproject.toml's pins, the VM's first (MaxText's floors, the newest release of what
# MaxText does not choose), then the laptop's with the VM's versions as constraints: one toolchain
# (mtpipe/pipeline/requirement_locks.py, docs/tpu-vm.md). Linux x86_64 / Python 3.12, with hashes, PyPI
# as of a fixed date. Needs PyPI.
lock: $(VENV)/.installed
	python -m mtpipe.pipeline.requirement_locks

# Does the index still give both committed locks? Resolves them again as `make lock` does (into a
# temporary directory) and names each moved pin and how to relock; exit 1 if one moved. Needs PyPI,
# about 2 minutes; not part of `make test`, which needs no index.
lock-check: $(VENV)/.installed
	python -m mtpipe.pipeline.requirement_locks --check

clean-work:
	rm -rf work
