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

# The pinned vLLM for the contract test (tests/engines/test_vllm_contract.py): its wheel and the few packages
# its modules import that the dev environment lacks, without its GPU-only needs, beside the venv in a
# directory named by the requirements' digest (a new pin is a new directory; pip's cache serves a rebuild).
VLLM_CONTRACT_REQS := tests/engines/vllm_contract_requirements.txt
VLLM_CONTRACT_DIR := $(WARMSTART_CACHE)/vllm-contract
VLLM_SITE := $(VLLM_CONTRACT_DIR)/$(shell sha256sum $(VLLM_CONTRACT_REQS) | cut -c1-16)

.PHONY: demo test check docs crds setup criu control-plane images addons vllm-contract lint clean

# CRIU's command line resolved once (hack/criu resolves it again at every call: two shell scripts, about 30 ms
# a call on 2 cores, and a restore makes two).
demo: $(VENV)/.installed criu
	$(BIN)/warmstart serve --engine builtin --model demo --device cpu --store $(STORE) --port $(PORT) \
		--criu "$$(hack/criu-setup --print)"

# Every test's duration goes to $(TEST_REPORT) (JUnit XML) and the slowest are printed at the end.
TEST_REPORT ?= $(WARMSTART_CACHE)/test-report.xml

test: $(VENV)/.installed docs criu control-plane images addons vllm-contract
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest --durations=30 --junit-xml=$(TEST_REPORT)

# The tier to live in while changing code: lint and every test that starts no process, needs no cluster,
# CRIU or GPU (about 2.5 minutes on 2 cores); `make test` runs the rest too.
check: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest -m "not spawns and not integration and not gpu" --durations=10

# The documentation site (mkdocs.yml, docs/): the generated reference pages must be current, and the strict
# build fails on any warning, broken link or link to a missing anchor. Output in site/.
docs: $(VENV)/.installed
	$(BIN)/python hack/crd_reference.py --check
	$(BIN)/python hack/cli_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # not --quiet: it hides the warnings strict counts

# The CRDs (crds/ and the chart's copies) from the models in warmstart/api/, then the reference page made
# from them; tests/api/test_crds_generated.py fails when either is stale.
crds: $(VENV)/.installed
	$(BIN)/python hack/generate_crds.py
	$(BIN)/python hack/crd_reference.py

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports

setup: $(VENV)/.installed criu control-plane images addons vllm-contract

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

criu:
	hack/criu-setup

vllm-contract: $(VLLM_SITE)/.installed

$(VLLM_SITE)/.installed: | $(VENV)/.installed
	rm -rf $(VLLM_SITE).partial
	$(BIN)/pip install -q --no-deps --no-compile --only-binary=:all: --target $(VLLM_SITE).partial \
		-r $(VLLM_CONTRACT_REQS)
	touch $(VLLM_SITE).partial/.installed
	find $(VLLM_CONTRACT_DIR) -mindepth 1 -maxdepth 1 ! -name '$(notdir $(VLLM_SITE)).partial' -exec rm -rf {} +
	mv $(VLLM_SITE).partial $(VLLM_SITE)

# The control plane, and the real node's kubelet, kube-proxy, pause image and Debian packages.
control-plane:
	hack/control-plane build

# The chart's images from the Dockerfile (BuildKit, no registry), for the real node.
images: $(VENV)/.installed control-plane
	hack/control-plane images

# KEDA (operator, metrics apiserver), its HTTP add-on, Prometheus, prometheus-operator and prometheus-adapter from
# their Go modules, as images for the real node.
addons: $(VENV)/.installed control-plane
	hack/control-plane addons

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
