"""The Hugging Face ``Trainer`` with blockshard's ragged engine: ``blockshard.integrations.accelerate.Trainer``.

Slow tests: ``examples/hf_trainer_ragged.py`` under a real ``accelerate launch`` (2 CPU processes over
gloo, the config ``blockshard accelerate-config --cpu --semantics bnb8bit`` writes: one group per
``LlamaDecoderLayer``, then the root) against the stock ``transformers.Trainer`` in one process
(``--stock``, no blockshard), both run at once. A tiny Llama built in code (tied embeddings), an
in-memory dataset, ``report_to=[]``, 3 steps. Every rank trains on the whole batch: the example's
``RankReplicated`` dataset repeats each batch W times in a row under the Trainer's sequential sampler
(``train_sampling_strategy="sequential"``), and accelerate gives rank r batches r, r + W, ...; so each
step every rank sees the batch one process sees (docs/design.md, "Sharding invariance").

* ``adamw_torch`` and ``adamw_bnb_8bit``: **bitwise** equal to one process (losses and the
  ``trainer.save_model`` output loaded with ``from_pretrained``). ``max_grad_norm=10`` here: the
  gradient norm is ~1.9, so the clip factor clamps to 1.0 and multiplies exactly.
* ``gradient_accumulation_steps=2`` (the same batches as two micro-batches of 2, ``adamw_accum``):
  bitwise equal to the stock Trainer accumulating the same way in one process.
* bitsandbytes: the Trainer's 32-bit override for ``nn.Embedding`` holds on each rank's piece of the
  (tied) embedding: fp32 state on both ranks, as on one process. The control (the override dropped)
  keeps 8-bit state and differs from one process (measured 6.9e-4).
* ``max_grad_norm=1.0`` (clipping active): the Trainer's logged norm is the global one, the same on
  both ranks and within ``CLIP_RTOL = 1e-6`` of one process (torch sums per tensor, blockshard per
  piece: an ulp apart), the model within ``CLIP_ATOL = 1e-6`` (measured 1.2e-7).
* Sharding happened: each rank holds part of the parameters and of the embedding.
* The checkpoint the Trainer writes after step 2 (``save_steps``) holds the full model
  (``from_pretrained`` equals the stock Trainer's checkpoint bitwise), blockshard's DCP state of
  model and optimizer, and the scheduler; ``resume_from_checkpoint`` into a new Trainer (new model,
  optimizer and blockshard ``Accelerator``, in the same launch: ``--then-resume``) ends **bitwise**
  like the uninterrupted run (adamw_torch and adamw_bnb_8bit).
* Without a blockshard config (one process, in the test process) blockshard's Trainer is the stock
  one: bitwise equal to the reference's ``adamw`` run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from blockshard.cli import main as cli_main

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer_ragged.py"
BIN = pathlib.Path(sys.executable).parent
CLIP_RTOL = 1e-6
CLIP_ATOL = 1e-6
RUNS = "adamw,bnb,adamw_clip,adamw_accum"


def test_follow_overrides_moves_pid2config_onto_the_new_parameter():
    bnb = pytest.importorskip("bitsandbytes")
    import torch

    from blockshard.integrations.accelerate import follow_overrides

    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    before = {id(p): n for n, p in model.named_parameters()}
    old = model[0].weight
    manager.override_config(old, "optim_bits", 32)
    model[0].weight = torch.nn.Parameter(old.detach()[:4].clone())  # a piece: a new Parameter object
    assert follow_overrides(before, model) == 1
    assert manager.pid2config == {id(model[0].weight): {"optim_bits": 32}}
    manager.initialize()


@pytest.mark.slow  # in this process (about 8 s), against the stock Trainer's run of the `runs` fixture
def test_without_a_blockshard_config_it_is_the_stock_trainer(tmp_path, monkeypatch, runs):
    """One process, no config: blockshard's Trainer builds its Accelerator with no settings and trains
    exactly as ``transformers.Trainer`` (the example's ``adamw`` run, here in this process, against the
    same run of the stock Trainer in the reference process)."""
    import importlib.util

    import torch

    monkeypatch.delenv("BLOCKSHARD_ACCELERATE_CONFIG", raising=False)
    spec = importlib.util.spec_from_file_location("hf_trainer_ragged", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference process (the example's main)
    try:
        example.train("adamw", *example.RUNS["adamw"], stock=False, out=str(tmp_path), resume=None)
    finally:
        torch.set_num_threads(threads)
    assert _max_diff(_model(tmp_path / "final"), _model(runs[0] / "adamw" / "final")) == 0.0
    info = json.loads((tmp_path / "rank0.json").read_text())
    assert info["world_size"] == 1 and info["local_numel"] == info["total_numel"]


def _env() -> dict:
    # BLOCKSHARD_LOG=info: the engage line ([Note: engage line]) and the first steps' collectives
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", BLOCKSHARD_LOG="info")
    env.pop("BLOCKSHARD_ACCELERATE_CONFIG", None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(reference dir, sharded dir): the stock one-process runs and the launched ones, run at once."""
    tmp = tmp_path_factory.mktemp("trainer")
    assert cli_main(["accelerate-config", "--cpu", "--semantics", "bnb8bit", "--out", str(tmp / "cfg")]) == 0
    ref = [sys.executable, str(EXAMPLE), "--stock", "--runs", RUNS, "--out", str(tmp / "ref")]
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(tmp / "cfg" / "accelerate.yaml")]
    runs = ["--runs", f"{RUNS},bnb_no_override", "--then-resume", "adamw,bnb"]
    sharded = [*launch, str(EXAMPLE), *runs, "--out", str(tmp / "run")]
    procs = [subprocess.Popen(c, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in (ref, sharded)]  # fmt: skip
    for proc, name in zip(procs, ("ref", "run"), strict=True):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-6000:]
        (tmp / f"{name}.log").write_text(out)
    return tmp / "ref", tmp / "run"


