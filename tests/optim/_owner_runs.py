"""Owner-compute on the ragged engine and on one process (for test_owner_compute.py).

The model: one group ``0`` (a 96 x 40 and a 5 x 96 matrix, biases) where ``policy="auto"`` puts
the large matrix under ``owner`` and keeps the small one whole, and the root's 7 x 5 matrix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # spawned ranks import this module
from _unchecked import unchecked

STEPS = 3
BATCH = 12  # W = 3 splits it in 3 x 4
RULES = {"*weight": "matrix", "*bias": "elementwise"}
SHAMPOO_RULES = {"*": "shampoo:16"}
BNB_RULES = {"*": "bnb8bit"}


def model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Sequential(nn.Linear(40, 96), nn.GELU(), nn.Linear(96, 5)), nn.Linear(5, 7))


def batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 40, generator=g), torch.randn(BATCH, 7, generator=g)) for _ in range(STEPS)]


def _is_matrix(name: str) -> bool:
    return name.endswith("weight")  # by name, never by a local piece's ndim


def optimizers(name: str, named: list[tuple[str, nn.Parameter]], wrap: bool) -> list[torch.optim.Optimizer]:
    """``name``'s optimizers; ``wrap``: through OwnerComputeOptimizer (the sharded runs)."""
    from blockshard.optim import BlockedShampoo, Muon, OwnerComputeOptimizer

    def make(factory, params):
        return OwnerComputeOptimizer(factory, params) if wrap else factory([{"params": [p for _, p in params]}])

    if name == "muon":
        mats = [(n, p) for n, p in named if _is_matrix(n)]
        rest = [p for n, p in named if not _is_matrix(n) and p.numel()]
        adamw = torch.optim.AdamW(rest or [nn.Parameter(torch.zeros(1))], lr=1e-3)
        return [make(lambda g: torch.optim.Muon(g, lr=0.02), mats), adamw]
    if name == "bsmuon":  # momentum-sharded; one process's reference is torch's Muon ("muon")
        mats = [(n, p) for n, p in named if _is_matrix(n)]
        rest = [p for n, p in named if not _is_matrix(n) and p.numel()]
        adamw = torch.optim.AdamW(rest or [nn.Parameter(torch.zeros(1))], lr=1e-3)
        return [Muon(mats, lr=0.02), adamw]
    if name == "shampoo":
        return [make(lambda g: BlockedShampoo(g, lr=1e-2, max_preconditioner_dim=16), named)]
    if name == "bnb8bit":
        import bitsandbytes as bnb

        return [make(lambda g: bnb.optim.AdamW8bit(g, lr=1e-3), named)]
    raise ValueError(name)


RULES_OF = {"muon": RULES, "bsmuon": RULES, "shampoo": SHAMPOO_RULES, "bnb8bit": BNB_RULES}


