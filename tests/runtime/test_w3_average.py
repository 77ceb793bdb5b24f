"""The reference the W = 3 invariance tests compare with bitwise: gloo's reduce-scatter ``AVG`` of W
identical gradients is exactly ``tests/runtime/_average.average_of`` (the sum in rank order, divided by W),
on 3 gloo thread ranks. Control: at W = 3 that average is not the gradient itself (an ulp off in
places), which is why those tests average their one-process reference the same way."""

from __future__ import annotations

import _inproc
import pytest
import torch
import torch.distributed as dist
from _average import average_of


def _average(rank: int, world: int) -> tuple[bool, int]:
    g = torch.randn(world * 50_000, generator=torch.Generator().manual_seed(0))
    out = torch.empty(50_000)
    dist.reduce_scatter_tensor(out, g.clone(), op=dist.ReduceOp.AVG)
    mine = g[rank * 50_000 : (rank + 1) * 50_000].clone()
    plain = mine.clone()
    average_of(world, mine)
    return torch.equal(out, mine), int((out != plain).sum())


def test_gloo_average_of_three_equal_gradients_is_average_of():
    for exact, off in _inproc.run_ranks(_average, 3):
        assert exact
        assert off > 1000  # the control: about 5% of the values are an ulp off the gradient itself


@pytest.mark.heavy  # a second pair of thread worlds: make test runs it
def test_at_two_and_four_ranks_the_average_is_the_gradient():
    for world in (2, 4):
        for exact, off in _inproc.run_ranks(_average, world):
            assert exact and off == 0