@pytest.mark.slow
def test_the_trainer_says_it_engaged(runs):
    """Under BLOCKSHARD_LOG=info the launched Trainer logs one engage line per run (rank 0) and the
    report after it; the stock Trainer, the control, says nothing."""
    ref, run = runs
    engaged = [x for x in (run.parent / "run.log").read_text().splitlines() if "blockshard engaged (" in x]
    assert engaged and all("blockshard engaged (HF Trainer): engine ragged, semantics bnb8bit," in x for x in engaged)
    assert all("over 2 ranks" in x for x in engaged), engaged
    assert "blockshard engaged" not in (ref.parent / "ref.log").read_text()


def _infos(out: pathlib.Path, run: str, ranks: int) -> list[dict]:
    return [json.loads((out / run / f"rank{r}.json").read_text()) for r in range(ranks)]


def _model(path: pathlib.Path) -> dict:
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(path).state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _check_sharded(infos: list[dict]) -> None:
    assert [i["world_size"] for i in infos] == [2, 2]
    total = infos[0]["total_numel"]
    assert all(0 < i["local_numel"] < total for i in infos), infos  # each rank holds part of the parameters
    assert sum(i["local_numel"] for i in infos) >= total
    assert all(0 < i["embedding_numel"] < 512 * 64 for i in infos), infos  # the embedding is cut across both


@pytest.mark.slow
@pytest.mark.parametrize("run", ["adamw", "bnb", "adamw_accum"])
def test_trainer_equals_one_process_bitwise(runs, run):
    ref, sharded = runs
    (ref_info,) = _infos(ref, run, 1)
    infos = _infos(sharded, run, 2)
    _check_sharded(infos)
    assert ref_info["world_size"] == 1
    assert infos[0]["losses"] == infos[1]["losses"] == ref_info["losses"]
    assert infos[0]["grad_norms"] == infos[1]["grad_norms"]  # the global norm, on every rank
    assert infos[0]["grad_norms"] == pytest.approx(ref_info["grad_norms"], rel=CLIP_RTOL)
    assert _max_diff(_model(sharded / run / "final"), _model(ref / run / "final")) == 0.0


@pytest.mark.slow
def test_bnb_embedding_override_follows_the_piece(runs):
    ref, sharded = runs
    assert _infos(ref, "bnb", 1)[0]["embedding_state"] == "torch.float32"  # the Trainer's override, one process
    assert [i["embedding_state"] for i in _infos(sharded, "bnb", 2)] == ["torch.float32"] * 2
    # the control: without the override the embedding's pieces keep 8-bit state, and the model differs
    control = _infos(sharded, "bnb_no_override", 2)
    _check_sharded(control)
    assert [i["embedding_state"] for i in control] == ["torch.uint8"] * 2
    assert _max_diff(_model(sharded / "bnb_no_override" / "final"), _model(ref / "bnb" / "final")) > 1e-5


