"""Prefetch order and the two state dicts, on 2 spawned gloo ranks."""

from __future__ import annotations

import functools
import math

import _scenarios as sc
import pytest
import torch

from blockshard._launch import spawn_gloo

pytestmark = pytest.mark.slow


@functools.cache
def results() -> list[dict]:
    return spawn_gloo(sc.prefetch_and_state_dicts, 2, timeout=120)


def test_next_group_is_gathered_ahead_in_forward_and_backward():
    events = results()[0]["events"]
    issued = [(name, async_op) for kind, name, async_op in events if kind == "issue"]
    # forward: blocks.1 and blocks.2 are issued asynchronously by their predecessor's pre-forward
    assert ("blocks.1", True) in issued and ("blocks.2", True) in issued
    # ... and found already in flight when their own pre-forward waits
    waited = [(name, pending) for kind, name, pending in events if kind == "wait"]
    assert ("blocks.1", True) in waited and ("blocks.2", True) in waited
    # backward: blocks.1 is gathered again ahead of its gradients (prefetched by blocks.2)
    first_fwd = issued.index(("blocks.1", True))
    assert ("blocks.1", True) in issued[first_fwd + 1 :]


def test_sharded_state_dict_pieces_reassemble_the_full_parameters():
    per_rank = [r["shards"] for r in results()]
    full = results()[0]["full"]
    assert per_rank[0].keys() == full.keys()
    for name, tensor in full.items():
        flat = torch.empty(tensor.numel())
        covered = 0
        for shards in per_rank:
            piece, start, shape = shards[name]
            assert shape == tuple(tensor.shape)
            flat[start : start + piece.numel()] = piece.reshape(-1)
            covered += piece.numel()
        assert covered == math.prod(tensor.shape)
        assert torch.equal(flat.view(tensor.shape), tensor)
    assert torch.equal(results()[0]["full"]["blocks.0.0.weight"], results()[1]["full"]["blocks.0.0.weight"])
