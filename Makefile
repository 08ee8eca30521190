# zloader: two commands do all the set-up (see README.md).
#   make demo   create .venv, install zloader, run the demo job
#   make test   create .venv, install with the test extras, run lint, type check and the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
PIP_FLAGS := --disable-pip-version-check --quiet -c constraints-dev.txt

.PHONY: demo test test-slow lint bench soak sweep clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Installs again only when the package definition, the pins or the compiled core's source
# change (the install builds zloader/_core.pyx in place: zloader/_native.py).
BUILD := setup.cfg setup.py pyproject.toml constraints-dev.txt zloader/_core.pyx
$(VENV)/.installed-demo: $(BIN)/python $(BUILD)
	$(PIP) install $(PIP_FLAGS) -e .
	touch $@

# The test extras with Ray: `make test` runs a multi-node Ray test (tests/test_ray_cluster.py).
$(VENV)/.installed-test: $(BIN)/python $(BUILD)
	$(PIP) install $(PIP_FLAGS) -e '.[test,torch,tf,ray]'
	touch $@ $(VENV)/.installed-demo

$(VENV)/.installed-bench: $(BIN)/python $(BUILD)
	$(PIP) install $(PIP_FLAGS) -e '.[test,torch,tf,bench]'
	touch $@

demo: $(VENV)/.installed-demo
	$(BIN)/zloader demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check zloader tests bench
	$(BIN)/mypy

# Two test processes (pytest-xdist): the suite waits on its processes and sockets as much as
# it computes, so two share these two cores well. Each test still checks its own leaks.
# The suite with the compiled core, then the record path's tests with its pure-Python twins.
PURE_TESTS := tests/test_native.py tests/test_stages.py tests/test_chunks.py \
	tests/test_record_path.py tests/test_exactly_once.py tests/test_lineage.py \
	tests/test_lineage_arrays.py tests/test_generated.py tests/test_ring_credits.py
test: lint
	$(BIN)/python -m pytest -m "not slow" -q -n 2
	ZLOADER_PURE=1 $(BIN)/python -m pytest -m "not slow" -q -n 2 $(PURE_TESTS)

test-slow: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m slow -q

bench: $(VENV)/.installed-bench
	$(BIN)/python -m bench  # the list: bench/README.md (bench/catalog.py)

# Ten minutes of 32 consumers over 8 jobs while workers are killed (bench/soak.py).
soak: $(VENV)/.installed-bench
	$(BIN)/python -m bench.soak --minutes 10

# Generated cases over new seeds, two at a time beside a busy CPU (tests/sweep.py): races
# that one seed per mode in `make test` shows only as a rare flake. SEEDS=FIRST:END.
SEEDS ?= 1000:1020
sweep: $(VENV)/.installed-test
	$(BIN)/python -m tests.sweep --seeds $(SEEDS) --torch $(SEEDS)

clean:
	rm -rf $(VENV) build *.egg-info zloader.egg-info .pytest_cache .mypy_cache .ruff_cache
