# twell developer tasks. Everything runs inside .venv, built from scratch by `make venv`.
#
#   make venv   .venv with torch (CPU build by default, installed first), twell[test]
#               (editable), ruff
#   make test   ruff check, then pytest
#   make lint   ruff check + ruff format --check
#   make demo   python -m twell demo (needs only the core dependencies)
#   make clean  remove .venv, caches and build outputs

PYTHON ?= python3
VENV ?= .venv
# torch, for the tests that compare against autograd, goes in before anything else so that
# nothing pulls another build. By default the CPU build: PyPI's Linux wheels bundle CUDA
# (gigabytes), so pip also looks at PyTorch's CPU index, whose `+cpu` builds sort above
# PyPI's. Where that index has no such build (macOS: PyPI's wheel is the CPU one) or
# cannot be reached (an offline machine with a local wheel in pip's find-links), pip
# takes what the other indexes offer. Override any of these:
#   make venv TORCH_INDEX=                                         # the default indexes only
#   make venv TORCH_INDEX=https://download.pytorch.org/whl/cu128   # a CUDA build
#   make venv TORCH_VERSION=2.12.0   or   TORCH='torch>=2.4'
TORCH_VERSION ?= 2.13.0
TORCH ?= torch==$(TORCH_VERSION)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CORE_STAMP := $(VENV)/.stamp-core
TEST_STAMP := $(VENV)/.stamp-test
LINT_DIRS := $(wildcard twell tests bench)

.PHONY: venv test lint demo clean

venv: $(TEST_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Core dependencies only (enough for the demo and the NumPy reference).
$(CORE_STAMP): pyproject.toml | $(PY)
	$(PIP) install -e .
	touch $@

# Everything the test suite needs. torch goes in first, then twell[test], then ruff.
$(TEST_STAMP): pyproject.toml | $(PY)
	$(PIP) install --retries 1 --timeout 10 $(if $(strip $(TORCH_INDEX)),--extra-index-url "$(TORCH_INDEX)") "$(TORCH)"
	$(PIP) install -e '.[test]'
	$(PIP) install ruff
	touch $(CORE_STAMP) $@

test: $(TEST_STAMP)
	$(if $(LINT_DIRS),$(VENV)/bin/ruff check $(LINT_DIRS))
	@$(PY) -m pytest -q $(PYTEST_ARGS) || { rc=$$?; echo "pytest exited with code $$rc"; exit $$rc; }

lint: $(TEST_STAMP)
	$(if $(LINT_DIRS),$(VENV)/bin/ruff check $(LINT_DIRS))
	$(if $(LINT_DIRS),$(VENV)/bin/ruff format --check $(LINT_DIRS))

demo: $(CORE_STAMP)
	$(PY) -m twell demo

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
