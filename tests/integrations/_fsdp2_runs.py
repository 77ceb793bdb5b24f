"""Training runs for tests/integrations/test_fsdp2.py: stock FSDP2 + the block-aware adapter.

Top-level functions so spawned ranks can import them. One spawn of 4 gloo ranks runs every
scenario at W = 4 (the world), W = 2 (ranks 0-1) and W = 3 (ranks 0-2) on sub-meshes, and the
single-process references (no process group) on rank 3 -- one spawn instead of four, since
starting ranks dominates the test time. Every rank gets the whole batch.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn

from blockshard._tiny import OddMLP, mlp_batches

STEPS = 3
MUON_LR, ADAMW_LR, BNB_LR = 0.02, 1e-2, 1e-2


# -- models and data ----------------------------------------------------------------------------
class ScaledMLP(nn.Module):
    """OddMLP (weights 37x13, 29x37, 7x29: split by Shard(0)), a 1x7 scale (whole on rank 0 at any
    W) and a 5x7 mixing matrix (rows 2, 2, 1, 0 at W = 4: an empty shard in a split matrix)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = OddMLP()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.scale = nn.Parameter(1 + 0.1 * torch.randn(1, 7))
            self.mix = nn.Parameter(torch.randn(5, 7) / 7 ** 0.5)

    def forward(self, x):
        h = self.mlp(x)
        return h * self.scale + 0.1 * (h @ self.mix.T) @ self.mix


class WideMLP(nn.Module):
    """256 -> rows (GELU) -> 7: the first weight's rows hold 256 elements (one bnb block each)."""

    def __init__(self, rows: int = 64) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            self.up = nn.Linear(256, rows)
            self.down = nn.Linear(rows, 7)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def wide_batches(n: int, batch: int = 12):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 256, generator=gen), torch.randn(batch, 7, generator=gen)) for _ in range(n)]


def _loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def _full(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        t = p.detach()
        out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def _split(named, mlp_only: bool = False):
    """(Muon's parameters, AdamW's): the 2-D ones (``mlp_only``: only OddMLP's weights) and the rest."""
    named = list(named)
    muon = [(n, p) for n, p in named if p.ndim == 2 and (n.startswith("mlp.") or not mlp_only)]
    return muon, [(n, p) for n, p in named if all(p is not q for _, q in muon)]


# -- single-process references --------------------------------------------------------------------
def reference_muon(steps: int = STEPS, mlp_only: bool = False) -> dict:
    model = ScaledMLP()
    mats, rest = _split(model.named_parameters(), mlp_only)
    muon = torch.optim.Muon([p for _, p in mats], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for _, p in rest], lr=ADAMW_LR)
    for batch in mlp_batches(steps, 12):
        _loss(model, batch).backward()
        muon.step(), adamw.step()
        muon.zero_grad(), adamw.zero_grad()
    return _full(model)


def reference_bnb(rows: int, steps: int = STEPS) -> dict:
    import bitsandbytes as bnb

    model = WideMLP(rows)
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=BNB_LR)
    for batch in wide_batches(steps):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return _full(model)


# -- sharded runs ---------------------------------------------------------------------------------
def _shard(model, mesh, semantics, blocks=()):
    from blockshard.integrations import fsdp2

    for b in blocks:
        fsdp2.fully_shard(b, semantics=semantics, mesh=mesh, root=model)
    fsdp2.fully_shard(model, semantics=semantics, mesh=mesh)
    return model


def _muon_optimizers(model):
    from blockshard.integrations.fsdp2 import OwnerComputeOptimizer

    mats, rest = _split(model.named_parameters())
    muon = OwnerComputeOptimizer(lambda g: torch.optim.Muon(g, lr=MUON_LR), mats, semantics="matrix")
    adamw = OwnerComputeOptimizer(lambda g: torch.optim.AdamW(g, lr=ADAMW_LR), rest)
    return muon, adamw


def muon_owner(mesh, steps: int = STEPS) -> dict:
    """Muon (owner-compute) + AdamW under stock FSDP2 with the adapter's placement."""
    model = ScaledMLP()
    _shard(model, mesh, "muon", model.mlp.blocks)
    muon, adamw = _muon_optimizers(model)
    for batch in mlp_batches(steps, 12):
        _loss(model, batch).backward()
        muon.step(), adamw.step()
        muon.zero_grad(), adamw.zero_grad()
    return {"params": _full(model), "owned": muon.owned_units(),
            "a2a": {dt: (e.send_sizes, e.recv_sizes) for dt, e in muon._exchanges.items()}}


def muon_checkpoint(mesh, split: int = 2) -> dict:
    """``split`` steps, per-rank state dicts, a fresh model and optimizers load them, the rest."""
    batches = mlp_batches(STEPS, 12)
    model = ScaledMLP()
    _shard(model, mesh, "muon", model.mlp.blocks)
    opts = _muon_optimizers(model)
    for batch in batches[:split]:
        _loss(model, batch).backward()
        for o in opts:
            o.step(), o.zero_grad()
    saved = copy.deepcopy(([o.state_dict() for o in opts], model.state_dict()))
    del model, opts
    fresh = ScaledMLP()  # the initial weights: the load must replace them, owners included
    _shard(fresh, mesh, "muon", fresh.mlp.blocks)
    opts = _muon_optimizers(fresh)
    fresh.load_state_dict(saved[1])
    for o, sd in zip(opts, saved[0]):
        o.load_state_dict(sd)
    for batch in batches[split:]:
        _loss(fresh, batch).backward()
        for o in opts:
            o.step(), o.zero_grad()
    return _full(fresh)


