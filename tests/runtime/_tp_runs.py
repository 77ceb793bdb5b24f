"""Tensor-parallel runs for test_tensor_parallel.py: 4 spawned gloo ranks as a (dp=2, tp=2) mesh.

The model is torchtitan's recipe in small: a replicated input projection, two blocks whose ``up``
is ``ColwiseParallel`` and ``down`` ``RowwiseParallel`` on ``mesh["tp"]`` (their weights and ``up``'s
bias ``Shard``, ``down``'s bias ``Replicate``), a replicated head; ``fully_shard`` on each block,
then the root, over ``mesh["dp"]`` ([Note: tensor-parallel parameters]). Each dp rank trains on
its half of every batch (both tp ranks of a dp rank on the same half)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

STEPS = 3
BATCH = 8
SEQ = 4  # the sequence dim sequence parallelism shards


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_model() -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, SEQ, 12, generator=g), torch.randn(BATCH, SEQ, 6, generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, dp_rank: int | None, *, gas: int = 1, clip: Any = None) -> list[float]:
    """AdamW over ``model``'s parameters; ``dp_rank``: this dp rank's half of each batch (None: the
    whole batch, one process). ``gas``: micro-batches per step, gradient sync on the last only.
    ``clip(model) -> float``: called before each step, its norms returned."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms = []
    for x, y in batches():
        if dp_rank is not None:
            x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        for i, (xm, ym) in enumerate(zip(x.chunk(gas), y.chunk(gas), strict=True)):
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(i == gas - 1)
            (((model(xm) - ym) ** 2).mean() / gas).backward()
        if clip is not None:
            norms.append(clip(model))
        opt.step()
        opt.zero_grad()
    return norms


def reference(_rank: int, _world: int) -> dict[str, dict[str, torch.Tensor]]:
    """One process, the whole batch: plain, and clipped by torch's clip_grad_norm_."""
    out = {}
    for clip in (False, True):
        model = make_model()
        _train(
            model,
            None,
            clip=(lambda m: float(torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))) if clip else None,
        )
        out["clip" if clip else "plain"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _plan(sp: bool) -> dict[str, Any]:
    """The blocks' TP plan; ``sp``: torchtitan's sequence parallelism around it (the block's input and
    output sequence-sharded, its norm ``SequenceParallel``: a replicated weight whose gradient is
    ``Partial`` over tp)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sp:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {
        "": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


class _Gathered(nn.Module):
    """The block's sequence-sharded output made whole again (the residual stream outside is plain)."""

    def forward(self, x: Any) -> torch.Tensor:
        from torch.distributed.tensor import Replicate

        return x.redistribute(placements=[Replicate()]).to_local()


def _parallel(
    engine: str,
    mp: bool = False,
    semantics: object = None,
    sp: bool = False,
    policy: str | None = None,
    offload: bool = False,
    quantized_gather: bool = False,
) -> tuple[nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as stock_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import blockshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = make_model()
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], _plan(sp))
        if sp:
            b.register_forward_hook(lambda _m, _i, out: _Gathered()(out))
    kw: dict[str, Any] = {"mesh": mesh["dp"]}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if engine == "stock":
        shard: Any = stock_fully_shard
    else:
        shard = blockshard.fully_shard
        if semantics is not None:
            kw["semantics"] = semantics
        if policy is not None:
            kw["policy"] = policy
        if quantized_gather:
            kw["quantized_gather"] = True
    for b in model.blocks:
        shard(b, **kw)
    shard(model, **kw)
    return model, mesh


def _full(model: nn.Module, engine: str) -> dict[str, torch.Tensor]:
    """Every parameter's whole global value in its own dtype, on every rank (blockshard's
    ``full_state_dict`` gathers a TP parameter over dp, then tp)."""
    import blockshard

    if engine == "stock":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return dict(blockshard.full_state_dict(model))


MAX_NORM = 0.5  # below every step's norm (about 1.3): every step clips


def _params(model: nn.Module, engine: str) -> dict[str, torch.Tensor]:
    """:func:`_full` of a sharded model; a one-process ("single") model's own parameters."""
    if engine == "single":
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    return _full(model, engine)


def _stock_norm(model: nn.Module) -> float:
    """The global norm of the whole gradients (torch's clip_grad_norm_ cannot stack the norms of stock
    FSDP2's DTensors on the 2-D and the 1-D mesh together)."""
    return float(torch.stack([p.grad.full_tensor().norm() for p in model.parameters()]).norm())


def _stock_clip(model: nn.Module) -> float:
    """Clip by :func:`_stock_norm`, scaled as torch scales."""
    total = torch.tensor(_stock_norm(model))
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0).item()
    for p in model.parameters():
        p.grad.mul_(coef)
    return float(total)


