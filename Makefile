# The two set-up commands: `make up` and `make test`. Both work on a fresh machine.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
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

# The patched llama-server (unified KV, 4 slots, parking on) with the default chat model (SmolLM2),
# the sidecar in front on 127.0.0.1:8081 and its metrics on :9464. UP_ARGS adds options.
UP_ARGS ?=
up: build
	$(VENV)/bin/llama-sidecar up $(UP_ARGS)

# Everything: the venv, both builds (patched and stock, cached after the first run), all tests.
# They run on PYTEST_WORKERS pytest-xdist workers (0: in this process), a test file per worker at a
# time so that a module's shared fixtures (a server, a stack) start once, the longest files first
# (tests/conftest.py); three on two cores, since the tests mostly wait on servers and streams (an
# idle 2-core machine: 250 s of tests on three, 299 s on two). Then the tests marked `serial` (a
# throughput or timing precondition) run one at a time with the CPUs to themselves.
# Both parts always run; a part that selects nothing (PYTEST_ARGS narrowed it) is not a failure
# unless the other selects nothing too.
PYTEST_WORKERS ?= 3
test: build build-stock
	@$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --part parallel $(PYTEST_ARGS); a=$$?; \
	$(PY) -m pytest --part serial $(PYTEST_ARGS); b=$$?; \
	if [ $$a -eq 5 ] && [ $$b -ne 5 ]; then a=0; fi; \
	if [ $$b -eq 5 ] && [ $$a -ne 5 ]; then b=0; fi; \
	if [ $$a -ne 0 ]; then exit $$a; fi; exit $$b

lint: venv
	$(VENV)/bin/ruff check sidecar tests benchmarks
	$(VENV)/bin/mypy sidecar

clean-venv:
	rm -rf $(VENV)
