"""What the test tier asks of a test: ``make test-fast`` sets ``BLOCKSHARD_TEST_TIER=fast``.

Hypothesis-drawn properties run every example they name under ``make test`` and a fifth of them (at
least 20) in the fast tier, whose budget is a minute on a 2-core machine: the fast tier shows each
property holds on a sample, the full suite searches for a counterexample."""

from __future__ import annotations

import os

FAST = os.environ.get("BLOCKSHARD_TEST_TIER") == "fast"


def examples(n: int) -> int:
    """``n`` hypothesis examples, or a fifth of them (at least 20, at most ``n``) in the fast tier."""
    return min(n, max(20, n // 5)) if FAST else n