def _blockshard_clip(model: nn.Module, max_norm: float = MAX_NORM) -> float:
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def _dp_only_norm(model: nn.Module) -> float:
    """The control: the norm of the pieces summed over dp alone, as if TP-sharded pieces were whole."""
    import torch.distributed as dist

    from blockshard.runtime.core._inspect import states_under

    total = torch.zeros(())
    for _, st in states_under(model):
        part = sum(
            (sp.sharded.grad.float().pow(2).sum() for sp in st.buffers.params if sp.sharded.grad is not None),
            torch.zeros(()),
        )
        dist.all_reduce(part, group=st.buffers.process_group)
        total += part
    return float(total.sqrt())


def run(
    rank: int,
    _world: int,
    engine: str,
    *,
    mp: bool = False,
    gas: int = 1,
    clip: bool = False,
    sp: bool = False,
    offload: bool = False,
) -> dict:
    from torch.distributed.tensor import DTensor

    model, mesh = _parallel(engine, mp, sp=sp, offload=offload)
    dp_rank = mesh["dp"].get_local_rank()
    norm = (_stock_clip if engine == "stock" else _blockshard_clip) if clip else None
    dp_only: list[float] = []
    if clip and engine == "blockshard":
        norm = lambda m: (dp_only.append(_dp_only_norm(m)), _blockshard_clip(m))[1]  # noqa: E731
    norms = _train(model, dp_rank, gas=gas, clip=norm)
    out: dict[str, Any] = {"params": _full(model, engine), "norms": norms, "dp_only_norms": dp_only}
    if engine == "blockshard":
        block = model.blocks[0]

        def seen() -> dict[str, tuple[str, str, tuple[int, ...]]]:
            return {
                n: (type(p).__name__, repr(tuple(p.placements)) if isinstance(p, DTensor) else "", tuple(p.shape))
                for n, p in block.named_parameters()
            }

        out["pieces"] = seen()  # between steps: plain pieces of the TP-local tensors
        block.unshard()  # as in forward and backward: the DTensors over the gathered TP-local tensors
        out["unsharded"] = seen()
        block.reshard()
        from blockshard.runtime.core._inspect import states_under

        out["offloaded"] = [b.offload for _, st in states_under(model) for b in st.param_buffers]
    return out


LR, MUON_LR = 1e-2, 2e-2


def _shadows(named: list[tuple[str, Any]]) -> dict[str, list[nn.Parameter]]:
    """The reference's plain copies of Muon's matrices: one per 2-D weight, one per expert of a
    stacked ``(E, m, n)`` tensor (torch's Muon takes matrices)."""
    out = {}
    for n, p in named:
        whole = p.full_tensor().detach()
        out[n] = [nn.Parameter(m.clone()) for m in (whole if whole.ndim == 3 else [whole])]
    return out  # (1-D tensors too: one copy each)


