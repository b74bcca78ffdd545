# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment (.venv) when it is missing.

PYTHON ?= python3
# The torch CI tests against. GPU users: PyPI's Linux wheels of this version are CUDA builds;
# pass TORCH=torch (or any spec) to choose another.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,plot,hf,wandb,mlflow,trackers]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/stabilizer demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two workers (pytest-xdist) of one torch thread each: the suite in two thirds of the time on two
# cores, and the same arithmetic on every machine; the tests of the trained scenarios share one
# worker, which trains each scenario once.
test: lint
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -n 2 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
