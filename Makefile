# Transformers from the Ground Up: the commands (see README.md).
#   make book   build the book's HTML from the stored notebook outputs (offline)
#   make test   ruff, unit tests and every notebook under nbval (two lanes), the book build and its browser checks
#   make lab    JupyterLab on notebooks/          make bench   the performance figures
# Every target sets up .venv first (idempotent): torch==2.13.0, then requirements.lock, then groundup.
#   make setup PYTHON=python3.12             the interpreter .venv is made from (Python 3.11.5 or newer)
#   make setup TORCH_INDEX=                  torch from the package index alone (on Linux: the CUDA build)
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128   a CUDA build from PyTorch's own index
# (to change the torch build of an existing .venv, remove .venv first)

PYTHON ?= python3
PYTHON_MIN := 3.11.5
# PyTorch's index of CPU-only wheels, searched besides the package index for torch (whose Linux wheel there is
# the CUDA build, gigabytes). --retries 0: where that index cannot be reached, pip warns once per page and goes
# on with the package index instead of retrying each page five times.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.groundup-installed
BUILD  := _build
# nbval's limit per cell, a hang guard: chapter 7's training cell takes ~7 min on a healthy 2-core machine.
NBVAL_TIMEOUT ?= 1800
export PYTHONHASHSEED := 0
# Data files the tests and benchmarks may read (never committed); used only when the folder exists.
SHARED_DATA := $(abspath ../shared/data)
ifneq ($(wildcard $(SHARED_DATA)/tinyshakespeare.txt),)
export GROUNDUP_DATA_DIR ?= $(SHARED_DATA)
endif

.PHONY: setup python-version data book test lint unit notebooks notebooks-other-sqrt checks book-check bench bench-quality lab clean

setup: $(STAMP)

# The interpreter .venv is (or will be) made from must be Python $(PYTHON_MIN)+: checked before anything is installed.
python-version:
	@py=$(PY); test -x $$py || py=$(PYTHON); \
	if ! $$py -c 'import sys; sys.exit(sys.version_info[:3] < tuple(map(int, "$(PYTHON_MIN)".split("."))))' \
	  2>/dev/null; then \
	  version=$$($$py -V 2>&1) || version="not found"; \
	  echo "error: the book needs Python $(PYTHON_MIN) or newer (the versions in requirements.lock do)," \
	    "but $$py is $$version. Run, e.g.: make setup PYTHON=python3.12" \
	    "(after rm -rf $(VENV) if $(VENV) was made by the older Python)." >&2; exit 1; fi

$(STAMP): requirements.lock pyproject.toml | python-version
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check \
		$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 0) torch==2.13.0
	@$(PY) -c 'import torch; print("torch", torch.__version__, f"(CUDA {torch.version.cuda})" if torch.version.cuda else "(CPU only)")'
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (groundup)" >/dev/null
	@touch $@

data: setup
	$(PY) -m groundup.data shakespeare gpt2.tiktoken smollm2

book: setup
	$(PY) tools/build_book.py

lint: setup
	$(PY) -m ruff check .

# The unit tests in two processes (pytest-xdist), one per core of a small machine; UNIT_WORKERS=0: one process.
UNIT_WORKERS ?= 2

unit: setup
	$(PY) -m pytest tests --ignore=tests/book -q -n $(UNIT_WORKERS)

# Two lanes of notebooks at a time, one per core (see tools/nbval_lanes.py); NBVAL_LANES=1: one after another.
NBVAL_LANES ?= 2

NBVAL_ARGS = --nbval --nbval-current-env --nbval-sanitize-with sanitize.cfg --nbval-cell-timeout=$(NBVAL_TIMEOUT) \
	--durations=15 -p no:cacheprovider

notebooks: data
	$(PY) tools/nbval_lanes.py --lanes $(NBVAL_LANES) -- $(NBVAL_ARGS)

# The notebooks with a stand-in for another CPU maker's float32 square root (tools/other_sqrt/sitecustomize.py): the
# stored outputs must hold, or they depend on a last bit that MKL's RSQRTPS-based sqrt leaves to the CPU's maker.
notebooks-other-sqrt: data
	GROUNDUP_OTHER_SQRT=1 PYTHONPATH=$(CURDIR)/tools/other_sqrt $(PY) tools/nbval_lanes.py --lanes $(NBVAL_LANES) -- \
		$(NBVAL_ARGS)

book-check: book
	$(PY) -m pytest tests/book -q -rs

# The unit tests and every notebook in one two-lane run (tools/nbval_lanes.py): on a fresh machine chapter 7's model
# trains on one core while the unit tests run on the other, then both cores share the notebooks.
checks: data
	$(PY) tools/nbval_lanes.py --lanes $(NBVAL_LANES) --unit "tests --ignore=tests/book -q" -- $(NBVAL_ARGS)

test: lint checks book-check

bench: setup
	$(PY) -m groundup.bench

bench-quality: setup   # minutes: the CPU recipe's validation loss within 1.0 M tokens and within 10 minutes
	$(PY) -m groundup.bench quality

lab: setup
	$(VENV)/bin/jupyter lab --allow-root --notebook-dir=notebooks

clean:
	rm -rf $(BUILD) .pytest_cache .ruff_cache