def _muon_step_whole(named: list[tuple[str, Any]], shadows: dict[str, list[nn.Parameter]], muon: Any) -> None:
    """The reference's step on stock FSDP2's DTensors: ``muon`` (torch's Muon, or another optimizer over
    the copies) on each whole matrix (values and gradient gathered across dp and tp / ep), its new value
    put back in the parameter's placements."""
    from torch.distributed.tensor import DTensor, Replicate

    for n, p in named:
        values, grads = p.full_tensor(), p.grad.full_tensor()
        for k, sh in enumerate(shadows[n]):
            sh.data.copy_(values[k] if values.ndim == 3 else values)
            sh.grad = grads[k] if grads.ndim == 3 else grads
    muon.step()
    with torch.no_grad():
        for n, p in named:
            new = torch.stack([sh.detach() for sh in shadows[n]]) if p.ndim == 3 else shadows[n][0].detach()
            whole = DTensor.from_local(new, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.to_local().copy_(whole.redistribute(placements=p.placements).to_local())


#: The blocks' ``up`` / ``down`` declared fused weights of two parts ([Note: fused parts]), stated for
#: the TP-local (16, 16) matrices: part i of the global matrix is part i of each tp rank's
PARTS_SEMANTICS = "muon,*up.weight=parts:8:8,*down.weight=parts:8:8"


def _part_rows(name: str, p: Any) -> list[torch.Tensor]:
    """The rows of the global matrix (``p``: the DTensor parameter) each part holds (the reference's view
    of [Note: fused parts]): ``up`` (``Shard(0)``): rows ``8i..8i+8`` of each tp rank's 16; ``down``
    (``Shard(1)``): rows ``8i..8i+8``."""
    if not name.endswith(("up.weight", "down.weight")):
        return [torch.arange(p.shape[0])]
    tp = p.device_mesh.size(p.device_mesh.ndim - 1) if name.endswith("up.weight") else 1
    local = p.shape[0] // tp
    return [torch.cat([torch.arange(r * local + 8 * i, r * local + 8 * i + 8) for r in range(tp)]) for i in range(2)]


def _muon_step_parts(named: list[tuple[str, Any]], shadows: dict[str, list[nn.Parameter]], muon: Any) -> None:
    """As :func:`_muon_step_whole`, torch's Muon on each part of the whole matrices (rows gathered)."""
    from torch.distributed.tensor import DTensor, Replicate

    for n, p in named:
        values, grads = p.full_tensor(), p.grad.full_tensor()
        for rows, sh in zip(_part_rows(n, p), shadows[n], strict=True):
            sh.data.copy_(values[rows])
            sh.grad = grads[rows]
    muon.step()
    with torch.no_grad():
        for n, p in named:
            new = p.full_tensor()
            for rows, sh in zip(_part_rows(n, p), shadows[n], strict=True):
                new[rows] = sh.detach()
            whole = DTensor.from_local(new, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.to_local().copy_(whole.redistribute(placements=p.placements).to_local())


def run_muon(rank: int, _world: int, engine: str) -> dict[str, Any]:
    """Muon on the 2-D hidden matrices (``muon_param_groups``), AdamW on the rest, 3 steps.
    ``engine``: "blockshard" (``semantics="muon"``, :class:`blockshard.optim.Muon`), "stock" (stock
    FSDP2 with the same TP plan, Muon on each matrix gathered whole: the reference), "single" (one
    process, torch's Muon), or "per_shard" (the control: blockshard with torch's Muon on each TP-local
    matrix, the optimizer checks off). "parts" / "parts_stock": the blocks' matrices declared fused
    weights of two parts (:data:`PARTS_SEMANTICS`): blockshard, and stock with torch's Muon on each
    part of the whole matrix (the reference)."""
    import os

    import blockshard
    from blockshard.optim import muon_param_groups

    if engine == "single":
        model: nn.Module = make_model()
        mesh = None
    else:
        stock = engine in ("stock", "parts_stock")
        sem = None if stock else PARTS_SEMANTICS if engine == "parts" else "muon"
        policy = "owner" if engine == "owner" else None  # owner: TP-local matrices cut over dp, owner-computed
        model, mesh = _parallel("stock" if stock else "blockshard", semantics=sem, policy=policy)
    muon_group, rest = muon_param_groups(model)
    adamw = torch.optim.AdamW(rest["params"], lr=LR, weight_decay=0.1)
    named = list(zip(muon_group["param_names"], muon_group["params"], strict=True))
    shadows: dict[str, list[nn.Parameter]] = {}
    if engine in ("blockshard", "owner", "parts"):
        muon: Any = blockshard.optim.Muon([muon_group], lr=MUON_LR)
    elif engine == "stock":
        shadows = _shadows(named)
        muon = torch.optim.Muon([sh for v in shadows.values() for sh in v], lr=MUON_LR)
    elif engine == "parts_stock":
        shadows = {n: [nn.Parameter(torch.empty(len(r), p.shape[1])) for r in _part_rows(n, p)] for n, p in named}
        muon = torch.optim.Muon([sh for v in shadows.values() for sh in v], lr=MUON_LR)
    else:
        muon = torch.optim.Muon(muon_group["params"], lr=MUON_LR)
    if engine == "per_shard":
        os.environ["BLOCKSHARD_OPTIMIZER_CHECKS"] = "0"
    stock_engine = engine in ("stock", "parts_stock")
    try:
        dp_rank = None if mesh is None else mesh["dp"].get_local_rank()
        for x, y in batches():
            if dp_rank is not None:
                x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
            ((model(x) - y) ** 2).mean().backward()
            if engine == "stock":
                _muon_step_whole(named, shadows, muon)
            elif engine == "parts_stock":
                _muon_step_parts(named, shadows, muon)
            else:
                muon.step()
            adamw.step()
            muon.zero_grad() if not stock_engine else None
            adamw.zero_grad()
            for _, p in named:
                p.grad = None
    finally:
        os.environ.pop("BLOCKSHARD_OPTIMIZER_CHECKS", None)
    params = {n: p.detach().clone() for n, p in model.named_parameters()} if mesh is None else None
    counts = muon.collective_counts() if engine in ("blockshard", "owner", "parts") else []
    return {
        "params": params if params is not None else _full(model, "stock" if stock_engine else "blockshard"),
        "muon_names": list(muon_group["param_names"]),
        "counts": [(c.kind, c.calls, c.bytes, c.ranks) for c in counts],
    }


def refusals(_rank: int, _world: int) -> dict[str, str]:
    """The messages of what a TP group refuses."""
    from blockshard.optim import muon_param_groups
    from blockshard.runtime import ShardingError

    out = {}
    try:
        _parallel("blockshard", semantics="bnb8bit")  # a (32, 16) weight is one 8-bit block: a tp cut splits it
    except ShardingError as e:
        out["bnb8bit"] = str(e)
    import blockshard

    model, _ = _parallel("blockshard", semantics="muon")
    try:
        blockshard.sharded_state_dict(model)  # LocalShards say a run of the tensor, not its place across tp
    except ShardingError as e:
        out["sharded_state_dict"] = str(e)
    opt = torch.optim.Muon(muon_param_groups(model)[0]["params"], lr=MUON_LR)
    model(batches()[0][0]).sum().backward()
    try:
        opt.step()
    except ShardingError as e:
        out["torch_muon"] = str(e)
    from blockshard.optim import BlockedShampoo

    model, _ = _parallel("blockshard", semantics="shampoo:8", policy="whole")  # tp keeps 8 x 8 tiles whole, not 32
    shampoo = BlockedShampoo(model.parameters(), lr=LR, max_preconditioner_dim=32)
    model(batches()[0][0]).sum().backward()
    try:
        shampoo.step()
    except ShardingError as e:
        out["shampoo_32"] = str(e)
    try:
        _parallel("blockshard", semantics="shampoo:32")
    except ShardingError as e:
        out["shampoo_32_semantics"] = str(e)
    try:
        _parallel("blockshard", semantics="*up.weight=fp8_block:8", quantized_gather=True)
    except ShardingError as e:
        out["quantized_gather"] = str(e)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_model()  # TP on mesh["tp"], then fully_shard without mesh=: over every rank, tp ranks included
    parallelize_module(
        model.blocks[0], init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"], _plan(False)
    )
    try:
        blockshard.fully_shard(model.blocks[0])
    except ShardingError as e:
        out["world_mesh"] = str(e)
    return out


def cases(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every 4-rank run of the tests, in one spawn (``directory``: where the checkpoints go)."""
    out: dict[str, Any] = {"checkpoints": checkpoints(rank, world, directory)}
    out["bnb_checkpoints"] = bnb_checkpoints(rank, world, directory)
    out["ao_checkpoints"] = ao_checkpoints(rank, world, directory)
    out["export"] = export(rank, world, directory)
    out["shampoo_checkpoints"] = shampoo_checkpoints(rank, world, directory)
    for engine in ("stock", "blockshard"):
        out[engine] = run(rank, world, engine)
        out[f"{engine}_gas2"] = run(rank, world, engine, gas=2)
        out[f"{engine}_bf16"] = run(rank, world, engine, mp=True)
        out[f"{engine}_clip"] = run(rank, world, engine, clip=True)
        out[f"{engine}_sp"] = run(rank, world, engine, sp=True)
        out[f"{engine}_offload"] = run(rank, world, engine, offload=True, mp=True, gas=2)
    out["refusals"] = refusals(rank, world)
    for engine in ("stock", "blockshard", "owner", "per_shard", "parts", "parts_stock"):
        out[f"muon_{engine}"] = run_muon(rank, world, engine)
    for engine in ("stock", "blockshard"):
        for optimizer in ("adamw", "muon"):
            out[f"ep_{engine}_{optimizer}"] = run_ep(rank, world, engine, optimizer)
        out[f"bnb_{engine}"] = run_bnb(rank, world, engine)
    for engine, dim in (("stock", 8), ("blockshard", 8), ("stock", 32), ("per_shard", 32)):
        out[f"shampoo_{engine}_{dim}"] = run_shampoo(rank, world, engine, dim)
    out["meta_init"] = meta_init(rank, world)
    return out


# -- checkpoints across (dp, tp) layouts ----------------------------------------------------------
def _layout(dp: int, tp: int) -> nn.Module:
    """The model on a (dp, tp) mesh of the 4 ranks: TP on ``mesh["tp"]`` where tp > 1, blockshard over dp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import blockshard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = make_model()
    for b in model.blocks:
        if tp > 1:
            parallelize_module(b, mesh["tp"], _plan(False))
        blockshard.fully_shard(b, mesh=mesh["dp"])
    blockshard.fully_shard(model, mesh=mesh["dp"])
    return model


def _steps(model: nn.Module, opt: Any, which: range) -> None:
    """Steps ``which`` of :func:`batches`, every rank the whole batch (so any dp gives one gradient)."""
    data = batches()
    for k in which:
        x, y = data[k]
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def checkpoints(rank: int, _world: int, directory: str) -> dict[str, Any]:
    """Save at (dp 2, tp 2) after 2 steps (model + AdamW, ``save_checkpoint``), then load at (2, 2),
    (4, 1) and (1, 4) (``dcp.load``; ``load_checkpoint`` for one) and take step 3; the uninterrupted run for comparison; a load without the optimizer
    state (the control). Then across engines: stock FSDP2 with the same TP plan saves through torch's
    ``get_state_dict``, blockshard loads with ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp

    import blockshard
    from blockshard.runtime import describe_checkpoint

    path = f"{directory}/blockshard"

    def state(model: nn.Module, opt: Any) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": blockshard.optimizer_state_dict(model, opt)}

    model = _layout(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _steps(model, opt, range(2))
    saved = blockshard.full_state_dict(model)
    blockshard.save_checkpoint(model, path, opt)  # DCP's files and blockshard.json (the TP placements)
    described = describe_checkpoint(path) if rank == 0 else None
    _steps(model, opt, range(2, 3))
    out: dict[str, Any] = {"saved": saved, "uninterrupted": blockshard.full_state_dict(model), "described": described}
    for dp, tp, with_optim in ((2, 2, True), (4, 1, True), (1, 4, True), (1, 4, False)):
        model = _layout(dp, tp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        if (dp, tp) == (1, 4) and with_optim:  # blockshard's checked load
            blockshard.load_checkpoint(model, path, opt)
        else:
            st = state(model, opt) if with_optim else {"model": model.state_dict()}
            dcp.load(st, checkpoint_id=path)
            model.load_state_dict(st["model"])
            if with_optim:
                blockshard.load_optimizer_state_dict(model, opt, st["optimizer"])
        loaded = blockshard.full_state_dict(model)
        _steps(model, opt, range(2, 3))
        key = f"dp{dp}_tp{tp}" + ("" if with_optim else "_model_only")
        out[key] = {"loaded": loaded, "resumed": blockshard.full_state_dict(model)}
    out["from_stock"] = _from_stock(f"{directory}/stock")
    return out


def export(rank: int, _world: int, directory: str) -> dict[str, Any]:
    """``blockshard.save_pretrained`` of a (dp 2, tp 2) model after 2 steps ([Note: tensor-parallel
    export]): what rank 0 reads back from the safetensors file, ``full_state_dict``, and the export
    loaded by ``blockshard.load_safetensors`` into fresh models at (2, 2), (4, 1) and (1, 4)."""
    from safetensors.torch import load_file

    import blockshard

    model = _layout(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    _steps(model, opt, range(2))
    path = f"{directory}/export"
    blockshard.save_pretrained(model, path)
    full = blockshard.full_state_dict(model)
    files = sorted(os.listdir(path)) if rank == 0 else []
    read = load_file(f"{path}/model-00001-of-00001.safetensors") if rank == 0 else {}
    loaded = {}
    for dp, tp in ((2, 2), (4, 1), (1, 4)):  # and back: each rank reads its piece of each tensor
        fresh = _layout(dp, tp)
        blockshard.load_safetensors(fresh, path)
        loaded[f"dp{dp}_tp{tp}"] = blockshard.full_state_dict(fresh)
    return {"full": full, "read": read, "files": files, "loaded": loaded}


def _from_stock(path: str) -> dict[str, Any]:
    """Stock FSDP2 + TP (dp 2, tp 2) saves after 2 steps with torch's ``get_state_dict``; blockshard at
    (2, 2) loads with ``set_state_dict`` and takes step 3, as stock does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import blockshard

    stock, _ = _parallel("stock")
    opt = torch.optim.AdamW(stock.parameters(), lr=LR, weight_decay=0.1)
    _steps(stock, opt, range(2))
    msd, osd = get_state_dict(stock, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = _full(stock, "stock")
    _steps(stock, opt, range(2, 3))
    uninterrupted = _full(stock, "stock")
    model = _layout(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    msd, osd = get_state_dict(model, opt)
    st = {"model": msd, "optim": osd}
    dcp.load(st, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    loaded = blockshard.full_state_dict(model)
    _steps(model, opt, range(2, 3))
    return {
        "saved": saved,
        "loaded": loaded,
        "uninterrupted": uninterrupted,
        "resumed": blockshard.full_state_dict(model),
    }


# -- 3-D: HSDP x TP -------------------------------------------------------------------------------
def hsdp_tp(rank: int, _world: int) -> dict[str, Any]:
    """8 ranks as (replicate 2, shard 2, tp 2): TP on ``mesh["tp"]``, then stock FSDP2's or
    blockshard's HSDP over ``mesh["replicate", "shard"]``; each of the 4 dp ranks a quarter of each
    batch; AdamW; the global gradient norm (blockshard's clip_grad_norm_, sums over shard and tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as stock_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    import blockshard

    out: dict[str, Any] = {}
    for engine in ("stock", "blockshard"):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        model = make_model()
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], _plan(False))
        shard: Any = stock_fully_shard if engine == "stock" else blockshard.fully_shard
        for b in model.blocks:
            shard(b, mesh=mesh["replicate", "shard"])
        shard(model, mesh=mesh["replicate", "shard"])
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        dp_rank = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
        norms = []
        for x, y in batches():
            x, y = x.chunk(4)[dp_rank], y.chunk(4)[dp_rank]
            ((model(x) - y) ** 2).mean().backward()
            norms.append(_stock_norm(model) if engine == "stock" else _blockshard_clip(model, 1e9))
            opt.step()
            opt.zero_grad()
        out[engine] = {"params": _full(model, engine), "norms": norms}
    return out


# -- expert parallelism ---------------------------------------------------------------------------
EXPERTS, D_MODEL, D_EXPERT = 4, 16, 8


class MixtralExperts(nn.Module):
    """Stacked expert weights ``(E, m, n)`` (the class name marks them: [Note: stacked experts])."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(EXPERTS, D_EXPERT, D_MODEL) * 0.2)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, D_MODEL, D_EXPERT) * 0.2)


class MoE(nn.Module):
    """A dense mixture (every token to every expert, weighted by the router's softmax). Under expert
    parallelism the experts are DTensors ``Shard(0)`` on the ep mesh and the layer runs in DTensor
    ops: each ep rank computes its experts, the weighted sum over experts is ``Partial`` over ep and
    made whole, and the input's and gates' gradients are summed over ep by DTensor's autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D_MODEL, EXPERTS)
        self.experts = MixtralExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        gates: Any = torch.softmax(self.router(x), dim=-1)
        w_in, w_out = self.experts.w_in, self.experts.w_out
        h: Any = x
        if isinstance(w_in, DTensor):
            h = DTensor.from_local(x, w_in.device_mesh, [Replicate()])
            gates = DTensor.from_local(gates, w_in.device_mesh, [Replicate()])
        hidden = torch.relu(torch.einsum("bd,ehd->beh", h, w_in))
        out: Any = torch.einsum("bed,be->bd", torch.einsum("beh,edh->bed", hidden, w_out), gates)
        return out.redistribute(placements=[Replicate()]).to_local() if isinstance(out, DTensor) else out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, D_MODEL)
        self.moe = MoE()
        self.head = nn.Linear(D_MODEL, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.moe(h))


def make_moe() -> MoENet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MoENet()


def run_ep(rank: int, _world: int, engine: str, optimizer: str) -> dict[str, Any]:
    """(dp 2, ep 2): the stacked experts ``Shard(0)`` over ep (``distribute_tensor``), then stock FSDP2
    or blockshard (``semantics="muon"``: per-expert grids) over dp; 3 steps of each dp rank's half of
    the batch. ``optimizer``: "adamw", or "muon" (Muon on the matrices and, per expert, the stacked
    experts; AdamW on the rest: ``blockshard.optim.Muon``, or for stock torch's Muon on each whole
    matrix gathered); "single" engine: one process (blockshard.optim.Muon steps unsharded experts
    per expert)."""
    import blockshard
    from blockshard.optim import muon_param_groups

    model: nn.Module = make_moe()
    dp_rank = None
    if engine != "single":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as stock_fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        experts = model.moe.experts
        for name in ("w_in", "w_out"):
            whole = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(whole, mesh["ep"], [Shard(0)])))
        kw: dict[str, Any] = {"mesh": mesh["dp"]}
        shard: Any = stock_fully_shard if engine == "stock" else blockshard.fully_shard
        if engine != "stock":
            kw["semantics"] = "muon"
        shard(model.moe, **kw)
        shard(model, **kw)
        dp_rank = mesh["dp"].get_local_rank()
    if optimizer == "adamw":
        opts: list[Any] = [torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)]
        named: list[tuple[str, Any]] = []
    else:
        muon_group, rest = muon_param_groups(model)
        named = list(zip(muon_group["param_names"], muon_group["params"], strict=True))
        if engine == "stock":
            shadows = _shadows(named)
            muon: Any = torch.optim.Muon([sh for v in shadows.values() for sh in v], lr=MUON_LR)
        else:
            muon = blockshard.optim.Muon([muon_group], lr=MUON_LR)
        opts = [torch.optim.AdamW(rest["params"], lr=LR, weight_decay=0.1)]
    for x, y in batches():
        if dp_rank is not None:
            x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        ((model(x[:, 0]) - y[:, 0]) ** 2).mean().backward()
        if optimizer == "muon":
            _muon_step_whole(named, shadows, muon) if engine == "stock" else muon.step()
        for o in opts:
            o.step()
            o.zero_grad()
        for _, p in named:
            p.grad = None
    return {"params": _params(model, engine), "muon_names": [n for n, _ in named]}


def references(rank: int, world: int) -> dict[str, Any]:
    """Every one-process reference, in one process: plain and clipped AdamW, Muon, and the MoE's
    AdamW and per-expert Muon."""
    out: dict[str, Any] = reference(rank, world)
    out["muon"] = run_muon(rank, world, "single")["params"]
    out["bnb"] = run_bnb(rank, world, "single")["params"]
    for optimizer in ("adamw", "muon"):
        out[f"ep_{optimizer}"] = run_ep(rank, world, "single", optimizer)["params"]
    return out


# -- 8-bit blocks across a tp cut -------------------------------------------------------------------
class WideBlock(nn.Module):
    """A block whose TP cuts fall between bitsandbytes' 256-element blocks and leave every shard
    8-bit (>= 4096 elements): ``up`` (512, 16) column-wise, ``down`` (16, 512) row-wise (each shard's
    rows 256 long), no biases."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 512, bias=False)
        self.down = nn.Linear(512, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def make_wide() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 16), WideBlock(), nn.Linear(16, 6))


def run_bnb(rank: int, _world: int, engine: str) -> dict[str, Any]:
    """bitsandbytes AdamW8bit, 3 steps, each dp rank half of each batch: "blockshard" (dp 2, tp 2,
    ``semantics="bnb8bit"``), "stock" (stock FSDP2 with the same TP plan, AdamW8bit stepping a copy of
    every whole tensor gathered: the reference), "single" (one process)."""
    import bitsandbytes as bnb

    import blockshard

    model = make_wide()
    dp_rank = None
    if engine != "single":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as stock_fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model[1], mesh["tp"], _plan(False))
        shard: Any = stock_fully_shard if engine == "stock" else blockshard.fully_shard
        kw: dict[str, Any] = {"mesh": mesh["dp"]} | ({"semantics": "bnb8bit"} if engine != "stock" else {})
        shard(model[1], **kw)
        shard(model, **kw)
        dp_rank = mesh["dp"].get_local_rank()
    named = list(model.named_parameters())
    shadows = _shadows(named) if engine == "stock" else {}
    params = [sh for v in shadows.values() for sh in v] if engine == "stock" else list(model.parameters())
    opt = bnb.optim.AdamW8bit(params, lr=LR, weight_decay=0.1)
    for x, y in batches():
        if dp_rank is not None:
            x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        ((model(x) - y) ** 2).mean().backward()
        if engine == "stock":
            _muon_step_whole(named, shadows, opt)  # the same gather-step-scatter, with AdamW8bit
        else:
            opt.step()
        opt.zero_grad()
        for _, p in named:
            p.grad = None
    return {"params": _params(model, engine), "state_dict": _state_dict_error(model, opt, engine)}


def bnb_checkpoints(rank: int, _world: int, directory: str) -> dict[str, Any]:
    """bitsandbytes AdamW8bit on :func:`make_wide` (``semantics="bnb8bit"``): saved at (dp 2, tp 2)
    after 2 steps (``save_checkpoint``: the 8-bit codes and each block's absmax placed in the global
    tensors), loaded at (2, 2) and (4, 1) (``load_checkpoint``), step 3; the (4, 1) load saved again
    and loaded at (2, 2), step 3; the uninterrupted run; a load without the optimizer state (the
    control). (At tp 4 each shard of ``up`` would hold 2048 elements,
    below bitsandbytes' 4096 for 8-bit state: ``fully_shard`` refuses that plan by name.)"""
    import bitsandbytes as bnb

    def make(dp: int, tp: int) -> tuple[nn.Module, Any]:
        model = _wide_sharded(dp, tp, "bnb8bit")
        return model, bnb.optim.AdamW8bit(model.parameters(), lr=LR, weight_decay=0.1)

    return _round_trips(make, f"{directory}/bnb", via_dp4=True)


def _wide_sharded(dp: int, tp: int, semantics: str) -> nn.Module:
    """:func:`make_wide` on a (dp, tp) mesh: torchtitan's TP plan on its block (tp > 1), then
    ``blockshard.fully_shard`` over dp with ``semantics``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import blockshard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = make_wide()
    if tp > 1:
        parallelize_module(model[1], mesh["tp"], _plan(False))
    blockshard.fully_shard(model[1], mesh=mesh["dp"], semantics=semantics)
    blockshard.fully_shard(model, mesh=mesh["dp"], semantics=semantics)
    return model


def ao_checkpoints(rank: int, _world: int, directory: str) -> dict[str, Any]:
    """torchao's AdamW8bit on :func:`make_wide` (``semantics="ao8bit"``: every piece of ``up`` and
    ``down`` holds whole 256-element blocks and at least 4096 elements, so torchao keeps its state
    8-bit): the round trips of :func:`bnb_checkpoints`, plus whether the TP-split weights' state was
    8-bit (``OptimState8bit``) when it was saved."""
    from torchao.optim import AdamW8bit

    def make(dp: int, tp: int) -> tuple[nn.Module, Any]:
        model = _wide_sharded(dp, tp, "ao8bit")
        params = [p for p in model.parameters() if p.numel() > 0]  # a rank may hold no piece of a tensor
        return model, AdamW8bit(params, lr=LR, weight_decay=0.1)

    out = _round_trips(make, f"{directory}/ao", via_dp4=True)
    model, opt = make(2, 2)
    _steps(model, opt, range(1))
    up = model[1].up.weight
    out["up_state"] = type(opt.state[up]["exp_avg"]).__name__ if up.numel() else "no piece"
    return out


def _round_trips(make: Any, path: str, via_dp4: bool = False) -> dict[str, Any]:
    """``make(dp, tp) -> (model, optimizer)`` trained 2 steps at (2, 2) and saved (``save_checkpoint``),
    then step 3 (``"uninterrupted"``); loaded at (2, 2) and (4, 1), step 3 (``"dp2_tp2"``, ``"dp4_tp1"``);
    loaded without the optimizer state (``"dp2_tp2_model_only"``). ``via_dp4``: the (4, 1) load saved
    again and loaded at (2, 2), step 3 there (``"via_dp4_tp1"``)."""
    import blockshard

    model, opt = make(2, 2)
    _steps(model, opt, range(2))
    blockshard.save_checkpoint(model, path, opt)
    _steps(model, opt, range(2, 3))
    out: dict[str, Any] = {"uninterrupted": blockshard.full_state_dict(model)}
    for dp, tp, with_optim in ((2, 2, True), (4, 1, True), (2, 2, False)):
        model, opt = make(dp, tp)
        blockshard.load_checkpoint(model, path, opt if with_optim else None)
        if via_dp4 and (dp, tp) == (4, 1):
            blockshard.save_checkpoint(model, f"{path}-dp4", opt)
            back, back_opt = make(2, 2)
            blockshard.load_checkpoint(back, f"{path}-dp4", back_opt)
            _steps(back, back_opt, range(2, 3))
            out["via_dp4_tp1"] = blockshard.full_state_dict(back)
        _steps(model, opt, range(2, 3))
        out[f"dp{dp}_tp{tp}" + ("" if with_optim else "_model_only")] = blockshard.full_state_dict(model)
    return out


def shampoo_checkpoints(rank: int, _world: int, directory: str) -> dict[str, Any]:
    """BlockedShampoo (8 x 8 tiles, preconditioning from step 1, ``semantics="shampoo:8"``): saved at
    (dp 2, tp 2) after 2 steps (``save_checkpoint``: each piece's per-tile state placed among the global
    tensor's tiles), loaded at (2, 2) and (4, 1), step 3; the (4, 1) load saved again and loaded at
    (2, 2), step 3; the uninterrupted run; a load without the optimizer state (the control)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import blockshard
    from blockshard.optim import BlockedShampoo

    def make(dp: int, tp: int) -> tuple[nn.Module, Any]:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = make_model()
        for b in model.blocks:
            if tp > 1:
                parallelize_module(b, mesh["tp"], _plan(False))
            blockshard.fully_shard(b, mesh=mesh["dp"], semantics="shampoo:8", policy="whole")
        blockshard.fully_shard(model, mesh=mesh["dp"], semantics="shampoo:8", policy="whole")
        opt = BlockedShampoo(model.parameters(), lr=LR, max_preconditioner_dim=8, start_preconditioning_step=1)
        return model, opt

    return _round_trips(make, f"{directory}/shampoo", via_dp4=True)


def _state_dict_error(model: nn.Module, opt: Any, engine: str) -> str | None:
    """What ``blockshard.optimizer_state_dict`` says of per-block state of TP-split pieces (refused)."""
    import blockshard
    from blockshard.runtime import CheckpointError

    if engine != "blockshard":
        return None
    try:
        blockshard.optimizer_state_dict(model, opt)
    except CheckpointError as e:
        return str(e)
    return "no error"


# -- Shampoo tiles across a tp cut ------------------------------------------------------------------
def run_shampoo(rank: int, _world: int, engine: str, dim: int) -> dict[str, Any]:
    """BlockedShampoo (``max_preconditioner_dim=dim``, preconditioning from step 1), 3 steps, each dp
    rank half of each batch: "blockshard" (dp 2, tp 2, ``semantics="shampoo:8"``: the TP-local ``up``
    (16, 16) and ``down`` (16, 16) hold whole 8 x 8 tiles, [Note: tiles across tp]), "stock" (stock FSDP2
    with the same TP plan, BlockedShampoo stepping a copy of every whole tensor gathered: the
    reference), "per_shard" (the control: blockshard with ``dim`` = 32, whose tiles the tp cut splits,
    the optimizer checks off: Shampoo on each TP-local matrix)."""
    import os

    from blockshard.optim import BlockedShampoo

    stock = engine == "stock"
    sem, policy = (None, None) if stock else ("shampoo:8", "whole")  # whole stripes on a rank: no owners
    model, mesh = _parallel("stock" if stock else "blockshard", semantics=sem, policy=policy)
    named = list(model.named_parameters())
    shadows = _shadows(named) if stock else {}
    params = [sh for v in shadows.values() for sh in v] if stock else [p for _, p in named]
    opt = BlockedShampoo(params, lr=LR, max_preconditioner_dim=dim, start_preconditioning_step=1)
    if engine == "per_shard":
        os.environ["BLOCKSHARD_OPTIMIZER_CHECKS"] = "0"
    try:
        dp_rank = mesh["dp"].get_local_rank()
        for x, y in batches():
            x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
            ((model(x) - y) ** 2).mean().backward()
            _muon_step_whole(named, shadows, opt) if stock else opt.step()
            opt.zero_grad()
            for _, p in named:
                p.grad = None
    finally:
        os.environ.pop("BLOCKSHARD_OPTIMIZER_CHECKS", None)
    return {
        "params": _params(model, "stock" if stock else "blockshard"),
        "state_dict": _state_dict_error(model, opt, engine),
    }


# -- meta-device init -----------------------------------------------------------------------------
def meta_init(rank: int, _world: int) -> dict[str, dict[str, torch.Tensor]]:
    """torchtitan's flow: the model built on the meta device, TP applied, then (dp 2, tp 2) sharded,
    ``to_empty`` and initialized (``blockshard.init_parameters``; stock FSDP2: ``reset_parameters`` on
    its sharded DTensors), against the TP model without dp sharding initialized the same way."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as stock_fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import blockshard

    out = {}
    for engine in ("tp_only", "stock", "blockshard"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Net()
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], _plan(False))
        if engine != "tp_only":
            shard: Any = stock_fully_shard if engine == "stock" else blockshard.fully_shard
            for b in model.blocks:
                shard(b, mesh=mesh["dp"])
            shard(model, mesh=mesh["dp"])
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        if engine == "blockshard":
            blockshard.init_parameters(model)
            out[engine] = dict(blockshard.full_state_dict(model))
            continue
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        out[engine] = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
        }
    return out
