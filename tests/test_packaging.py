"""The package list in pyproject.toml covers every package folder (including integrations/); its torch
range is exactly the releases the suite runs on."""

from __future__ import annotations

import pathlib
import re
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_declared():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(cfg["packages"])
    found = set()
    for init in ROOT.glob("blockshard/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for init in ROOT.glob("integrations/**/__init__.py"):
        found.add(".".join(("blockshard",) + init.parent.relative_to(ROOT).parts))
    assert found == declared
    assert cfg["package-dir"]["blockshard.integrations"] == "integrations"


def test_torch_range_admits_exactly_the_tested_releases():
    """`make test` runs on constraints.txt's torch pin, `make test-torch-next` on the Makefile's
    TORCH_NEXT: pyproject's range admits both minor releases and none around them (the refused
    neighbours are the control: a range loosened to ``torch>=2.6`` fails here)."""
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    (torch_req,) = [r for r in deps if r.name == "torch"]
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    nxt = re.search(r"^TORCH_NEXT := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pinned and nxt
    tested = sorted(Version(v) for v in (pinned[1], nxt[1]))
    assert tested[0].major == tested[1].major and tested[0] < tested[1]
    major, minors = tested[0].major, range(tested[0].minor - 1, tested[1].minor + 2)
    admitted = [m for m in minors if torch_req.specifier.contains(f"{major}.{m}.0")]
    assert admitted == sorted({v.minor for v in tested}), (str(torch_req.specifier), [str(v) for v in tested])
    assert all(torch_req.specifier.contains(str(v)) for v in tested)
