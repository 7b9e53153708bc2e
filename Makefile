# The two set-up commands: `make up` and `make test`. Both work on a fresh machine.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8080
SLOTS  ?= 4
PYTEST_ARGS ?=

.PHONY: up test venv build build-stock lint clean-venv

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,plot]'
	touch $@

build: venv
	PYTHON=$(PY) ./build_llama.sh >/dev/null

build-stock: venv
	PYTHON=$(PY) ./build_llama.sh --stock >/dev/null

# Run the patched llama-server (unified KV, $(SLOTS) slots) with the default Gemma model.
up: build
	@model=$$($(VENV)/bin/llama-sidecar model) && bin=$$(./build_llama.sh --print-path) && \
	echo "llama-server on http://$(HOST):$(PORT) with $$model" && \
	exec $$bin -m $$model --host $(HOST) --port $(PORT) --kv-unified --parallel $(SLOTS) \
	    -c $$((4096 * $(SLOTS))) --metrics --slots --sse-ping-interval 1

# Everything: the venv, both builds (patched and stock, cached after the first run), all tests.
test: build build-stock
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check sidecar tests benchmarks
	$(VENV)/bin/mypy sidecar

clean-venv:
	rm -rf $(VENV)
