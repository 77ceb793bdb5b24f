"""Training runs for tests/integrations/test_fsdp2.py: stock FSDP2 + the block-aware adapter.

Top-level functions so spawned ranks can import them. One spawn of 4 gloo ranks runs every
scenario at W = 4 (the world), W = 2 (ranks 0-1) and W = 3 (ranks 0-2) on sub-meshes, and the
single-process references (no process group) on rank 3 -- one spawn instead of four, since
starting ranks dominates the test time. Every rank gets the whole batch. ``seconds`` records each
scenario's time per rank: torchao's AdamW8bit ``torch.compile``s its step once per distinct shape
(seconds each on a cold inductor cache), so its models are small and share shapes where they can.
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
SHAMPOO_D, SHAMPOO_LR, AO_LR = 8, 1e-2, 1e-2
# BlockedShampoo's default epsilon (1e-12) lets the inverse 4th roots of the first steps' nearly
# singular 8 x 8 factors amplify W = 3's ulp gradient differences to 1.3e-3; 1e-8 keeps them at 3e-6.
SHAMPOO_EPS = 1e-8
SHAMPOO_SEMANTICS = f"shampoo:{SHAMPOO_D}"


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
            self.mix = nn.Parameter(torch.randn(5, 7) / 7**0.5)

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


class ShampooMLP(nn.Module):
    """12 -> 64 -> 37 -> 24 -> 5 (GELU): row counts whose torch.chunk boundaries fall on 8-row
    stripes at some W and off them at others (64: on at W = 2, 4; 24: on at W = 3; 37, 5: never)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(4)
            self.l1, self.l2 = nn.Linear(12, 64), nn.Linear(64, 37)
            self.l3, self.l4 = nn.Linear(37, 24), nn.Linear(24, 5)

    def forward(self, x):
        gelu = torch.nn.functional.gelu
        return self.l4(gelu(self.l3(gelu(self.l2(gelu(self.l1(x)))))))


def shampoo_batches(n: int, batch: int = 12):
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, 12, generator=gen), torch.randn(batch, 5, generator=gen)) for _ in range(n)]


