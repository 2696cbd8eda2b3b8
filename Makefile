# The two commands of the README: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU install: the `onnxruntime` wheel. For a GPU machine use EXTRAS=gpu,dev on a fresh .venv
# (onnxruntime and onnxruntime-gpu must never share an environment).
EXTRAS ?= cpu,dev

.PHONY: serve test proto bench clean redis-server

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	@touch $@

serve: $(STAMP)
	$(BIN)/batchgate serve $(ARGS)

# The tests start their own redis-server processes (so they can kill them): install the
# binary when the machine lacks it.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)

# After the tests, the quick benchmark (< 1 min): batchgate/no-op request rate, printed; it fails
# only on a collapse (ratio < 0.3). QUICK_BENCH=0 skips it.
QUICK_BENCH ?= 1
test: $(STAMP) redis-server
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	@if [ "$(QUICK_BENCH)" != 0 ]; then $(BIN)/python -m batchgate.bench.quick; fi

# The load generator (python -m batchgate.bench -h for its flags), e.g. make bench ARGS="--start-server --api unary,stream"
bench: $(STAMP)
	$(BIN)/python -m batchgate.bench $(ARGS)

proto: $(STAMP)
	$(BIN)/python -m batchgate.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
