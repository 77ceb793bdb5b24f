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


def test_the_lazy_engine_names_are_the_ones_mypy_sees():
    """``blockshard.__getattr__`` loads ``_RUNTIME``'s (and ``_OPTIM``'s) names on first use; mypy sees them through the
    ``if TYPE_CHECKING:`` imports above it, which must name the same functions (control: a name
    missing from those imports is found)."""
    import ast
    import pathlib

    import blockshard

    tree = ast.parse(pathlib.Path(blockshard.__file__).read_text())
    guarded = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    seen = {a.asname for n in guarded for imp in n.body if isinstance(imp, ast.ImportFrom) for a in imp.names}
    assert seen == set(blockshard._RUNTIME) | set(blockshard._OPTIM)
    assert seen - {"fully_shard"} != set(blockshard._RUNTIME)  # the control