class AoMLP(nn.Module):
    """256 -> [64 | 16] (GELU) -> 7, no biases: every distinct shape torchao steps is one more
    ``torch.compile`` (seconds on CPU), so the model is small and ``side.weight`` shares its shape
    with ``up.weight``'s W = 4 shard. ``up.weight`` (64 x 256) splits into whole 256-blocks of
    >= 4096 elements at W = 2, 3, 4 (aligned); ``side.weight`` (16 x 256 = 4096) has no cut leaving
    two >= 4096-element pieces (whole: owner-compute, 8-bit state on its owner); ``down.weight``
    (7 x 80) is below 4096 elements (whole: owner-compute, fp32 state as on one process)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(6)
            self.up, self.side, self.down = (
                nn.Linear(256, 64, bias=False),
                nn.Linear(256, 16, bias=False),
                nn.Linear(80, 7, bias=False),
            )

    def forward(self, x):
        gelu = torch.nn.functional.gelu
        return self.down(torch.cat([gelu(self.up(x)), gelu(self.side(x))], dim=-1))


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


def _shampoo(params):
    from blockshard.optim import BlockedShampoo

    return BlockedShampoo(params, lr=SHAMPOO_LR, max_preconditioner_dim=SHAMPOO_D, epsilon=SHAMPOO_EPS)


def _ao8bit(params):
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=AO_LR)


def reference_shampoo(steps: int = STEPS) -> dict:
    model = ShampooMLP()
    opt = _shampoo(model.parameters())
    for batch in shampoo_batches(steps):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return _full(model)


def reference_ao(steps: int = STEPS) -> dict:
    model = AoMLP()
    opt = _ao8bit(model.parameters())
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
    import blockshard
    from blockshard.integrations import fsdp2

    return {
        "params": _full(model),
        "owned": muon.owned_units(),
        "a2a": {dt: (e.send_sizes, e.recv_sizes) for dt, e in muon._exchanges.items()},
        "report": blockshard.report(model, optimizers=[muon, adamw]),  # a collective: every rank
        "placements": {n: (p.dim, p.semantics) for n, p in fsdp2.placements(model).items()},
        "counts": blockshard.collective_counts(model),
        "owner_counts": muon.collective_counts() + adamw.collective_counts(),
    }


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
    for o, sd in zip(opts, saved[0], strict=True):
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
                for v, (_, p) in zip(views, mats, strict=True):
                    v.grad = p.grad.to_local()
            muon.step(), adamw.step()
            muon.zero_grad(), adamw.zero_grad()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"params": _full(model)}


def bnb_owner(mesh, rows: int) -> dict:
    """bitsandbytes AdamW8bit through OwnerComputeOptimizer, ``bnb8bit`` placement."""
    import bitsandbytes as bnb

    from blockshard.integrations import fsdp2

    model = WideMLP(rows)
    _shard(model, mesh, "bnb8bit")
    placed = {n: (p.dim, p.owner_compute) for n, p in fsdp2.placements(model).items()}
    opt = fsdp2.OwnerComputeOptimizer(
        lambda g: bnb.optim.AdamW8bit(g, lr=BNB_LR), model.named_parameters(), semantics="bnb8bit"
    )
    for batch in wide_batches(STEPS):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    state = {
        pc.key: {k: str(v.dtype) for k, v in opt.inner.state[pc.tensor].items() if torch.is_tensor(v)}
        for pc in opt._pieces
    }
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
                for v, p in zip(views, params, strict=True):
                    v.grad = p.grad.to_local()
            opt.step()
            opt.zero_grad()
            model.zero_grad()
    except Exception as e:
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


def _state_kinds(opt) -> dict:
    """Compute tensor key -> {state name: dtype or tensor subclass} of the inner optimizer."""

    def kind(v):
        return type(v).__name__ if type(v) is not torch.Tensor else str(v.dtype)

    return {
        pc.key: {k: kind(v) for k, v in opt.inner.state[pc.tensor].items() if torch.is_tensor(v)}
        for pc in opt._pieces
        if pc.tensor in opt.inner.state
    }


def shampoo_owner(mesh) -> dict:
    """BlockedShampoo (``shampoo:8``) through OwnerComputeOptimizer under the adapter's placement."""
    from blockshard.integrations import fsdp2

    model = ShampooMLP()
    _shard(model, mesh, SHAMPOO_SEMANTICS, [model.l1, model.l2, model.l3])
    placed = {n: (p.dim, p.owner_compute) for n, p in fsdp2.placements(model).items()}
    opt = fsdp2.OwnerComputeOptimizer(_shampoo, model.named_parameters(), semantics=SHAMPOO_SEMANTICS)
    for batch in shampoo_batches(STEPS):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {
        "params": _full(model),
        "placements": placed,
        "owned": opt.owned_units(),
        "layout": [pc.key for pc in opt._pieces],
    }


def ao_owner(mesh) -> dict:
    """torchao AdamW8bit through OwnerComputeOptimizer, ``ao8bit`` placement."""
    from blockshard.integrations import fsdp2

    model = AoMLP()
    _shard(model, mesh, "ao8bit")
    placed = {n: (p.dim, p.owner_compute) for n, p in fsdp2.placements(model).items()}
    opt = fsdp2.OwnerComputeOptimizer(_ao8bit, model.named_parameters(), semantics="ao8bit")
    for batch in wide_batches(STEPS):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return {"params": _full(model), "placements": placed, "owned": opt.owned_units(), "state": _state_kinds(opt)}


def _stock_local(model, mesh, make_opt, batches, blocks=()) -> dict:
    """Control: stock fully_shard, ``make_opt`` on each rank's local shards (``to_local()`` views)."""
    from torch.distributed.fsdp import fully_shard

    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    try:
        views = [p.to_local().detach() for p in params]
        opt = make_opt(views)
        for batch in batches:
            _loss(model, batch).backward()
            for v, p in zip(views, params, strict=True):
                v.grad = p.grad.to_local()
            opt.step()
            opt.zero_grad()
            model.zero_grad()
        state = {
            tuple(v.shape): {
                k: type(x).__name__ if type(x) is not torch.Tensor else str(x.dtype)
                for k, x in opt.state[v].items()
                if torch.is_tensor(x)
            }
            for v in views
            if v in opt.state
        }
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"params": _full(model), "state": state}


def shampoo_stock(mesh) -> dict:
    model = ShampooMLP()
    return _stock_local(model, mesh, _shampoo, shampoo_batches(STEPS), [model.l1, model.l2, model.l3])


def ao_stock(mesh) -> dict:
    return _stock_local(AoMLP(), mesh, _ao8bit, wide_batches(STEPS))


