"""Muon through Accelerate in every order users build it (issue: "Muon in the flows users build it in").

Real ``accelerate launch`` with 2 CPU processes (gloo) of ``tests/integrations/_acc_muon.py`` on a tiny
Llama whose MLP matrices ``policy="auto"`` computes at their owner ranks at W = 2, with the config
``blockshard accelerate-config --cpu --semantics muon --layers LlamaDecoderLayer`` writes. Each of the
three Muon forms (torch's ``Muon``, ``blockshard.optim.Muon``, ``OwnerComputeOptimizer``), built
before ``accelerator.prepare`` (with the model) or after ``prepare(model)``, under ``policy`` auto and
whole (11 variants: torch's Muon refuses the flat pieces of cut matrices in its own constructor, so it
cannot be built after ``prepare`` under ``auto``), trains 5 steps **bitwise** equal to torch's Muon and
AdamW on the unsharded model in one process, with ``save_state`` after step 3; ``load_state`` in new
launches at W = 2 and W = 1 continues **bitwise** to the same parameters.
The control (torch's Muon handed the pieces as they are, what ``prepare`` did before) is in
``tests/optim/test_fast_rebind.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import torch
from _background import Background

from blockshard.cli import main as cli_main

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integrations" / "_acc_muon.py"
BIN = pathlib.Path(sys.executable).parent


def _env() -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("BLOCKSHARD_ACCELERATE_CONFIG", None)
    return env


def _config(tmp_path: pathlib.Path) -> pathlib.Path:
    """The config ``blockshard accelerate-config --cpu --semantics muon --layers LlamaDecoderLayer`` writes."""
    assert cli_main(["accelerate-config", "--cpu", "--semantics", "muon", "--layers", "LlamaDecoderLayer",
                     "--out", str(tmp_path / "cfg")]) == 0  # fmt: skip
    return tmp_path / "cfg" / "accelerate.yaml"


def _launch(config: pathlib.Path, out: pathlib.Path, ranks: int, *args: str) -> Background:
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--num_processes", str(ranks)]
    return Background(
        [*cmd, str(SCRIPT), "--out", str(out), *args], pathlib.Path(f"{out}.log"), env=_env(), cwd=ROOT, timeout=300
    )


def _diffs(results: dict, reference: dict) -> dict[str, float]:
    return {
        name: max((state[k].double() - reference[k].double()).abs().max().item() for k in reference)
        for name, state in results.items()
        if sorted(state) == sorted(reference)
    }


@pytest.mark.slow
def test_every_muon_form_in_every_order_equals_one_process_and_resumes_at_w2_and_w1(tmp_path):
    config = _config(tmp_path)
    ckpt = ["--ckpt", str(tmp_path / "ck")]
    run = _launch(config, tmp_path / "run", 2, "--save-at", "3", *ckpt)
    ref = Background(
        [sys.executable, str(SCRIPT), "--reference", "--out", str(tmp_path / "ref")],
        tmp_path / "ref.log",
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    run.wait()
    ref.wait()
    reference = torch.load(tmp_path / "ref.pt")["reference"]
    infos = [json.loads((tmp_path / f"run.rank{r}.json").read_text()) for r in range(2)]
    assert [i["world_size"] for i in infos] == [2, 2]
    kinds = infos[0]["optimizers"]
    assert len(kinds) == 11
    # torch's Muon is stepped inside an OwnerComputeOptimizer that reuses it; AdamW stays itself
    assert {k: v for k, v in kinds.items() if k.startswith("torch")} == {
        k: ["OwnerComputeOptimizer", "AdamW"] for k in ("torch-before-auto", "torch-before-whole", "torch-after-whole")
    }
    trained = torch.load(tmp_path / "run.pt")
    assert _diffs(trained, reference) == dict.fromkeys(kinds, 0.0)
    resumes = [_launch(config, tmp_path / f"resumed{w}", w, "--resume-at", "3", *ckpt) for w in (2, 1)]
    for job in resumes:
        job.wait()
    for w in (2, 1):
        resumed = torch.load(tmp_path / f"resumed{w}.pt")
        assert _diffs(resumed, reference) == dict.fromkeys(kinds, 0.0), w


def test_the_docs_recipe_is_the_example():
    """docs/accelerate.md's Muon block is examples/accelerate/muon.py's recipe (which the slow test
    runs), with the imports the example has."""
    import textwrap

    docs = (
        (ROOT / "docs" / "accelerate.md").read_text().split("## Muon", 1)[1].split("```python\n", 1)[1].split("```")[0]
    )
    example = (ROOT / "examples" / "accelerate" / "muon.py").read_text()
    recipe = textwrap.dedent(example.split("# -- the recipe (docs/accelerate.md) --\n")[1].split("    # -- end of")[0])
    assert docs.endswith("\n\n" + recipe)
    imports = [line.split("#")[0].strip() for line in docs.split("\n\n" + recipe)[0].splitlines() if line]
    assert imports and all(line in example for line in imports)


@pytest.mark.slow
def test_the_muon_example_equals_one_process(tmp_path):
    example = ROOT / "examples" / "accelerate" / "muon.py"
    config = _config(tmp_path)
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config)]
    run = Background(
        [*cmd, str(example), "--out", str(tmp_path / "run")], tmp_path / "run.log", env=_env(), cwd=ROOT, timeout=300
    )
    ref = Background(
        [sys.executable, str(example), "--out", str(tmp_path / "ref")],
        tmp_path / "ref.log",
        env=_env(),
        cwd=ROOT,
        timeout=300,
    )
    run.wait()
    ref.wait()
    got, want = torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt")
    assert sorted(got) == sorted(want)
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
