"""`import blockshard` is cheap: no CUDA context, no process group, not even torch for the pure layers."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute
def test_import_touches_no_cuda_and_no_process_group():
    code = (
        "import sys, blockshard, blockshard.planner, blockshard.semantics, blockshard.integrations\n"
        "print('torch' in sys.modules)\n"
        "import torch, torch.distributed as dist\n"
        "print(torch.cuda.is_initialized(), dist.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "False"]


def test_public_names_are_exported():
    import blockshard
    import blockshard.planner
    import blockshard.semantics

    for mod in (blockshard, blockshard.planner, blockshard.semantics):
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{mod.__name__}.{name}"
