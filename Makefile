# blockshard: `make demo` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench docs-bench clean

# torch first, as exactly the CPU wheel (a looser spec pulls a multi-GB CUDA build), then the
# project with every extra under the tested pins in constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[all,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/blockshard demo

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_quality.py --out docs/results/plan_quality.json --markdown docs/results/plan_quality.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
