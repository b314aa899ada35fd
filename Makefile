# The README's two commands: `make serve` and `make test`. Each creates .venv and
# installs what it needs when missing (CPU torch on machines without a GPU).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.installed
# Flags for `make serve`, e.g. make serve SERVE_FLAGS="--port 8001 --num-scheduler-steps 4"
SERVE_FLAGS ?=
# Flags for `make bench` (the offline engine benchmark), e.g. make bench BENCH_FLAGS="--matrix --models tiny"
BENCH_FLAGS ?=

.PHONY: serve test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: the CPU wheel first, so nothing later resolves torch to a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) -m cluster.serve_local $(SERVE_FLAGS)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m loadtests.bench_engine $(BENCH_FLAGS)

clean:
	rm -rf $(VENV)
