# Set-up and everyday commands. Every target creates .venv at the repo root when it is missing.
# torch is pinned to the 2.13.0 CPU build: an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train-demo test lint bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train-demo: $(STAMP)
	$(PY) -m recipes.qwen2_vl.train +packing=greedy

test: $(STAMP)
	$(PY) -m pytest -q --durations=25

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) tools/bench_packing.py
