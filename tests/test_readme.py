"""The README's Python code blocks run as they are, so a recipe that stops working fails the suite.

Every ```python block of README.md is a complete program: it is written to a file and run with
this interpreter in a fresh process (exit code 0 or the test fails with its output). A block that
starts ranks (``spawn_gloo``) runs in the slow tier; the others in the fast tier. A block that
cannot run says so on the line before its fence, with the reason: ``<!-- not run: reason -->``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason given in the README, if any

    @property
    def spawns(self) -> bool:
        return "spawn_gloo" in self.code


def blocks(text: str) -> list[Block]:
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = _NOT_RUN.search(before)
        out.append(Block(text.count("\n", 0, m.start()) + 1, m.group(1), reason.group(1) if reason else None))
    return out


BLOCKS = blocks(README.read_text())


def _run(block: Block, tmp_path: Path, timeout: float) -> None:
    script = tmp_path / f"readme_line{block.line}.py"
    script.write_text(block.code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"README.md block at line {block.line} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    )


def test_the_block_convention_is_understood():
    text = "a\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n```bash\nz\n```\n"
    got = blocks(text)
    assert [(b.line, b.code, b.not_run) for b in got] == [(3, "x = 1\n", "needs a GPU"), (7, "y = 2\n", None)]


def test_every_block_runs_or_says_why_not():
    assert BLOCKS, "README.md has no python blocks (the fence pattern is broken?)"
    assert all(b.not_run is None or b.not_run.strip() for b in BLOCKS)
    run = [b for b in BLOCKS if b.not_run is None]
    assert any("fully_shard" in b.code and b.spawns for b in run), "the ragged-engine recipe must run"


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.not_run is None and not b.spawns], ids=lambda b: f"line{b.line}"
)
def test_block_runs(block, tmp_path):
    _run(block, tmp_path, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.not_run is None and b.spawns], ids=lambda b: f"line{b.line}")
def test_block_runs_on_spawned_ranks(block, tmp_path):
    _run(block, tmp_path, timeout=300)


def test_the_docs_name_no_private_module():
    """Users copy what README.md and docs/ import: only public names (``blockshard.launch``, not
    ``blockshard._launch``). Control: the pattern finds a private name in a made-up line."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    private = re.compile(r"\bblockshard(?:\.\w+)*\._\w+")
    assert private.search("from blockshard._launch import spawn_gloo")  # the control
    found = [
        f"{p.relative_to(root)}:{i}: {line.strip()}"
        for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == [], "\n".join(found)
