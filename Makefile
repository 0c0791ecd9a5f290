# The two commands: `make run` (quickstart workflow) and `make test` (whole suite).
# Each creates .venv when missing or stale (pyproject.toml changed) and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch: a bare `torch` requirement would pull a multi-gigabyte CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: run test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_CPU)"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "$(TORCH_CPU)"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/orthosphere run workflows/configs/quickstart.toml

# The suite in parallel over the cores (at most 4 processes; each test file's fixtures are built per process).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
