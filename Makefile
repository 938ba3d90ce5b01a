# The two commands: `make demo` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit integration bench bench-e2e soak gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tandem demo

lint: $(STAMP)
	$(BIN)/ruff check schemas services tests bench
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python -m bench.run

# The running system end to end (docs/benchmarks.md, "Running system (end to end)"):
# nats-server, inventory, allocator and a simulated fleet as processes; one JSON line.
BENCH_E2E_ARGS ?= --nodes 1000 --requests 5000
bench-e2e: $(STAMP)
	$(BIN)/tandem loadtest $(BENCH_E2E_ARGS)

# The chaos suite for long (docs/reliability.md): a 3-server NATS cluster, inventory, two
# allocators and a simulated fleet as processes; one SIGKILL a round under load, invariants
# read from KV after each round; one JSON line. `make test` runs 4 rounds of the same.
SOAK_DURATION ?= 1800
SOAK_SEED ?= 1
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/tandem chaos --duration $(SOAK_DURATION) --seed $(SOAK_SEED) $(SOAK_ARGS)

gpu-check: $(STAMP)
	$(BIN)/tandem gpu-check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
