# Two entry points that work on a fresh machine with Python 3.11 and make:
#   make run   -> .venv with the package, then `kvstore demo` on a default store
#   make test  -> .venv with dev deps, then ruff, mypy and pytest
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch is pinned to the CPU build that ships on these machines; a bare `torch`
# requirement would pull several GB of CUDA wheels.
TORCH  ?= torch==2.13.0
DEMO_DIR ?= ./kvstore-demo
# The engine adapters are tested in their own venv (vLLM, LMCache, transformers;
# CPU only), kept apart from the core install: tools/setup_integ_env.sh.
VENV_INTEG ?= .venv-integ

.PHONY: run test lint typecheck unit integ bench bench-full torture clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.dev-installed: $(BIN)/.installed pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q $(TORCH)
	touch $@

run: $(BIN)/.installed
	$(BIN)/kvstore demo --path $(DEMO_DIR)

lint: $(BIN)/.dev-installed
	$(BIN)/ruff check kvstore tests tools benches
	$(BIN)/ruff format --check kvstore tests tools benches

typecheck: $(BIN)/.dev-installed
	$(BIN)/mypy

unit: $(BIN)/.dev-installed
	$(BIN)/pytest -q -x --timeout=600

integ:
	PYTHON=$(PYTHON) VENV_INTEG=$(VENV_INTEG) TORCH=$(TORCH) tools/setup_integ_env.sh
	$(VENV_INTEG)/bin/pytest -q -x --timeout=600 tests/integrations

test: lint typecheck unit integ

bench: $(BIN)/.dev-installed
	$(BIN)/pytest benches --benchmark-only -q
	$(BIN)/python -m kvstore.bench --dir ./bench-data --compare --out ./bench-data/bench.json

bench-full: $(BIN)/.dev-installed
	$(BIN)/python -m kvstore.bench --dir ./bench-data --compare --scaling --plots docs/img --out docs/img/bench-run.json

torture: $(BIN)/.dev-installed
	$(BIN)/python tools/crashloop.py --dir ./torture-data --cycles 200 --capacity-mib 64 --retain

clean:
	rm -rf $(VENV) $(VENV_INTEG) $(DEMO_DIR) ./bench-data ./torture-data
