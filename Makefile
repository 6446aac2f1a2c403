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

# The venvs are installed without byte-compiling (pip --no-compile: minutes less on
# 2 cores); Python caches the bytecode of what is imported, the first time. Where the
# environment sets PYTHONDONTWRITEBYTECODE, every process would compile torch, vLLM
# and transformers from source again (twice their import time), so make unsets it.
unexport PYTHONDONTWRITEBYTECODE

# liburing 2024's package keeps its own import cache (dynamic_import's
# __pycache__/__init__.importer-311.pyc) and deletes and rewrites it whenever the
# package directory's mtime changed, which the first import's __pycache__/ does. Test
# processes importing it for the first time at once then race on that file
# (FileNotFoundError in a kill -9 child, seen once in a fresh clone's CI). Two imports
# in a row, right after installing, leave a cache that stays valid.
WARM_LIBURING = $(BIN)/python -c "import liburing" >/dev/null 2>&1; $(BIN)/python -c "import liburing" >/dev/null 2>&1 || true

.PHONY: run test lint typecheck promtool mooncake-libs unit crash unit-and-crash engines test-bindings integ bench bench-full torture clean

# The io_uring binding (liburing 2024.5.3) is built from its sdist: it needs a C
# compiler and the Python headers. tools/check_toolchain.sh says so, and how to get
# them, before pip fails in the middle of a build.
$(BIN)/.installed: pyproject.toml tools/check_toolchain.sh
	PYTHON=$(PYTHON) tools/check_toolchain.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "installing kvstore: building the io_uring binding (liburing 2024.5.3) from source:"
	@echo "  about 2-3 minutes on 2 cores, quiet until done (pip caches it for later installs)"
	$(BIN)/pip install -q --no-compile -e .
	$(BIN)/python -m kvstore.io.probe || true
	$(WARM_LIBURING)
	touch $@

# The cluster extra: Mooncake Store's client and master (the remote tier's tests, CI).
$(BIN)/.dev-installed: $(BIN)/.installed pyproject.toml
	$(BIN)/pip install -q --no-compile -e '.[dev,cluster]'
	$(BIN)/pip install -q --no-compile $(TORCH)
	$(WARM_LIBURING)
	touch $@

# The other supported binding, the liburing 2026 Zig wheel, kept out of the venv's
# site-packages (both are the module `liburing`): `make test-bindings` puts it first
# on PYTHONPATH and forces it with KVSTORE_URING_BINDING.
BINDING_2026 := $(VENV)/bindings/liburing-2026
$(BINDING_2026)/.installed: $(BIN)/.installed
	$(BIN)/pip install -q --no-compile --no-deps --target $(BINDING_2026) liburing==2026.3.30
	touch $@

run: $(BIN)/.installed
	$(BIN)/kvstore demo --path $(DEMO_DIR)

lint: $(BIN)/.dev-installed
	$(BIN)/ruff check kvstore tests tools benches
	$(BIN)/ruff format --check kvstore tests tools benches

typecheck: $(BIN)/.dev-installed
	$(BIN)/mypy

# Two pytest workers (pytest-xdist): the suites are crash loops and subprocesses
# that leave a core idle half the time. PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

# promtool (Debian's `prometheus` package) checks the alert rules and both exporters'
# output (tests/unit/telemetry/test_promtool.py). Installed where missing: as root, with
# apt (about 15 s with `apt-get update`); without apt those tests skip and say why.
# Kept out of `make run`.
promtool:
	@command -v promtool >/dev/null || ! command -v apt-get >/dev/null || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends prometheus; }

# Mooncake's client (the cluster extra) links libibverbs.so.1 (Debian's `libibverbs1`)
# even over TCP: without it `import mooncake.store` fails and the remote tier's
# Mooncake tests skip. Installed where missing, as promtool is.
mooncake-libs:
	@/sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || ! command -v apt-get >/dev/null || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends libibverbs1; }

# Suites by marker (tests/conftest.py marks each by its folder).
unit: $(BIN)/.dev-installed promtool mooncake-libs
	$(BIN)/pytest -q -x --timeout=600 $(XDIST) -m unit

# Crash loops, power loss, EIO and the property machines, on io_uring where the probe
# passes (`engines` runs them again on the fallback engine).
crash: $(BIN)/.dev-installed
	$(BIN)/pytest -q -x --timeout=600 $(XDIST) -m crash

# Both in one session for `make test`: the workers share out the long crash loops
# with the unit tests (two sessions take about a minute longer on 2 cores).
unit-and-crash: $(BIN)/.dev-installed promtool mooncake-libs
	$(BIN)/pytest -q -x --timeout=600 $(XDIST) -m "unit or crash"

# The crash, power-loss, EIO and property suites once more on the fallback engine
# (`crash` ran them on io_uring, the default where the probe passes).
ENGINE_SUITES := tests/crash tests/property tests/reliability/test_powerloss.py \
	tests/reliability/test_io_errors.py tests/reliability/test_torn_writes.py \
	tests/reliability/test_faults.py
# The tier manager's crash and property suites run once, in `crash`: what they torture
# is the manager above the store, and the store's own suites cover each engine here.
ENGINE_SKIP := --ignore=tests/crash/test_kill9_tiering.py \
	--ignore=tests/property/test_tiering_stateful.py
engines: $(BIN)/.dev-installed
	KVSTORE_IO_ENGINE=threadpool $(BIN)/pytest -q -x --timeout=600 $(XDIST) $(ENGINE_SKIP) $(ENGINE_SUITES)

# The engine tests once per supported binding, each forced by KVSTORE_URING_BINDING.
# Where a binding cannot run (the 2026 wheel on a CPU without AVX-512), its probe
# must say why and every store must fall back; the io_uring cases then skip.
BINDING_SUITES := tests/unit/io/test_io.py tests/unit/log/test_single_read.py \
	tests/unit/io/test_uring_probe.py tests/unit/test_store.py
test-bindings: $(BIN)/.dev-installed $(BINDING_2026)/.installed
	KVSTORE_URING_BINDING=liburing-2024 $(BIN)/pytest -q -x --timeout=600 $(BINDING_SUITES)
	PYTHONPATH=$(BINDING_2026) KVSTORE_URING_BINDING=liburing-2026 \
		$(BIN)/pytest -q -x --timeout=600 -rs $(BINDING_SUITES)

integ: mooncake-libs
	PYTHON=$(PYTHON) VENV_INTEG=$(VENV_INTEG) TORCH=$(TORCH) tools/setup_integ_env.sh
	$(VENV_INTEG)/bin/pytest -q -x --timeout=600 $(XDIST) tests/integrations

test: lint typecheck unit-and-crash engines test-bindings integ

bench: $(BIN)/.dev-installed
	$(BIN)/pytest benches --benchmark-only -q
	$(BIN)/python -m kvstore.bench --dir ./bench-data --compare --out ./bench-data/bench.json

bench-full: $(BIN)/.dev-installed
	$(BIN)/python -m kvstore.bench --dir ./bench-data --compare --scaling --plots docs/img --out docs/img/bench-run.json

torture: $(BIN)/.dev-installed
	$(BIN)/python tools/crashloop.py --dir ./torture-data --cycles 200 --capacity-mib 64 --retain
	$(BIN)/python tools/crashloop.py --dir ./torture-data/threads --cycles 200 --threads 4 \
		--flush-interval-ms 1 --retain --busy-threads 1

clean:
	rm -rf $(VENV) $(VENV_INTEG) $(DEMO_DIR) ./bench-data ./torture-data
