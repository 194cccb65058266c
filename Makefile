# Two entry points on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint model clean install

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
