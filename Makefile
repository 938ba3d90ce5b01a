# The two commands: `make demo` and `make test`. Both bootstrap .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit integration bench gpu-check clean

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

gpu-check: $(STAMP)
	$(BIN)/tandem gpu-check

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
