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

.PHONY: demo test setup criu control-plane images addons lint unit clean

demo: $(VENV)/.installed criu
	$(BIN)/warmstart serve --engine builtin --model tiny --device cpu --store $(STORE) --port $(PORT) \
		--criu "$(CURDIR)/hack/criu"

test: $(VENV)/.installed criu control-plane images addons
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest

unit: $(VENV)/.installed
	$(BIN)/pytest -m "not integration and not gpu"

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports

setup: $(VENV)/.installed criu control-plane images addons

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

criu:
	hack/criu-setup

# The control plane, and the real node's kubelet, kube-proxy, pause image and Debian packages.
control-plane:
	hack/control-plane build

# The chart's images from the Dockerfile (BuildKit, no registry), for the real node.
images: $(VENV)/.installed control-plane
	hack/control-plane images

# KEDA (operator, metrics apiserver) and its HTTP add-on from their Go modules, as images for the real node.
addons: $(VENV)/.installed control-plane
	hack/control-plane addons

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
