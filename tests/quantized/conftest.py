"""The quantized tests reuse the engine tier's in-process ranks (tests/runtime/_inproc.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runtime"))