def muon_stock(mesh, on: str, mlp_only: bool = False) -> dict:
    """Control: stock fully_shard and torch.optim.Muon on FSDP2's shards directly.

    ``on="local"``: Muon on each rank's local row slice (``to_local()`` views); ``on="dtensor"``:
    Muon on the DTensor parameters (DTensor runs Newton-Schulz with implicit collectives).
    ``mlp_only``: Muon only on OddMLP's weights (the scale and the mixing matrix go to AdamW).
    """
    from torch.distributed.fsdp import fully_shard

    model = ScaledMLP()
    for b in model.mlp.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mats, rest = _split(model.named_parameters(), mlp_only)
    try:
        if on == "local":
            views = [p.to_local().detach() for _, p in mats]
            muon = torch.optim.Muon(views, lr=MUON_LR)
        else:
            muon = torch.optim.Muon([p for _, p in mats], lr=MUON_LR)
        adamw = torch.optim.AdamW([p for _, p in rest], lr=ADAMW_LR)
        for batch in mlp_batches(STEPS, 12):
            _loss(model, batch).backward()
            if on == "local":
                for v, (_, p) in zip(views, mats):
                    v.grad = p.grad.to_local()
            muon.step(), adamw.step()
            muon.zero_grad(), adamw.zero_grad()
    except Exception as e:  # noqa: BLE001 - the control reports what stock does
        return {"error": f"{type(e).__name__}: {e}"}
    return {"params": _full(model)}


def bnb_owner(mesh, rows: int) -> dict:
    """bitsandbytes AdamW8bit through OwnerComputeOptimizer, ``bnb8bit`` placement."""
    import bitsandbytes as bnb

    from blockshard.integrations import fsdp2

    model = WideMLP(rows)
    _shard(model, mesh, "bnb8bit")
    placed = {n: (p.dim, p.owner_compute) for n, p in fsdp2.placements(model).items()}
    opt = fsdp2.OwnerComputeOptimizer(lambda g: bnb.optim.AdamW8bit(g, lr=BNB_LR), model.named_parameters(),
                                      semantics="bnb8bit")
    for batch in wide_batches(STEPS):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    state = {pc.key: {k: str(v.dtype) for k, v in opt.inner.state[pc.tensor].items() if torch.is_tensor(v)}
             for pc in opt._pieces}
    return {"params": _full(model), "placements": placed, "state_dtypes": state}


def bnb_stock(mesh, rows: int, on: str) -> dict:
    """Control: stock fully_shard + bnb AdamW8bit on the DTensor parameters or their local shards."""
    import bitsandbytes as bnb
    from torch.distributed.fsdp import fully_shard

    model = WideMLP(rows)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    try:
        views = [p.to_local().detach() for p in params] if on == "local" else params
        opt = bnb.optim.AdamW8bit(views, lr=BNB_LR)
        for batch in wide_batches(STEPS):
            _loss(model, batch).backward()
            if on == "local":
                for v, p in zip(views, params):
                    v.grad = p.grad.to_local()
            opt.step()
            opt.zero_grad()
            model.zero_grad()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"params": _full(model)}


def bnb_misaligned(mesh, rows: int) -> str:
    """The adapter's fully_shard on a bnb8bit weight whose Shard(0) cuts a block: the error text."""
    from blockshard.integrations.fsdp2 import FSDP2PlacementError

    try:
        _shard(WideMLP(rows), mesh, "bnb8bit")
    except FSDP2PlacementError as e:
        return str(e)
    return "no error"


# -- the spawned entry point ------------------------------------------------------------------------
def _scenarios(mesh, w: int) -> dict:
    out = {"muon": muon_owner(mesh), "muon_local": muon_stock(mesh, "local")}
    if w in (2, 4):
        out["muon_ckpt"] = muon_checkpoint(mesh)
        out["muon_dtensor"] = muon_stock(mesh, "dtensor")
        out["muon_dtensor_mlp"] = muon_stock(mesh, "dtensor", mlp_only=True)
        out["bnb"] = bnb_owner(mesh, 64)
        out["bnb_stock_dtensor"] = bnb_stock(mesh, 64, "dtensor")
    if w == 4:
        out["bnb_misaligned_error"] = bnb_misaligned(mesh, 40)
        out["bnb_stock_misaligned"] = bnb_stock(mesh, 40, "local")
    return out


def all_runs(rank: int, world: int) -> dict:
    """On 4 ranks: scenarios at W = 4, 2 and 3 (sub-meshes), references on rank 3."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    assert world == 4, world
    t0 = time.perf_counter()
    subgroups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2])}  # collective on all ranks
    out: dict = {"rank": rank, "by_w": {}}
    out["by_w"][4] = _scenarios(init_device_mesh("cpu", (4,)), 4)
    for w in (2, 3):
        if rank < w:
            out["by_w"][w] = _scenarios(DeviceMesh.from_group(subgroups[w], "cpu"), w)
    if rank == 3:  # no process group involved: one process, one thread, as the others
        out["ref"] = {"muon": reference_muon(), "muon_mlp": reference_muon(mlp_only=True), "bnb": reference_bnb(64), "bnb40": reference_bnb(40)}
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    return out
