# Two commands do all the set-up on a fresh machine: `make test` and `make demo`. Both create (or reuse)
# .venv with Python 3.11 and install the pinned stack from constraints.txt (the one pin file).
PYTHON ?= python3.11
VENV ?= .venv
EXTRAS ?= all,test
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),_,$(EXTRAS))
export PIP_DISABLE_PIP_VERSION_CHECK := 1
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
# pip warns about every local index directory that lacks a package: keep the log readable
QUIET_PIP := sed -u "/^WARNING: Location/d"

.PHONY: install test demo clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first (from local disk; the resolver would otherwise consider other builds), then the package.
$(STAMP): $(PY) pyproject.toml constraints.txt
	@echo ">> installing torch, torchvision and the build tools (pins: constraints.txt)"
	$(PIP) install -q -c constraints.txt torch torchvision setuptools wheel 2>&1 | $(QUIET_PIP)
	$(PY) -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
	@echo ">> installing pid-plugins[$(EXTRAS)] (editable)"
	$(PIP) install -q -c constraints.txt --no-build-isolation -e ".[$(EXTRAS)]" 2>&1 | $(QUIET_PIP)
	$(PIP) check
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/pid-plugins demo --out demo_out

clean-venv:
	rm -rf $(VENV)
