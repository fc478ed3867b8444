# warmstart: `make demo` runs the embedded default, `make test` runs the whole suite. Both set up what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
WARMSTART_CACHE ?= $(HOME)/.cache/warmstart
export WARMSTART_CACHE
BIN := $(VENV)/bin
PORT ?= 8000
STORE ?= $(WARMSTART_CACHE)/demo-store
EXTRAS ?= engine,gpu,dev

.PHONY: demo test setup criu control-plane lint unit clean

demo: $(VENV)/.installed criu
	$(BIN)/warmstart serve --engine builtin --model tiny --device cpu --store $(STORE) --port $(PORT) \
		--criu "$(CURDIR)/hack/criu"

test: $(VENV)/.installed criu control-plane
	$(BIN)/ruff check .
	$(BIN)/pytest

unit: $(VENV)/.installed
	$(BIN)/pytest -m "not integration and not gpu"

lint: $(VENV)/.installed
	$(BIN)/ruff check .

setup: $(VENV)/.installed criu control-plane

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

criu:
	hack/criu-setup

control-plane:
	hack/control-plane build

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
