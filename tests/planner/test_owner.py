"""Owner plans: hand-computed cases, a brute-force reference of the greedy, and conservation laws."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from _strategies import grids
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard._errors import PlanError
from blockshard.planner._items import PlanItem
from blockshard.planner._owner import OWNER_ENGINES, plan_owners
from blockshard.semantics import TensorSpec, UnitGrid


def item(name: str, shape: tuple[int, ...], grid: UnitGrid | None = None, cost: float | None = None) -> PlanItem:
    n = math.prod(shape)
    return PlanItem(
        TensorSpec(name=name, shape=shape), grid or UnitGrid.units(n, 1), float(n if cost is None else cost)
    )


# -- hand-computed cases --------------------------------------------------------------------------
def test_fsdp2_rows_case():
    # (10, 8) at W=4 under fsdp2: shards [0,24) [24,48) [48,72) [72,80); rows:2 units of 16.
    # Units [16,32) (ranks 0,1) and [64,80) (ranks 2,3) straddle. Bulk cost: 16, 16, 16, 0.
    # Greedy (equal costs -> tensor order, start): [16,32) -> rank 3 (least cost, 0);
    # then all ranks at 16: [64,80) -> holders 2 and 3 hold 8 each -> lowest rank, 2.
    p = plan_owners([item("w", (10, 8), UnitGrid.units(80, 16))], 4)
    assert [tuple(u) for u in p.straddling_units()] == [("w", 16, 16, 3), ("w", 64, 16, 2)]
    assert p.cost_per_rank.tolist() == [16.0, 16.0, 32.0, 16.0]
    assert p.send_numel_per_rank.tolist() == [8, 8, 0, 8]
    assert p.recv_numel_per_rank.tolist() == [0, 0, 8, 16]
    assert p.max_cost_over_mean == pytest.approx(32 / 20)
    assert p.all_to_all_splits(3) == ([0, 0, 8, 0], [8, 8, 0, 0])
    assert p.all_to_all_splits(0) == ([0, 0, 0, 8], [0, 0, 0, 0])


def test_zero3_flat_case_prefers_the_holder_with_most():
    # 80 elements at W=4 under zero3: shards of 20; units of 16: [16,32) [32,48) [48,64) straddle.
    # Bulk: rank0 [0,16) = 16, rank1 none, rank2 none, rank3 [64,80) = 16.
    # [16,32): ranks 1, 2 at 0 -> rank 1 (holds 12 of it; rank 2 holds none).
    # [32,48): ranks 2 at 0 -> rank 2. [48,64): costs 16,16,16,16 -> holders 2 (12) and 3 (4) -> 2.
    p = plan_owners([item("w", (10, 8), UnitGrid.units(80, 16))], 4, engine="zero3")
    assert [(u.start, u.owner) for u in p.straddling_units()] == [(16, 1), (32, 2), (48, 2)]
    assert p.cost_per_rank.tolist() == [16.0, 16.0, 32.0, 16.0]
    assert p.send_numel_per_rank.tolist() == [4, 8, 0, 4]
    assert p.recv_numel_per_rank.tolist() == [0, 4, 12, 0]


def test_whole_matrices_spanning_many_ranks():
    # Muon: each matrix is one unit; under zero3 at W=64 a 64x64 matrix spans all ranks.
    items = [item(f"m{i}", (64, 64), UnitGrid.whole(4096), cost=float(10 - i)) for i in range(3)]
    p = plan_owners(items, 64, engine="zero3")
    assert [u.owner for u in p.straddling_units()] == [0, 1, 2]
    assert p.cost_per_rank[:3].tolist() == [10.0, 9.0, 8.0] and p.cost_per_rank[3:].sum() == 0
    # Each owner receives the 63 other pieces of 64 elements; every rank sends 3 pieces but its own.
    assert p.recv_numel_per_rank[:3].tolist() == [4032] * 3
    assert p.send_numel_per_rank[0] == 128 and p.send_numel_per_rank[5] == 192
    send, recv = p.all_to_all_splits(1)
    assert recv == [64] + [0] + [64] * 62 and send[0] == send[2] == 64 and send[1] == 0


def test_no_straddling_units():
    p = plan_owners([item("w", (8, 8), UnitGrid.units(64, 16))], 4)
    assert p.num_straddling == 0 and p.send_numel_per_rank.sum() == 0
    assert p.cost_per_rank.tolist() == [16.0] * 4 and p.max_cost_over_mean == 1.0
    assert p.all_to_all_splits(2) == ([0] * 4, [0] * 4)
    empty = plan_owners([], 3)
    assert empty.cost_per_rank.tolist() == [0.0] * 3 and empty.max_cost_over_mean == 1.0


def test_fine_grid_on_a_huge_tensor():
    # 256-element blocks on 10^9 elements at W = 16384: ~4 million units, only straddlers decided.
    n, w = 10**9, 16384
    p = plan_owners([item("big", (n,), UnitGrid.units(n, 256), cost=1e9)], w, engine="zero3")
    s = -(-n // w)
    expected = sum(1 for k in range(1, w) if (k * s) % 256 and k * s < n)
    assert p.num_straddling == expected
    assert p.cost_per_rank.sum() == pytest.approx(1e9)
    assert p.send_numel_per_rank.sum() == p.recv_numel_per_rank.sum()


def test_bad_input_names_the_parameter():
    it = item("w", (4, 4))
    with pytest.raises(PlanError, match=r"engine='zero2'.*fsdp2.*zero3"):
        plan_owners([it], 2, engine="zero2")
    with pytest.raises(PlanError, match=r"world_size=-1"):
        plan_owners([it], -1)
    with pytest.raises(PlanError, match=r"cost"):
        plan_owners([item("w", (4, 4), cost=-1.0)], 2)
    with pytest.raises(PlanError, match=r"rank=4"):
        plan_owners([it], 4).all_to_all_splits(4)


# -- brute-force reference ------------------------------------------------------------------------
def _units(grid: UnitGrid) -> list[tuple[int, int]]:
    cuts = [0] + [x for x in range(1, grid.numel) if grid.allows_cut(x)] + [grid.numel]
    return [(a, b) for a, b in itertools.pairwise(cuts) if b > a]


def _reference(items: list[PlanItem], w: int, engine: str):
    """Enumerate every unit; greedy with a linear scan over ranks."""
    cost = [0.0] * w
    straddlers = []  # (unit cost, t, a, b, {rank: piece})
    for t, it in enumerate(items):
        if it.numel == 0:
            continue
        if engine == "fsdp2":
            shape = it.spec.shape or (1,)
            s = -(-shape[0] // w) * math.prod(shape[1:])
        else:
            s = -(-it.numel // w)
        for a, b in _units(it.grid):
            pieces = {r: min(b, (r + 1) * s) - max(a, r * s) for r in range(w)}
            pieces = {r: v for r, v in pieces.items() if v > 0}
            c = it.cost / it.numel * (b - a)
            if len(pieces) == 1:
                cost[next(iter(pieces))] += c
            else:
                straddlers.append((c, t, a, b, pieces))
    straddlers.sort(key=lambda x: (-x[0], x[1], x[2]))
    owners = {}
    for c, t, a, b, pieces in straddlers:
        owner = min(range(w), key=lambda r: (cost[r], -pieces.get(r, 0), r))
        cost[owner] += c
        owners[(t, a)] = (owner, b - a, pieces)
    return cost, owners


@st.composite
def groups(draw) -> list[PlanItem]:
    out = []
    for i in range(draw(st.integers(0, 5))):
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
        n = math.prod(shape)
        # Integer cost densities keep every sum exact, so ties are reproducible.
        out.append(item(f"t{i}", shape, draw(grids(n)), cost=float(n * draw(st.integers(0, 3)))))
    return out


@settings(max_examples=examples(300), deadline=None)
@given(groups(), st.integers(1, 20), st.sampled_from(OWNER_ENGINES))
def test_matches_reference_and_conserves(items, w, engine):
    p = plan_owners(items, w, engine=engine)
    cost, owners = _reference(items, w, engine)
    names = [it.name for it in items]

    # Same straddling units, same owners, same costs as the brute-force greedy.
    got = {(names.index(u.tensor), u.start): (u.owner, u.numel) for u in p.straddling_units()}
    assert got == {k: (o, n) for k, (o, n, _) in owners.items()}
    assert p.cost_per_rank.tolist() == cost
    assert p.cost_per_rank.sum() == pytest.approx(sum(it.cost for it in items))

    # Every owner ends up with the whole unit: what it holds + what it receives == unit numel.
    send = np.zeros(w, dtype=np.int64)
    recv = np.zeros(w, dtype=np.int64)
    for i, u in enumerate(p.straddling_units()):
        pieces = dict(p.unit_pieces(i))
        assert pieces == owners[(names.index(u.tensor), u.start)][2]
        assert sum(pieces.values()) == u.numel
        received = sum(v for r, v in pieces.items() if r != u.owner)
        assert received + pieces.get(u.owner, 0) == u.numel
        recv[u.owner] += received
        for r, v in pieces.items():
            if r != u.owner:
                send[r] += v
    assert p.send_numel_per_rank.tolist() == send.tolist()
    assert p.recv_numel_per_rank.tolist() == recv.tolist()
    assert p.send_numel_per_rank.sum() == p.recv_numel_per_rank.sum()

    # all_to_all splits agree across ranks and with the per-rank totals; self entries are 0.
    splits = [p.all_to_all_splits(r) for r in range(w)]
    for r in range(w):
        inp, out = splits[r]
        assert inp[r] == out[r] == 0
        assert sum(inp) == p.send_numel_per_rank[r] and sum(out) == p.recv_numel_per_rank[r]
        for d in range(w):
            assert inp[d] == splits[d][1][r]

    # Deterministic and serializable.
    again = plan_owners(list(items), w, engine=engine)
    assert json.dumps(again.to_json()) == json.dumps(p.to_json())
