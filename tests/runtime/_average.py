"""What W ranks' gradient average does to W identical gradients, for one-process references."""

from __future__ import annotations

import torch


def average_of(world: int, grad: torch.Tensor) -> None:
    """What averaging ``world`` identical gradients does to ``grad``, in place: gloo's reduce-scatter
    ``AVG`` sums them in rank order and divides by ``world`` (checked bitwise in
    tests/runtime/test_w3_average.py). Exact at W in {1, 2, 4}; at W = 3 ``((g + g) + g) / 3`` is off
    by an ulp in places, so a one-process reference that applies it is what W = 3 must equal bitwise."""
    total = grad.clone()
    for _ in range(world - 1):
        total += grad
    grad.copy_(total / world)
