# blockshard: `make demo` and `make test` do all set-up on a fresh machine with Python 3.11.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo lint mypy test test-fast test-extended test-torch-next bench docs-bench clean

# torch first, as exactly the CPU wheel (a looser spec pulls a multi-GB CUDA build), then the
# project with every extra under the tested pins in constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[all,dev]"
	touch $(STAMP)

# The next torch release the suite must pass on (pyproject declares torch>=2.13,<2.15), in a second
# venv: torch first (there is no CPU wheel of 2.14.1: pip brings the CUDA build, about 6 GB, and it
# runs on CPU), then the project under constraints.txt with only the torch pin replaced (deepspeed's
# sdist builds without torch, in pip's isolated build env, so the same wheel serves both releases).
# The stamp names the release, so moving TORCH_NEXT reinstalls.
TORCH_NEXT := 2.14.1
VENV_NEXT := .venv-torch-2.14
BIN_NEXT := $(VENV_NEXT)/bin
STAMP_NEXT := $(VENV_NEXT)/.installed-$(TORCH_NEXT)

$(STAMP_NEXT): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV_NEXT)
	sed 's/^torch==.*/torch==$(TORCH_NEXT)/' constraints.txt > $(VENV_NEXT)/constraints.txt
	$(BIN_NEXT)/python -m pip install -q --disable-pip-version-check torch==$(TORCH_NEXT)
	$(BIN_NEXT)/python -m pip install -q --disable-pip-version-check -c $(VENV_NEXT)/constraints.txt -e ".[all,dev]"
	$(BIN_NEXT)/python -c 'import torch; assert torch.__version__.split("+")[0] == "$(TORCH_NEXT)", torch.__version__'
	touch $(STAMP_NEXT)

demo: $(STAMP)
	$(BIN)/blockshard demo

# The gates: lint, format and types (the pre-commit hooks run the same tools). mypy takes what it
# checks from pyproject's [tool.mypy]: plain `.venv/bin/mypy` runs the same check.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

mypy: $(STAMP)
	$(BIN)/mypy

# The gates, then every in-process test (the fast tier and the `heavy` cases), then the slow
# (process-spawning) tier. pytest exits 5 when a marker selects no test; that is not a failure here.
# Both run on 2 xdist workers; the slow tier hands out whole files (`--dist loadfile`: a file's
# module fixtures, such as one spawn per world size, run once) and prints its 40 slowest tests
# (where the suite's time goes). On 2 cores this took the slow tier from 22.4 to 18.3 minutes
# (the spawned ranks leave a core idle while they start, rendezvous and gather). Spawned ranks
# rendezvous through a FileStore of their own and launchers on free ports, so two files at once do
# not collide. `make test-fast` leaves out the heavy cases too (its one-minute budget). The slow
# cases marked `extended` (a second world size or launcher of a check that stays here; the list and
# why: [Note: the extended slow cases] in tests/conftest.py) run in `make test-extended`.
test: lint
	$(BIN)/python -m pytest -m "not slow" -n 2 || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m "slow and not extended" -n 2 --dist loadfile --durations=40 || [ $$? -eq 5 ]

test-extended: $(STAMP)
	$(BIN)/python -m pytest -m extended -n 2 --dist loadfile || [ $$? -eq 5 ]

# PYTHONDONTWRITEBYTECODE (set on some machines) would make pytest rewrite every test module's
# asserts again in each run and worker (about 5 s of the budget): its cached rewrites are kept.
# BLOCKSHARD_TEST_TIER=fast: hypothesis properties draw a fifth of their examples (tests/_tier.py).
test-fast: $(STAMP)
	BLOCKSHARD_TEST_TIER=fast PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m "not slow and not heavy" -n 2

# The slow tests that also run on the next torch (`make test-torch-next`; the fast tier runs whole).
# Why these: they go through torch's own code, which changes between releases, where the rest of the
# slow tier runs blockshard's engine over plain gloo collectives (`make test` runs it on the pinned
# torch). Chosen by grepping tests/ for clip_grad_norm_, register_fsdp_forward_method, torch.compile,
# torch.distributed.fsdp (stock FSDP2 as the control) and torch.distributed.checkpoint (DCP, its
# state_dict helpers, save_checkpoint); then the Hugging Face integrations built on them, with
# DeepSpeed through Accelerate's engine cases (its sdist is built once, without torch, and must run
# on either release; tests/integrations/test_deepspeed.py drives the same engines); and the
# gradient views, which hook autograd's AccumulateGrad nodes (torch.autograd.graph); and tensor
# parallelism (DTensor and torch's parallel styles, stock FSDP2 + TP the reference); and torch's
# pipelining schedules, which reach into fully_shard.state. Left to the pinned torch for the
# time budget of `.ci/run`: blockshard's own optimizer-state resharding (test_optim_checkpoints:
# blockshard's reader over DCP, which test_torch_state_dicts and test_checkpoints cover), the
# Trainer over DeepSpeed and the Muon forms through Accelerate (the Trainer and Accelerate paths
# run here through test_trainer_ragged and test_accelerate).
TORCH_NEXT_SLOW_TESTS := \
	tests/runtime/test_clip.py tests/runtime/test_fast_clip.py \
	tests/runtime/test_fsdp2_scenarios.py tests/runtime/test_fsdp2_init_scenarios.py \
	tests/runtime/test_prefetch_and_state_dicts.py tests/runtime/test_list_groups.py \
	tests/runtime/test_mixed_dtypes.py tests/runtime/test_compile.py tests/integrations/test_fsdp2.py \
	tests/runtime/test_gradient_views.py tests/runtime/test_tensor_parallel.py tests/runtime/test_pipelining.py \
	tests/runtime/test_torch_state_dicts.py tests/runtime/test_checkpoints.py \
	tests/runtime/test_atomic_checkpoints.py \
	tests/quantized/test_fast_quantized_state_dicts.py tests/quantized/test_fast_quantized_gather.py \
	tests/quantized/test_quantized_checkpoints_spawned.py \
	tests/integrations/test_hf_models.py tests/integrations/test_accelerate.py \
	tests/integrations/test_trainer_ragged.py

# The fast tier and TORCH_NEXT_SLOW_TESTS on torch $(TORCH_NEXT) (the gates run once, in `make test`).
test-torch-next: $(STAMP_NEXT)
	$(BIN_NEXT)/python -m pytest -m "not slow" -n 2 || [ $$? -eq 5 ]
	$(BIN_NEXT)/python -m pytest -m "slow and not extended" -n 2 --dist loadfile --durations=20 $(TORCH_NEXT_SLOW_TESTS) || [ $$? -eq 5 ]

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_quality.py --out docs/results/plan_quality.json --markdown docs/results/plan_quality.md

# Rerun every benchmark behind docs/results/*.json, each with the command its JSON records
# (minutes, and the timings want an otherwise idle machine).
docs-bench: bench
	$(BIN)/python benchmarks/engine_vs_fsdp2.py --world-size 4 --json --out docs/results/engine_vs_fsdp2.json
	$(BIN)/python benchmarks/muon_step.py --world-size 4 --json --out docs/results/muon_step.json
	$(BIN)/python benchmarks/deepspeed_hook.py --world-size 2 4 --json --out docs/results/deepspeed_hook.json

clean:
	rm -rf $(VENV) $(VENV_NEXT) .pytest_cache .hypothesis .mypy_cache .ruff_cache *.egg-info
