# Transformers from the Ground Up: the commands (see README.md).
#   make book   build the book's HTML from the stored notebook outputs (offline)
#   make test   ruff, unit tests, every notebook under nbval, the book build and its browser checks
#   make lab    JupyterLab on notebooks/          make bench   the performance figures
# Every target sets up .venv first (idempotent): torch==2.13.0, then requirements.lock, then groundup.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.groundup-installed
BUILD  := _build
NBVAL_TIMEOUT ?= 600
export PYTHONHASHSEED := 0
# Data files the tests and benchmarks may read (never committed); used only when the folder exists.
SHARED_DATA := $(abspath ../shared/data)
ifneq ($(wildcard $(SHARED_DATA)/tinyshakespeare.txt),)
export GROUNDUP_DATA_DIR ?= $(SHARED_DATA)
endif

.PHONY: setup data book test lint unit notebooks book-check bench bench-quality lab clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (groundup)" >/dev/null
	@touch $@

data: setup
	$(PY) -m groundup.data shakespeare gpt2.tiktoken

book: setup
	$(PY) tools/build_book.py

lint: setup
	$(PY) -m ruff check .

unit: setup
	$(PY) -m pytest tests --ignore=tests/book -q

# Two lanes of notebooks at a time, one per core (see tools/nbval_lanes.py); NBVAL_LANES=1: one after another.
NBVAL_LANES ?= 2

notebooks: data
	$(PY) tools/nbval_lanes.py --lanes $(NBVAL_LANES) -- --nbval --nbval-current-env \
		--nbval-sanitize-with sanitize.cfg --nbval-cell-timeout=$(NBVAL_TIMEOUT) --durations=15 -p no:cacheprovider

book-check: book
	$(PY) -m pytest tests/book -q -rs

test: lint unit notebooks book-check

bench: setup
	$(PY) -m groundup.bench

bench-quality: setup   # minutes: the CPU recipe's validation loss within 1.0 M tokens and within 10 minutes
	$(PY) -m groundup.bench quality

lab: setup
	$(VENV)/bin/jupyter lab --allow-root --notebook-dir=notebooks

clean:
	rm -rf $(BUILD) .pytest_cache .ruff_cache