def _placement_error(model, mesh, semantics) -> str:
    from blockshard.integrations.fsdp2 import FSDP2PlacementError

    try:
        _shard(model, mesh, semantics)
    except FSDP2PlacementError as e:
        return str(e)
    return "no error"


# -- the spawned entry point ------------------------------------------------------------------------
def _scenarios(mesh, w: int) -> dict:
    cases = {
        "muon": lambda: muon_owner(mesh),
        "muon_local": lambda: muon_stock(mesh, "local"),
        "shampoo": lambda: shampoo_owner(mesh),
        "ao": lambda: ao_owner(mesh),
    }
    if w in (2, 4):
        cases.update(
            {
                "muon_ckpt": lambda: muon_checkpoint(mesh),
                "muon_dtensor": lambda: muon_stock(mesh, "dtensor"),
                "muon_dtensor_mlp": lambda: muon_stock(mesh, "dtensor", mlp_only=True),
                "bnb": lambda: bnb_owner(mesh, 64),
                "bnb_stock_dtensor": lambda: bnb_stock(mesh, 64, "dtensor"),
                "shampoo_stock": lambda: shampoo_stock(mesh),
                "ao_stock": lambda: ao_stock(mesh),
            }
        )
    if w in (3, 4):
        cases["ao_misaligned_error"] = lambda: _placement_error(WideMLP(40), mesh, "ao8bit")
    if w == 4:
        cases["bnb_misaligned_error"] = lambda: bnb_misaligned(mesh, 40)
        cases["bnb_stock_misaligned"] = lambda: bnb_stock(mesh, 40, "local")
    out: dict = {"seconds": {}}
    for name, run in cases.items():
        t0 = time.perf_counter()
        out[name] = run()
        out["seconds"][name] = round(time.perf_counter() - t0, 2)
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
        refs = {
            "muon": reference_muon,
            "muon_mlp": lambda: reference_muon(mlp_only=True),
            "bnb": lambda: reference_bnb(64),
            "bnb40": lambda: reference_bnb(40),
            "shampoo": reference_shampoo,
            "ao": reference_ao,
        }
        out["ref"], out["ref_seconds"] = {}, {}
        for name, run in refs.items():
            t1 = time.perf_counter()
            out["ref"][name] = run()
            out["ref_seconds"][name] = round(time.perf_counter() - t1, 2)
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()
    return out


# -- a trainable parameter without a gradient: the counters' mismatch, tripped for real -------------
class UnusedHead(nn.Module):
    """A 16 -> 8 -> 1 MLP with a second head that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.unused = nn.Linear(16, 8), nn.Linear(8, 1), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def unused_param_run(rank: int, world: int) -> dict:
    """Under ``BLOCKSHARD_STRICT=1``: the control (the unused head frozen) trains two steps without a
    word; then, the head trainable, FSDP2's reduce-scatter leaves it out and the adapter's
    counter raises ``TrafficMismatchError`` in backward, on this rank (every rank does the same)."""
    import os

    from blockshard.integrations import fsdp2
    from blockshard.runtime import TrafficMismatchError

    os.environ["BLOCKSHARD_STRICT"] = "1"
    out: dict = {}
    for case in ("frozen", "trainable"):
        model = UnusedHead()
        model.unused.requires_grad_(case == "trainable")
        fsdp2.fully_shard(model, semantics="elementwise")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        t0 = time.perf_counter()
        try:
            for _ in range(2):
                model(torch.ones(4, 16)).sum().backward()
                opt.step(), opt.zero_grad()
            out[case] = "trained"
        except TrafficMismatchError as e:
            out[case] = str(e)
        out[f"{case}_seconds"] = time.perf_counter() - t0
    return out


def int_reshard_run(rank: int, world: int) -> list:
    """Blocks sharded with ``reshard_after_forward=2`` at W = 4 under ``BLOCKSHARD_STRICT=1``: the
    backward all-gathers within pairs of ranks, and every counter must still agree with the plan."""
    import os

    import blockshard
    from blockshard.integrations import fsdp2

    os.environ["BLOCKSHARD_STRICT"] = "1"
    model = ScaledMLP()
    for b in model.mlp.blocks:
        fsdp2.fully_shard(b, semantics="elementwise", root=model, reshard_after_forward=2)
    fsdp2.fully_shard(model, semantics="elementwise")
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    for batch in mlp_batches(STEPS, 12):
        _loss(model, batch).backward()
        opt.step(), opt.zero_grad()
    return blockshard.collective_counts(model)
