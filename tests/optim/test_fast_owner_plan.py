"""Owner-compute's exchange lists from owner plans, without a process group (fast tier).

For an owner-policy plan, every rank's pieces (``Holding``) give: the whole compute units a rank
steps itself (``local_region``) and the cut units it owns (``exchange_lists``). Together they
cover every tensor exactly once, every cut unit has exactly one owner, and the all_to_all counts
match on both sides and equal the pieces the plan says move.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from blockshard.optim._owner_compute import Holding, exchange_lists, local_region
from blockshard.planner import plan_model
from blockshard.semantics import TensorSpec

MODELS = {
    "mlp": [("a.w", (96, 40), "0"), ("a.b", (96,), "0"), ("b.w", (5, 96), "0"), ("c.w", (7, 5), None)],
    "blocks": [
        (f"l{i}.{n}", s, f"l{i}") for i in range(3) for n, s in (("q", (24, 24)), ("up", (64, 24)), ("n", (24,)))
    ],
    "experts": [("e.x", (4, 12, 10), "0"), ("e.g", (10, 4), "0"), ("h.w", (33, 7), None)],
}
SEMANTICS = {"*.w": "matrix", "*.q": "matrix", "*.up": "matrix", "*.g": "matrix", "e.x": "expert"}


def _holdings(model: str, W: int) -> tuple[dict, list[list[Holding]]]:
    specs = [TensorSpec(name=n, shape=s, dtype=torch.float32, group=g) for n, s, g in MODELS[model]]
    plan = plan_model(specs, W, semantics=SEMANTICS, policy="owner")
    a = plan.owners
    units: dict[str, list[tuple[int, int, int]]] = {}
    for t, s, n, o in zip(
        a.unit_tensor.tolist(), a.unit_start.tolist(), a.unit_numel.tolist(), a.unit_owner.tolist(), strict=True
    ):
        units.setdefault(a.tensor_names[t], []).append((s, n, o))
    grids = {it.name: it.grid for it in plan.items}
    per_rank: list[list[Holding]] = [[] for _ in range(W)]
    for layout in plan.groups:
        for t in layout.tensors:
            if t.name not in plan.owner_tensors:
                continue
            for r in range(W):
                q = Holding(t.name, torch.empty(0), tuple(t.shape), 0, planned=True, offset=t.offset)
                q.segment, q.units = layout.buckets[t.bucket], tuple(units.get(t.name, ()))
                lo = min(max(r * q.segment - t.offset, 0), t.numel)
                q.local_start = lo
                q.local_numel = max(0, min(max((r + 1) * q.segment - t.offset, 0), t.numel) - lo)
                per_rank[r].append(q)
    return grids, per_rank


@pytest.mark.parametrize("W", [2, 3, 8])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_compute_unit_has_exactly_one_owner_and_counts_match(model, W):
    grids, per_rank = _holdings(model, W)
    lists = [exchange_lists(hs, ["float32"] * len(hs), r, W) for r, hs in enumerate(per_rank)]
    # every cut unit is owned by exactly one rank, the one the plan names
    owned = sorted((per_rank[r][t].name, a, n, r) for r, (_, own) in enumerate(lists) for _, t, a, n, _ in own)
    planned = sorted((q.name, a, n, o) for q in per_rank[0] for a, n, o in q.units)
    assert owned == planned
    # each tensor is covered exactly once: cut units plus the regions ranks step themselves,
    # and a region starts and ends on whole compute units
    for t, q0 in enumerate(per_rank[0]):
        grid = grids[q0.name]
        spans = [(a, a + n) for a, n, _ in q0.units]
        for r in range(W):
            lo, hi = local_region(per_rank[r][t])
            if lo < hi:
                spans.append((lo, hi))
                for cut in (lo, hi):
                    assert cut in (0, grid.numel) or (
                        grid.min_cut <= cut <= grid.max_cut and cut % grid.unit_numel == 0
                    )
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == grid.numel
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(spans))
    # all_to_all counts: what r sends o is what o expects from r, and equals r's pieces of o's units
    for r, (ex, _) in enumerate(lists):
        e = ex.get("float32")
        if e is None:
            assert not planned
            continue
        assert e.send_sizes[r] == 0 and e.recv_sizes[r] == 0
        for o in range(W):
            assert e.send_sizes[o] == lists[o][0]["float32"].recv_sizes[r]
            held = sum(
                cnt for q in per_rank[r] for a, n, own in q.units if own == o for h, _, cnt in q.holders(a, n) if h == r
            )
            assert e.send_sizes[o] == (held if o != r else 0)
