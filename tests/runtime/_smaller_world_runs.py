"""Spawned runs for test_reshard_smaller_world.py: an int ``reshard_after_forward`` (FSDP2's smaller
world after forward, [Note: reshard to a smaller world] in blockshard/runtime/core/_post_forward.py)
on W = 4 gloo ranks, with blockshard and with stock FSDP2.

Each run trains a small transformer (a group per block and the root) a few AdamW steps and
returns what the test compares: the full parameters, the all-gathers of the first step by phase
and by the size of the group they ran over (read from the c10d ops themselves: output numel /
input numel), blockshard's own collective counts, and what a block's buffer set holds between
forward and backward.
"""

from __future__ import annotations

import copy

import _fsdp2_scenario_runs as scen
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

STEPS = 3
N_BLOCKS = 3


class GatherSizes(TorchDispatchMode):
    """The all-gathers issued in this process while active, as the size of the group each ran
    over (``_allgather_base_``: output numel / input numel); blockshard's headers left out."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from blockshard.runtime.core._collectives import issuing_header

        if func.namespace == "c10d" and func._opname == "_allgather_base_" and not issuing_header():
            out, inp = args[0], args[1]
            self.sizes.append(out.numel() // inp.numel())
        return func(*args, **(kwargs or {}))


class _Float64Linear(nn.Linear):
    """A frozen float64 linear inside a float32 model: computes in its weights' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype)).to(x.dtype)


def _model(seed: int = 42) -> nn.Module:
    torch.manual_seed(seed)
    return scen.Transformer(n_layers=N_BLOCKS)


def _full_initial() -> dict[str, torch.Tensor]:
    """The model's parameters before training, by name."""
    return {n: p.detach().clone() for n, p in _model().named_parameters()}


def _shard(engine: str, model: nn.Module, raf: object, root_raf: object, **kwargs: object) -> None:
    E = scen.Engine(engine)
    for layer in model.layers:
        E.fully_shard(layer, reshard_after_forward=raf, **kwargs)
    E.fully_shard(model, reshard_after_forward=root_raf, **kwargs)


def _full(engine: str, model: nn.Module) -> dict[str, torch.Tensor]:
    return scen.Engine(engine).full(model)


def _ids(step: int, rank: int) -> torch.Tensor:
    return scen._ids(10 * step + rank)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).float().pow(2).mean()


def train(rank: int, world: int, engine: str, raf: object, root_raf: object = None, variant: str = "plain") -> dict:
    """``STEPS`` AdamW steps; the first step's all-gathers by phase (forward, backward) as group sizes."""
    kwargs: dict[str, object] = {}
    if variant == "mp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif variant == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy()
    model = _model()
    if variant == "frozen_mixed":  # a frozen float64 buffer set beside each block's trainable one
        for layer in model.layers:
            old = layer.attention[1]
            new = _Float64Linear(scen.DIM, scen.DIM, dtype=torch.float64)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                new.bias.copy_(old.bias)
            layer.attention[1] = new.requires_grad_(False)
    ref = copy.deepcopy(model)
    _shard(engine, model, raf, root_raf, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    phases: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    for step in range(STEPS):
        with GatherSizes() as fwd:
            loss = _loss(model, _ids(step, rank))
        if step == 0 and engine == "blockshard":
            held = _held(model)
        with GatherSizes() as bwd:
            loss.backward()
        if step == 0:
            phases = {"forward": fwd.sizes, "backward": bwd.sizes}
        opt.step()
        opt.zero_grad()
    out: dict = {"params": _full(engine, model), "phases": phases, "held": held}
    if engine == "blockshard":
        import blockshard

        out["counts"] = [
            (c.group, c.buffer_set, c.kind, c.ranks, c.calls, c.bytes == c.predicted_bytes)
            for c in blockshard.collective_counts(model)
        ]
    if variant == "plain":
        out["reference"] = _reference(ref, world)
    return out


def _reference(ref: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """One process over every rank's inputs (the loss their mean: the ranks' average gradient)."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        (sum(_loss(ref, _ids(step, r)) for r in range(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _held(model: nn.Module) -> dict[str, int]:
    """Between forward and backward, over the blocks' buffer sets: the elements of the local shards
    (``S``), of the kept runs, and of the gathered storage still allocated."""
    from blockshard.runtime.core._state import state_of

    local = run = gathered = 0
    for layer in model.layers:
        st = state_of(layer)
        assert st is not None
        for b in st.param_buffers:
            local += b.local.numel()
            run += 0 if b._run is None else b._run.numel()
            gathered += b.gathered.untyped_storage().size() // b.gathered.element_size()
    return {"local": local, "run": run, "gathered": gathered}


def hsdp(rank: int, world: int, raf: object) -> dict:
    """HSDP over a (replicate=2, shard=4) mesh: the k-groups cut each replica's shard group."""
    from torch.distributed.device_mesh import init_device_mesh

    import blockshard

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = _model()
    for layer in model.layers:
        blockshard.fully_shard(layer, mesh=mesh, reshard_after_forward=raf)
    blockshard.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        loss = _loss(model, _ids(step, rank % 4))  # each replica: the same 4 shards' inputs
        with GatherSizes() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {"params": blockshard.full_state_dict(model), "backward": bwd.sizes}


def refusals(rank: int, world: int) -> dict[str, str]:
    """What an int refuses at W = 4: a non-factor, and a group with a quantized gather."""
    import blockshard
    from blockshard.runtime import ShardingError

    out = {}
    for what, fn in {
        "3": lambda: blockshard.fully_shard(nn.Linear(4, 4), reshard_after_forward=3),
        "quantized": lambda: blockshard.fully_shard(
            nn.Linear(64, 64), semantics={"weight": "mx"}, quantized_gather=True, reshard_after_forward=2
        ),
    }.items():
        try:
            fn()
            out[what] = "accepted"
        except ShardingError as e:
            out[what] = str(e)
        dist.barrier()
    return out


def many(rank: int, world: int, name: str, calls: list[tuple]) -> list:
    """``name(rank, world, *args)`` for each ``args`` of ``calls``, one after the other in one spawn
    (starting ranks is most of a small run's time)."""
    fn = globals()[name]
    return [fn(rank, world, *args) for args in calls]
