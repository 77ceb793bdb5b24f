"""The package list in pyproject.toml covers every package folder (including integrations/)."""

from __future__ import annotations

import pathlib
import tomllib

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
