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

test: $(STAMP) redis-server
	$(BIN)/python -m pytest $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python -m proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
