# blockshard: `make demo` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# mypy cannot follow setuptools' package-dir mapping (integrations/ is blockshard.integrations):
# pyproject's [tool.mypy] mypy_path finds it through this link.
MYPY_LINK := $(VENV)/mypy-path/blockshard/integrations

.PHONY: demo lint mypy test test-fast bench docs-bench clean

# torch first, as exactly the CPU wheel (a looser spec pulls a multi-GB CUDA build), then the
# project with every extra under the tested pins in constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[all,dev]"
	touch $(STAMP)

$(MYPY_LINK): | $(STAMP)
	mkdir -p $(dir $@)
	ln -sfn ../../../integrations $@

demo: $(STAMP)
	$(BIN)/blockshard demo

# The gates: lint, format and types (the pre-commit hooks run the same tools).
lint: $(STAMP) $(MYPY_LINK)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

mypy: $(MYPY_LINK)
	$(BIN)/mypy

# The gates, then every in-process test (the fast tier and the `heavy` cases), then the slow
# (process-spawning) tier. pytest exits 5 when a marker selects no test; that is not a failure here.
# In-process tests run on 2 xdist workers; the slow tier prints its 40 slowest tests (where the
# suite's time goes). `make test-fast` leaves out the heavy cases too (its one-minute budget).
test: lint
	$(BIN)/python -m pytest -m "not slow" -n 2 || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m slow --durations=40 || [ $$? -eq 5 ]

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not heavy" -n 2

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_quality.py --out docs/results/plan_quality.json --markdown docs/results/plan_quality.md

# Rerun every benchmark behind docs/results/*.json, each with the command its JSON records
# (minutes, and the timings want an otherwise idle machine).
docs-bench: bench
	$(BIN)/python benchmarks/engine_vs_fsdp2.py --world-size 4 --json --out docs/results/engine_vs_fsdp2.json
	$(BIN)/python benchmarks/muon_step.py --world-size 4 --json --out docs/results/muon_step.json
	$(BIN)/python benchmarks/deepspeed_hook.py --world-size 2 4 --json --out docs/results/deepspeed_hook.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache *.egg-info
