# The two commands: `make demo` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit integration bench bench-e2e bench-cli gpu-check clean

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

# How long `tandem` commands take from exec to exit (docs/benchmarks.md, "CLI start-up").
bench-cli: $(STAMP)
	$(BIN)/python -m bench.cli_startup

gpu-check: $(STAMP)
	$(BIN)/tandem gpu-check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