def _train(m: nn.Module, opts, rank: int = 0, split: int = 1) -> None:
    for x, y in batches():
        n = BATCH // split
        ((m(x[rank * n : (rank + 1) * n]) - y[rank * n : (rank + 1) * n]) ** 2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()


def references(_rank: int, _world: int, names: tuple) -> dict:
    out = {}
    for name in names:
        m = model()
        _train(m, optimizers(name, list(m.named_parameters()), wrap=False))
        out[name] = {n: p.detach().clone() for n, p in m.named_parameters()}
    return out


def shard(m: nn.Module, rules, policy: str) -> None:
    import blockshard

    blockshard.fully_shard(m[0], semantics=rules, policy=policy)
    blockshard.fully_shard(m, semantics=rules, policy=policy)


def sharded(rank: int, world: int, name: str, policy: str, split: bool) -> dict:
    import blockshard
    from blockshard.runtime import owner_plan

    m = model()
    shard(m, RULES_OF[name], policy)
    plan = owner_plan(m)
    opts = optimizers(name, list(m.named_parameters()), wrap=True)
    _train(m, opts, rank if split else 0, world if split else 1)
    return {
        "params": blockshard.full_state_dict(m),
        "owner": sorted(plan),
        "owner_hash": next(iter(plan.values())).owner_hash if plan else None,
        "units": {n: t.units for n, t in plan.items()},
        "owned": opts[0].owned_units(),
        "a2a": {dt: (e.send_sizes, e.recv_sizes) for dt, e in opts[0]._exchanges.items()},
        "state_keys": sorted(pc.key for pc in opts[0]._pieces if pc.tensor in opts[0].inner.state),
        "state_numel": sum(
            v.numel() for st in opts[0].inner.state.values() for v in st.values() if torch.is_tensor(v) and v.ndim
        ),
        "matrix_numel": sum(p.numel() for n, p in m.named_parameters() if _is_matrix(n)),
    }


def control(rank: int, world: int) -> dict:
    """Plain torch Muon on row-sliced pieces (element-wise shards of whole rows): not one process's Muon."""
    import blockshard

    m = model()
    shard(m, {"*weight": "rows:1", "*bias": "elementwise"}, "whole")
    named = list(m.named_parameters())
    mats = [p for n, p in named if _is_matrix(n) and p.numel()]
    rest = [p for n, p in named if not _is_matrix(n) and p.numel()]
    opts = [torch.optim.Muon(mats, lr=0.02)] if mats else []
    opts.append(torch.optim.AdamW(rest or [nn.Parameter(torch.zeros(1))], lr=1e-3))
    with unchecked():  # the guard refuses Muon on a stripe: off, to show what it computes
        _train(m, opts)
    return {"params": blockshard.full_state_dict(m)}


def round_trip(rank: int, world: int) -> dict:
    """Train 1 step, save model pieces and optimizer state, rebuild, load, train the rest."""
    from _runs import resumed_after_one_step

    import blockshard

    def build():
        m = model()
        shard(m, RULES, "owner")
        return m, optimizers("muon", list(m.named_parameters()), wrap=True)

    return {"params": blockshard.full_state_dict(resumed_after_one_step(build, batches()))}


def other_plan(rank: int, world: int) -> str:
    """Rank 1 computes another owner plan: every rank raises, none hangs."""
    import blockshard.runtime.core._owners as api
    from blockshard.runtime import LayoutMismatchError

    if rank == 1:
        real = api.assign_owners

        def flipped(builder, running):
            a = real(builder, running)
            return type(a)(
                a.world_size, a.tensor_names, a.unit_tensor, a.unit_start, a.unit_numel, (a.unit_owner + 1) % world
            )

        api.assign_owners = flipped
    try:
        shard(model(), RULES, "owner")
    except LayoutMismatchError as e:
        return f"raised: {e}"
    return "no error"


def cases(rank: int, world: int, todo: tuple) -> dict:
    """Several runs in one spawn (imports happen once)."""
    out: dict = {}
    for case in todo:
        kind, *args = case
        out[case] = {"sharded": sharded, "control": control, "round_trip": round_trip, "other_plan": other_plan}[kind](
            rank, world, *args
        )
    return out


# -- what `blockshard plan` shows is what the engine runs -------------------------------------
#: The demo's tiny Llama: ``auto`` computes its MLP matrices at owners at W = 2 and 4.
LLAMA = dict(vocab_size=257, hidden_size=32, intermediate_size=777, num_hidden_layers=3)


def planned(world: int, policy: str) -> dict:
    """``plan_model``'s layouts and owner plan for :data:`LLAMA` (pure: no process group)."""
    from dataclasses import replace

    from blockshard.planner import plan_model, tensors_from_hf_config
    from blockshard.planner._owner import unit_rows

    config = {"model_type": "llama", "tie_word_embeddings": False, "num_attention_heads": 4, "num_key_value_heads": 2}
    specs = [replace(s, dtype="float32") for s in tensors_from_hf_config({**config, **LLAMA})]
    plan = plan_model(specs, world, semantics="muon", policy=policy)
    units: dict = {}
    assert plan.owners is not None
    for t, s, n, o in unit_rows(plan.owners):
        units.setdefault(plan.owners.tensor_names[t], []).append((s, n, o))
    return {
        "layouts": {g.name: g.layout_hash() for g in plan.groups},
        "units": {n: tuple(u) for n, u in units.items()},
        "owner_hash": plan.owners.owner_hash() if plan.owners.num_units else None,
    }


def engine_plan(rank: int, world: int, policy: str) -> dict:
    """The layouts and owner plan ``fully_shard`` built for :data:`LLAMA`; how many groups it
    re-based at another tensor ([Note: shifts]); and whether the shift kept every value."""
    from dataclasses import replace

    import blockshard
    import blockshard.runtime.core._owners as owners_mod
    from blockshard._tiny import tiny_llama
    from blockshard.runtime import group_layouts, owner_plan

    shifted = []
    real = owners_mod.apply_shifts

    def counting(what, named, builder):
        shifted.append(len(builder.shifted))
        return real(what, named, builder)

    owners_mod.apply_shifts = counting
    before = {n: p.detach().clone() for n, p in tiny_llama(**LLAMA).named_parameters()}
    m = tiny_llama(**LLAMA)
    for layer in m.model.layers:
        blockshard.fully_shard(layer, semantics="muon", policy=policy)
    blockshard.fully_shard(m, semantics="muon", policy=policy)
    layouts = {}
    for prefix, lay in group_layouts(m).items():
        full = tuple(replace(t, name=f"{prefix}.{t.name}" if prefix else t.name) for t in lay.tensors)
        layouts[prefix] = replace(lay, name=prefix, tensors=full).layout_hash()
    plan = owner_plan(m)
    after = blockshard.full_state_dict(m)
    return {
        "layouts": layouts,
        "units": {n: t.units for n, t in plan.items() if t.units},
        "owner_hash": next((t.owner_hash for t in plan.values() if t.units), None),
        "shifted": sum(shifted),
        "values_kept": all(torch.equal(after[n], p) for n, p in before.items()),
    }


def engine_plans(rank: int, world: int, policies: tuple) -> dict:
    return {p: engine_plan(rank, world, p) for p in policies}


# -- stacked experts under torch's Muon ---------------------------------------------------------
EXPERTS = (3, 24, 40)  # (E, m, n): the compute unit of `matrix` is each expert's 24 x 40 matrix


class Experts(nn.Module):
    """A stacked expert tensor ``(E, m, n)`` (a module class ending in ``Experts``: per-expert semantics)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*EXPERTS) / EXPERTS[2] ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bn,emn->bm", x, self.weight)


def experts_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Sequential(Experts(), nn.GELU()), nn.Linear(EXPERTS[1], 7))


def expert_batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, EXPERTS[2], generator=g), torch.randn(BATCH, 7, generator=g)) for _ in range(STEPS)]


def experts_reference(_rank: int, _world: int, per_expert: bool = True) -> dict:
    """One process: torch's Muon on each expert's matrix (2-D views of the stacked tensor, their
    gradients the views of its gradient); ``per_expert=False``, the control: Muon on the stack
    flattened to one ``(E * m, n)`` matrix."""
    m = experts_model()
    w = m[0][0].weight
    with torch.no_grad():
        views = [w[e] for e in range(EXPERTS[0])] if per_expert else [w.view(-1, EXPERTS[2])]
    muon = torch.optim.Muon([*views, m[1].weight], lr=0.02)
    adamw = torch.optim.AdamW([m[1].bias], lr=1e-3)
    for x, y in expert_batches():
        ((m(x) - y) ** 2).mean().backward()
        for v, g in zip(views, w.grad if per_expert else [w.grad.view(-1, EXPERTS[2])], strict=True):
            v.grad = g
        for o in (muon, adamw):
            o.step()
            o.zero_grad()
        w.grad = None  # the stacked tensor itself is in no optimizer
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def experts_sharded(rank: int, world: int, policy: str) -> dict:
    """OwnerComputeOptimizer around the unmodified torch Muon: per expert, cut experts at owners."""
    import blockshard
    from blockshard.optim import OwnerComputeOptimizer
    from blockshard.runtime import owner_plan

    m = experts_model()
    shard(m, {"*weight": "matrix", "*bias": "elementwise"}, policy)
    named = list(m.named_parameters())
    mats = [(n, p) for n, p in named if _is_matrix(n)]
    rest = [p for n, p in named if not _is_matrix(n) and p.numel()]
    opts = [
        OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=0.02), mats),
        torch.optim.AdamW(rest or [nn.Parameter(torch.zeros(1))], lr=1e-3),
    ]
    for x, y in expert_batches():
        ((m(x) - y) ** 2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    units = owner_plan(m)
    return {
        "params": blockshard.full_state_dict(m),
        "expert_units": [u[1] for u in units["0.0.weight"].units] if "0.0.weight" in units else [],
        "inner_shapes": sorted({tuple(p.shape) for g in opts[0].inner.param_groups for p in g["params"]}),
    }


def experts_cases(rank: int, world: int, policies: tuple) -> dict:
    return {p: experts_sharded(rank, world, p) for p in policies}


def plain_under_auto(rank: int, world: int) -> dict:
    """``policy="auto"`` (the default) with plain torch optimizers: AdamW on every piece is exact;
    torch's Muon on the pieces of the cut matrix refuses (torch on a flat run, blockshard's guard
    on a row stripe) rather than orthogonalizing a piece."""
    import math

    import blockshard
    from blockshard.runtime import global_shapes, owner_plan

    m = model()
    shard(m, RULES, "auto")
    adamw = torch.optim.AdamW([p for p in m.parameters() if p.numel()], lr=1e-3)
    _train(m, [adamw])
    out: dict = {"params": blockshard.full_state_dict(m), "owner": sorted(owner_plan(m))}
    m2 = model()
    shard(m2, RULES, "auto")
    full = {n: math.prod(s) for n, s in global_shapes(m2).items()}
    cut = [p for n, p in m2.named_parameters() if n in out["owner"] and 0 < p.numel() < full[n]]
    try:
        _train(m2, [torch.optim.Muon(cut, lr=0.02)])
    except Exception as exc:
        out["muon_error"] = f"{type(exc).__name__}: {exc}"
    return out


def adamw_reference(_rank: int, _world: int) -> dict:
    m = model()
    _train(m, [torch.optim.AdamW(list(m.parameters()), lr=1e-3)])
    return {n: p.detach().clone() for n, p in m.named_parameters()}
