"""The examples run as written, through the real launchers, and equal one process.

Each example states its launch command in its header and in ``examples/README.md`` (fast test). The
slow tests run each with 2 CPU processes (gloo; ``torchrun`` or ``deepspeed``) and as one process
(``torchrun --nproc_per_node 1``, or the example's no-DeepSpeed reference), every rank the whole batch,
and compare the final parameters **bitwise** (the examples' ``--out`` files). The HF Trainer example runs
in ``tests/integrations/test_hf_trainer_deepspeed.py`` (ZeRO-1 and ZeRO-2, with its control).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = pathlib.Path(sys.executable).parent
CONTROL_MIN = 1e-3  # stock ZeRO + AdamW8bit vs one process (measured 1.6e-2, ZeRO-1 at W = 2)
SCRIPTS = [
    "torchrun_ragged_muon.py",
    "fsdp2_owner_compute.py",
    "deepspeed_bnb.py",
    "hf_trainer_deepspeed.py",
    "custom_block_type/train.py",
    "accelerate/train.py",  # run by tests/integrations/test_accelerate.py
    "accelerate/muon.py",  # run by tests/integrations/test_accelerate_muon.py
    "accelerate/zero3_init.py",  # run by tests/integrations/test_accelerate.py
    "hf_trainer_ragged.py",  # run by tests/integrations/test_trainer_ragged.py
]


def _launch_lines(script: str) -> list[str]:
    doc = (EXAMPLES / script).read_text().split('"""')[1]
    return [
        line.strip()
        for line in doc.splitlines()
        if re.match(r"\s+(\S+=\S+ )*(torchrun|deepspeed|accelerate|blockshard|python|pip) ", line)
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_commands_are_in_the_header_and_the_readme(script):
    lines = _launch_lines(script)
    assert any(f"examples/{script}" in line for line in lines), lines
    readme = (EXAMPLES / "README.md").read_text()
    for line in lines:
        assert line.split("#")[0].strip() in readme, line


def _env(**extra: str) -> dict:
    return dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **extra)


_PORTS: set[int] = set()


def _port() -> int:
    """A free port not handed out before in this session (launches run at once)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS:
            _PORTS.add(port)
            return port


def _torchrun(nproc: int) -> list[str]:
    port = _port()
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
    ]


def _deepspeed() -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", "2", *_torchrun(2)[-2:]]


def _start(cmd: list[str], out: pathlib.Path, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd --out OUT``; its output goes to ``OUT.log`` (no pipe fills while another is waited for)."""
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(
            [*cmd, "--out", str(out)], env=env or _env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )


def _finish(proc: subprocess.Popen, out: pathlib.Path) -> tuple[dict, dict]:
    proc.wait(timeout=300)
    assert proc.returncode == 0, pathlib.Path(f"{out}.log").read_text(errors="replace")[-6000:]
    return json.loads(out.read_text()), torch.load(f"{out}.pt")


def _runs(*jobs: tuple[list[str], pathlib.Path], env: dict | None = None) -> list[tuple[dict, dict]]:
    """Run the commands at once (a one-process reference beside a 2-process launch fills the idle
    core), each with ``--out OUT``; return each one's (JSON, parameters)."""
    procs = [(_start(cmd, out, env), out) for cmd, out in jobs]
    try:
        return [_finish(proc, out) for proc, out in procs]
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()


def _run(cmd: list[str], out: pathlib.Path, env: dict | None = None) -> tuple[dict, dict]:
    return _runs((cmd, out), env=env)[0]


def _assert_bitwise(two: tuple[dict, dict], one: tuple[dict, dict]) -> None:
    (info2, params2), (info1, params1) = two, one
    assert (info2["world_size"], info1["world_size"]) == (2, 1)
    assert params2.keys() == params1.keys()
    diff = {k: (params2[k] - params1[k]).abs().max().item() for k in params1 if not torch.equal(params2[k], params1[k])}
    assert diff == {}
    assert info2["losses"] == info1["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["torchrun_ragged_muon.py", "fsdp2_owner_compute.py"])
def test_torchrun_example_equals_one_process(tmp_path, script):
    path = str(EXAMPLES / script)
    two, one = _runs(([*_torchrun(2), path], tmp_path / "w2.json"), ([*_torchrun(1), path], tmp_path / "w1.json"))
    _assert_bitwise(two, one)


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """``deepspeed_bnb.py``: ZeRO-2 under ``deepspeed``, ZeRO-1 under ``torchrun`` (both ``--compare``)
    and ``--reference`` (one process without DeepSpeed), started at once; ``deepspeed_runs[name]()``
    waits for one and returns its (JSON, parameters)."""
    tmp = tmp_path_factory.mktemp("ds")
    path = str(EXAMPLES / "deepspeed_bnb.py")
    jobs = {
        "reference": [sys.executable, path, "--reference"],
        "zero2-deepspeed": [*_deepspeed(), path, "--stage", "2", "--compare"],
        "zero1-torchrun": [*_torchrun(2), path, "--stage", "1", "--compare"],
    }
    procs = {name: _start(cmd, tmp / f"{name}.json") for name, cmd in jobs.items()}
    yield lambda name: _finish(procs[name], tmp / f"{name}.json")
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero2-deepspeed", "zero1-torchrun"])
def test_deepspeed_bnb_example_equals_one_process(deepspeed_runs, run):
    """Hooked ZeRO equals one process bitwise under either launcher; with ``--compare`` the same launch
    also trains stock ZeRO (the control: it differs by more than ``CONTROL_MIN``) and one process on
    every rank, and checks that every rank holds the same parameters."""
    two = deepspeed_runs(run)
    _assert_bitwise(two, deepspeed_runs("reference"))
    info = two[0]
    assert info["ranks_agree"] is True and info["hooked_vs_single_max_abs_diff"] == 0.0, info
    assert info["stock_vs_single_max_abs_diff"] > CONTROL_MIN, info


@pytest.mark.slow
def test_custom_block_type_package(tmp_path):
    """Install the example package (no network, nothing written to the source tree), train with its
    ``tile96`` semantics; without the package the name is unknown (the control)."""
    src = shutil.copytree(EXAMPLES / "custom_block_type", tmp_path / "src")
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "--target", str(target), str(src)], check=True, capture_output=True, timeout=120)
    lookup = [sys.executable, "-c", "import blockshard; print(blockshard.get_semantics('tile96'))"]
    missing = subprocess.run(lookup, env=_env(), capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "tile96" in missing.stderr
    env = _env(PYTHONPATH=str(target) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = str(EXAMPLES / "custom_block_type" / "train.py")
    two, one = _runs(
        ([*_torchrun(2), path], tmp_path / "w2.json"), ([*_torchrun(1), path], tmp_path / "w1.json"), env=env
    )
    assert two[0]["pieces_start_on_tiles"] and one[0]["pieces_start_on_tiles"]
    _assert_bitwise(two, one)