@pytest.mark.slow
def test_clipping_uses_the_global_norm(runs):
    ref, sharded = runs
    (ref_info,) = _infos(ref, "adamw_clip", 1)
    infos = _infos(sharded, "adamw_clip", 2)
    _check_sharded(infos)
    assert min(ref_info["grad_norms"]) > 1.0  # clipping is active at max_grad_norm=1.0
    assert infos[0]["grad_norms"] == infos[1]["grad_norms"]
    assert infos[0]["grad_norms"] == pytest.approx(ref_info["grad_norms"], rel=CLIP_RTOL)
    assert _max_diff(_model(sharded / "adamw_clip" / "final"), _model(ref / "adamw_clip" / "final")) <= CLIP_ATOL


@pytest.mark.slow
def test_checkpoints_hold_the_full_model_and_resume_bitwise(runs):
    ref, sharded = runs
    for run in ("adamw", "bnb"):
        ckpt = sharded / run / "checkpoint-2"
        assert (ckpt / "blockshard" / "blockshard.json").is_file()  # blockshard.save_checkpoint's record (DCP)
        assert (ckpt / "scheduler.pt").is_file() and (ckpt / "trainer_state.json").is_file()
        assert not (ckpt / "optimizer.pt").exists()  # never rank 0's pieces under the full names
        assert _max_diff(_model(ckpt), _model(ref / run / "checkpoint-2")) == 0.0  # the stock Trainer's, after step 2
    # a new Trainer (model, optimizer, blockshard's Accelerator) in the same launch resumes from
    # checkpoint-2 (full weights, then blockshard's DCP state) and ends bitwise
    for run in ("adamw", "bnb"):
        infos = _infos(sharded, f"{run}_resumed", 2)
        _check_sharded(infos)
        assert infos[0]["losses"] == _infos(sharded, run, 2)[0]["losses"]  # steps 1-2 from trainer_state.json
        assert _max_diff(_model(sharded / f"{run}_resumed" / "final"), _model(sharded / run / "final")) == 0.0


@pytest.mark.slow
def test_trainer_with_torch_muon_passed_in_equals_one_process_and_resumes_bitwise(tmp_path):
    """``Trainer(..., optimizers=(torch.optim.Muon(...), None))`` built over the unsharded model (the
    example's ``muon`` run), under the config ``accelerate-config --semantics muon`` writes (``policy:
    auto``: the MLP matrices cut, computed at their owners): losses and the saved model **bitwise**
    equal to the stock Trainer in one process; a new Trainer resumed from checkpoint-2 (blockshard's
    DCP state of the owner-computed Muon) ends bitwise like the uninterrupted run."""
    assert cli_main(["accelerate-config", "--cpu", "--semantics", "muon", "--out", str(tmp_path / "cfg")]) == 0
    ref = [sys.executable, str(EXAMPLE), "--stock", "--runs", "muon", "--out", str(tmp_path / "ref")]
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(tmp_path / "cfg" / "accelerate.yaml")]
    sharded = [*launch, str(EXAMPLE), "--runs", "muon", "--then-resume", "muon", "--out", str(tmp_path / "run")]
    procs = [subprocess.Popen(c, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in (ref, sharded)]  # fmt: skip
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-6000:]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    (ref_info,) = _infos(ref_dir, "muon", 1)
    infos = _infos(run_dir, "muon", 2)
    _check_sharded(infos)
    assert infos[0]["losses"] == infos[1]["losses"] == ref_info["losses"]
    assert _max_diff(_model(run_dir / "muon" / "final"), _model(ref_dir / "muon" / "final")) == 0.0
    assert _max_diff(_model(run_dir / "muon_resumed" / "final"), _model(run_dir / "muon" / "final")) == 0.0


@pytest.mark.slow
def test_cpu_launch_without_use_cpu_says_so(tmp_path):
    """``TrainingArguments`` sets up accelerate before the Trainer: without ``use_cpu=True`` on a CPU
    machine accelerate reports one process; blockshard's Trainer says what to pass."""
    script = tmp_path / "no_use_cpu.py"
    text = EXAMPLE.read_text()
    assert "use_cpu=not torch.cuda.is_available()," in text
    script.write_text(text.replace("use_cpu=not torch.cuda.is_available(),", "use_cpu=False,"))
    assert cli_main(["accelerate-config", "--cpu", "--out", str(tmp_path / "cfg")]) == 0
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(tmp_path / "cfg" / "accelerate.yaml")]
    cmd = [*launch, str(script), "--runs", "adamw", "--out", str(tmp_path / "out")]
    res = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "AccelerateConfigError" in res.stderr and "pass TrainingArguments(use_cpu=True" in res.stderr
