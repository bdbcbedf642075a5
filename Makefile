# twell developer tasks. Everything runs inside .venv, built from scratch by `make venv`.
#
#   make venv   .venv with torch (CPU build by default, installed first), twell[test]
#               (editable), ruff
#   make test   ruff check, then pytest
#   make lint   ruff check + ruff format --check
#   make demo   python -m twell demo: the kernels where nvidia-smi lists a GPU (CuPy added
#               to .venv first, see DEMO_EXTRA), else the NumPy reference, saying why
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

# make demo runs the kernels where nvidia-smi lists a GPU: .venv gets CuPy first unless it
# imports one already. DEMO_EXTRA=auto (default): the CuPy of $(PYTHON) when that
# interpreter has one (linked into .venv by a .pth file), else the [cuda13] or [cuda12]
# extra, by the driver's CUDA version. DEMO_EXTRA=cuda13,torch (an extra list): install
# those (torch with CUDA also times the dense block). DEMO_EXTRA=none: install nothing.
# Without a GPU, or when CuPy cannot be had, the demo runs the NumPy reference and says why.
DEMO_EXTRA ?= auto

demo: $(CORE_STAMP)
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
	  extra='$(DEMO_EXTRA)'; \
	  if [ "$$extra" = none ] || { [ "$$extra" = auto ] && $(PY) -c 'import cupy' 2>/dev/null; }; then \
	    extra=; \
	  elif [ "$$extra" = auto ]; then \
	    found=$$($(PYTHON) -c 'import cupy, os; print(os.path.dirname(os.path.dirname(cupy.__file__)))' 2>/dev/null); \
	    site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	    if [ -n "$$found" ] && [ "$$found" != "$$site" ]; then \
	      echo "make demo: a GPU is listed; $(VENV) uses the CuPy of $(PYTHON) ($$found)"; \
	      echo "$$found" > "$$site/_twell_demo_cupy.pth"; \
	      extra=; \
	    else \
	      cuda=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' | head -n 1); \
	      case "$${cuda:-0}" in 1[3-9]|[2-9][0-9]) extra=cuda13;; 12) extra=cuda12;; \
	        *) extra=; echo "make demo: the driver's CUDA version ($${cuda:-unknown}) has no CuPy wheel of twell's extras";; esac; \
	    fi; \
	  fi; \
	  if [ -n "$$extra" ]; then \
	    echo "make demo: a GPU is listed; installing the kernels' runtime: pip install -e '.[$$extra]'"; \
	    $(PIP) install -e ".[$$extra]" || echo "make demo: pip install -e '.[$$extra]' failed"; \
	  fi; \
	fi
	$(PY) -m twell demo

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
