# The two commands of the README: `make serve` and `make test`. Both create .venv on first use.
# `make serve` installs what serving needs (batchgate + the runtime extra); `make test` adds the
# test tooling and the MiniLM reference (torch, transformers) to the same .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The ONNX Runtime flavour: cpu (the `onnxruntime` wheel) or gpu (onnxruntime-gpu + CuPy). They
# must never share an environment (both provide the `onnxruntime` module): switch on a fresh
# .venv, e.g. `make clean && make serve RUNTIME=gpu`.
RUNTIME ?= cpu
# OPENVINO=1 adds the OpenVINO engine to `make serve` (the openvino extra; a model served with
# engine "openvino" or an openvino-* variant needs it). `make test` always installs it. Its default
# is 1 on a CPU that multiplies BF16 itself (AVX-512 BF16 or AMX): there OpenVINO's BF16 is the
# fastest engine that passes the accuracy gate (docs/engines.md), and the background selection
# can choose only what is installed.
CPUINFO ?= /proc/cpuinfo
BF16_CPU := $(shell grep -qsE 'avx512_bf16|amx_bf16' $(CPUINFO) && echo 1)
OPENVINO ?= $(if $(and $(BF16_CPU),$(filter cpu,$(RUNTIME))),1,0)
comma := ,
SERVE_EXTRAS := $(RUNTIME)$(if $(filter 1,$(OPENVINO)),$(comma)openvino)
# One stamp per install, so `make serve` then `make test` in one checkout installs the rest, and
# `make serve` after `make test` installs nothing. pyproject.toml changing re-runs them.
SERVE_STAMP := $(VENV)/.installed-$(RUNTIME)$(if $(filter 1,$(OPENVINO)),-openvino)
TEST_STAMP  := $(VENV)/.installed-$(RUNTIME)-test
OTHER_ORT   := $(if $(filter gpu,$(RUNTIME)),onnxruntime,onnxruntime-gpu)

.PHONY: serve test test-deps system-packages lint proto bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Guard: a .venv built for the other runtime keeps its onnxruntime wheel; installing this one on
# top would leave whichever came last importable as `onnxruntime`.
define check_runtime
	@if $(BIN)/python -m pip show --quiet $(OTHER_ORT) 2>/dev/null; then \
	  echo "$(VENV) has $(OTHER_ORT) (another RUNTIME): run 'make clean' first" >&2; exit 1; fi
endef

# pip's own progress (Collecting / Downloading / Installing) is left on: the first run takes a
# minute or more and should not look stuck. --no-compile: Python compiles a module when first
# imported, so only what runs is compiled, not all ~19,000 files of torch & co. up front
# (measured: the test install 75 -> 40 s, 2026-12-05, Xeon family 6 model 167, 2 cores).
$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(check_runtime)
	@echo "== installing batchgate[$(SERVE_EXTRAS)] into $(VENV) (serving only; make test adds the test tools)"
	$(BIN)/python -m pip install --no-compile -e '.[$(SERVE_EXTRAS)]'
	@touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(check_runtime)
	@echo "== installing batchgate[$(RUNTIME),test,reference] into $(VENV) (test tools; torch: the MiniLM reference)"
	$(BIN)/python -m pip install --no-compile -e '.[$(RUNTIME),test,reference]'
	@touch $(SERVE_STAMP) $@

serve: $(SERVE_STAMP)
	$(BIN)/batchgate serve $(ARGS)

# What the tests need from the system, installed when the machine lacks it, in one apt-get run
# (apt holds one lock, so separate runs could not overlap the pip installs below):
# redis-server (the tests start their own processes, so they can kill them), valgrind (the
# instruction guard, tests/test_instruction_guard.py), chromium (headless pages: Swagger UI, CORS),
# prometheus (tests/test_dashboard_picture.py evaluates the chart's dashboard queries).
SYSTEM_TOOLS := redis-server:redis-server valgrind:valgrind chromium:chromium prometheus:prometheus
system-packages:
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || test -x /usr/bin/$${pair%%:*} || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then echo "== apt-get install$$missing"; \
	  apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; fi

# tests/test_helm_platform.py scans the rendered chart with checkov, in a venv of its own:
# checkov caps packaging below 24, which the setuptools that builds batchgate's wheel needs.
CHECKOV_VENV := .venv-checkov
$(CHECKOV_VENV)/bin/checkov:
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --no-compile 'checkov>=3.2'

# Lint and format check (ruff's rules are chosen in pyproject.toml); RUFF_FORMAT=0 skips the
# format check.
RUFF_FORMAT ?= 1
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	@if [ "$(RUFF_FORMAT)" != 0 ]; then $(BIN)/ruff format --check .; fi

# After the tests, the quick benchmark (< 1 min): batchgate/no-op request rate, printed; it fails
# only on a collapse (ratio < 0.3). QUICK_BENCH=0 skips it.
QUICK_BENCH ?= 1
# pytest-xdist workers: more than the 2 cores of a small machine, since many tests wait on sockets
# and processes (measured on 2 cores, quiet host, 2026-12-05: 3 workers 491 s, 5 workers 414 s,
# 1.3 cores busy; later 5 workers 336 s, 7 workers 338 s); the tests that time anything run alone,
# last (tests/parallel.py). 0: one process.
PYTEST_WORKERS ?= 5
# The installs overlap: the venv's pip, checkov's venv and apt (each mostly waits on disk or network).
test-deps: $(TEST_STAMP) $(CHECKOV_VENV)/bin/checkov system-packages
# The suite starts some 200 Python processes (servers, CLIs, workers): with PYTHONDONTWRITEBYTECODE
# set, as some machines set it, each would compile every module it imports anew, the packages
# installed with --no-compile included. The test run writes bytecode (into .venv and __pycache__/).
test:
	@$(MAKE) --no-print-directory -j3 test-deps
	@$(MAKE) --no-print-directory lint
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	@if [ "$(QUICK_BENCH)" != 0 ]; then env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m batchgate.bench.quick; fi

# The load generator (python -m batchgate.bench -h for its flags), e.g. make bench ARGS="--start-server --api unary,stream"
bench: $(TEST_STAMP)
	$(BIN)/python -m batchgate.bench $(ARGS)

proto: $(TEST_STAMP)
	$(BIN)/python -m batchgate.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
