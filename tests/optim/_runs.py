"""Block-structured optimizers on the ragged engine and on one process (for test_invariance.py).

The engine places whole compute units (``policy="whole"``), so unmodified optimizers over the
local pieces compute what they compute on one process; owner-compute is _owner_runs.py's.

Every rank sees the whole batch (docs/design.md, "Sharding invariance"): averaging identical
gradients is exact at W in {2, 4}, so any difference from one process comes from how the tensors
were cut.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # spawned ranks import this module
from _average import average_of
from _unchecked import unchecked

STEPS = 3


def model(seed: int = 0) -> nn.Module:
    """Odd shapes: 97 x 256 and 256 x 67 weights are multiples of 256 (torchao quantizes them),
    67 x 300 is not; biases of 256, 67 and 300 stay in fp32 state everywhere (< 4096)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Sequential(nn.Linear(97, 256), nn.GELU()),
            nn.Sequential(nn.Linear(256, 67), nn.GELU()),
            nn.Linear(67, 300),
        )


def batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 97, generator=g), torch.randn(16, 300, generator=g)) for _ in range(STEPS)]


def make_optimizers(name: str, params: list[nn.Parameter]) -> list[torch.optim.Optimizer]:
    params = [p for p in params if p.numel() > 0]  # ranks may hold an empty piece of a tensor
    if name == "muon":  # Muon on matrices, AdamW on the rest (Keller Jordan's recipe)
        mats = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        opts = [torch.optim.Muon(mats, lr=0.02)] if mats else []
        return opts + ([torch.optim.AdamW(rest, lr=1e-3)] if rest else [])
    if name == "bnb8bit":
        import bitsandbytes as bnb

        return [bnb.optim.AdamW8bit(params, lr=1e-3)]
    if name == "ao8bit":
        from torchao.optim import AdamW8bit

        return [AdamW8bit(params, lr=1e-3)]
    if name == "shampoo":
        from blockshard.optim import BlockedShampoo

        return [BlockedShampoo(params, lr=1e-2, max_preconditioner_dim=32)]
    raise ValueError(name)


SEMANTICS = {"muon": "matrix", "bnb8bit": "bnb8bit", "ao8bit": "ao8bit", "shampoo": "shampoo:32"}


def _train(m: nn.Module, opts: list[torch.optim.Optimizer], averaged_over: int = 1) -> None:
    for x, y in batches():
        ((m(x) - y) ** 2).mean().backward()
        if averaged_over > 1:
            for p in m.parameters():
                if p.grad is not None:
                    average_of(averaged_over, p.grad)
        for o in opts:
            o.step()
            o.zero_grad()


def reference(_rank: int, _world: int, name: str, averaged_over: int = 1) -> dict:
    """One process; ``averaged_over=W``: with each gradient averaged as W ranks average it."""
    m = model()
    _train(m, make_optimizers(name, list(m.parameters())), averaged_over)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def sharded(rank: int, world: int, name: str, semantics: str | None) -> dict:
    """``semantics=None``: the optimizer's own block semantics; otherwise a control."""
    import blockshard

    m = model()
    sem = SEMANTICS[name] if semantics is None else semantics
    rules = {"*weight": sem, "*bias": "elementwise" if name == "muon" else sem}
    for block in (m[0], m[1]):  # whole compute units: the optimizers step unmodified pieces
        blockshard.fully_shard(block, semantics=rules, policy="whole")
    blockshard.fully_shard(m, semantics=rules, policy="whole")
    try:
        with unchecked(semantics is not None):  # a control: what stock-style sharding computes
            _train(m, make_optimizers(name, list(m.parameters())))
    except Exception as exc:  # a control may not even run; a failing real case fails the test
        if semantics is None:  # (swallowed on some ranks only, the others would wait in the next collective)
            raise
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"params": blockshard.full_state_dict(m), "shapes": [tuple(p.shape) for p in m.parameters()]}


def sharded_cases(rank: int, world: int, cases: tuple) -> dict:
    """Several (optimizer, semantics) runs in one process: imports and compiles happen once."""
    return {case: sharded(rank, world, *case) for case in cases}


def references(_rank: int, _world: int, names: tuple, averaged_over: int = 1) -> dict:
    return {name: reference(0, 1, name, averaged_over) for name in names}


def resume(rank: int, world: int, name: str) -> dict:
    """Train 1 step, save model pieces + optimizer state, rebuild, load, train the rest."""
    import blockshard

    def build():
        m = model()
        rules = {"*weight": SEMANTICS[name], "*bias": "elementwise" if name == "muon" else SEMANTICS[name]}
        for block in (m[0], m[1]):
            blockshard.fully_shard(block, semantics=rules, policy="whole")
        blockshard.fully_shard(m, semantics=rules, policy="whole")
        return m, make_optimizers(name, list(m.parameters()))

    return blockshard.full_state_dict(resumed_after_one_step(build, batches()))


def resumed_after_one_step(build, data) -> nn.Module:
    """``build()`` -> (sharded model, optimizers): train on ``data[0]``, save the model pieces and
    the optimizers' state, build afresh, load, train on the rest; return the resumed model."""
    import io

    import blockshard
    from blockshard.runtime import load_sharded_state_dict

    m, opts = build()
    x, y = data[0]
    ((m(x) - y) ** 2).mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": blockshard.sharded_state_dict(m), "optim": [o.state_dict() for o in opts]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    m, opts = build()
    load_sharded_state_dict(m, saved["model"])
    for o, sd in zip(opts, saved["optim"], strict=True):
        o.load_state_dict(sd)
    for x, y in data[1:]:
        ((m(x) - y) ** 2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return m


def resume_cases(rank: int, world: int, names: tuple) -> dict:
    return {name: resume(rank, world, name) for name in names}
