"""torch's pipelining schedules over a stage sharded by blockshard or stock FSDP2 (test_pipelining.py).

One pipeline stage per rank group (``pp = 1``) over dp ranks: the schedule runs each micro-batch's
forward and backward with gradient sync off, then its ``REDUCE_GRAD`` (``perform_reduce_grad``)
reduces what they accumulated through ``fully_shard.state(stage)`` and divides by the number of
micro-batches ([Note: pipelining's gradient reduction] in blockshard/runtime/core/_module.py). The
reference is one process stepping on the whole batch's mean loss.

Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``) need two
stages per rank: the model's first layer and its other two, both on each rank (``pp = 1``). Their
backward is an input pass and a separate weight pass that assigns the parameters' ``.grad``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
BATCH = 8
MICRO = 2  # micro-batches per rank and step
SCHEDULES = ("gpipe", "1f1b")
ZERO_BUBBLE = ("interleaved-zb", "zbv")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _model() -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(10)
        return Net()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)) for _ in range(STEPS)]


def reference(_rank: int = 0, _world: int = 1) -> dict[str, torch.Tensor]:
    """One process, the whole batch's mean loss per step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(pipe: Any, model: nn.Module) -> None:
    """AdamW over ``model``, stepped after ``pipe`` (a schedule) ran this rank's share of each batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        pipe.step(x.chunk(world)[rank], target=y.chunk(world)[rank], losses=[])
        opt.step()
        opt.zero_grad()


def pipelined(engine: str, schedule: str, *, skip_reduction: bool = False) -> dict[str, torch.Tensor]:
    """This rank's stage (the whole model, ``pp = 1``) sharded by ``engine`` over every rank, trained
    by torch's ``schedule`` on this rank's share of each batch; the full state dict after.
    ``skip_reduction``: the control, the schedule's gradient reduction made a no-op."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if engine == "stock":
        from torch.distributed.fsdp import fully_shard
    else:
        from blockshard import fully_shard
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    model = _model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    if skip_reduction:
        stage.perform_reduce_grad = lambda _scale: None  # type: ignore[method-assign]
    kind: Any = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    _train(kind(stage, n_microbatches=MICRO, loss_fn=_loss), model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}


def zero_bubble(
    engine: str, schedule: str, *, reshard_after_forward: bool = False, views: bool | None = None
) -> dict[str, torch.Tensor]:
    """The model as two stages on this rank (layer 0; layers 1 and 2), each sharded by ``engine``
    over every rank with ``reshard_after_forward``, trained by the zero-bubble ``schedule`` on this
    rank's share of each batch; the full state dict after (the unsharded model's names).
    ``views``: blockshard's gradient views on, off, or the backend's default."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    if engine == "stock":
        from torch.distributed.fsdp import fully_shard
    else:
        from blockshard import fully_shard
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    model = _model()
    parts = [_Layers(model.layers[:1]), _Layers(model.layers[1:])]
    for part in parts:
        for layer in part.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(part, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
        if views is not None:
            part.set_gradient_views(views)  # type: ignore[operator]
    group = mesh["pp"].get_group()
    stages = [PipelineStage(part, i, 2, torch.device("cpu"), group=group) for i, part in enumerate(parts)]
    kind: Any = {"interleaved-zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}[schedule]
    _train(kind(stages, n_microbatches=MICRO, loss_fn=_loss), model)
    full = {}
    for first, part in enumerate(parts):  # the stages' names ("layers.0.weight") as the model's
        state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        for k, v in state.items():
            _, index, rest = k.split(".", 2)
            full[f"layers.{int(index) + first}.{rest}"] = v.detach().clone()
    return full


class _Layers(nn.Module):
    """A pipeline stage: some of :class:`Net`'s layers, each with its tanh."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def run_all(_rank: int, _world: int) -> dict[str, Any]:
    """Every case of test_pipelining.py on one set of ranks."""
    out: dict[str, Any] = {f"blockshard-{s}": pipelined("blockshard", s) for s in SCHEDULES}
    out["stock-gpipe"] = pipelined("stock", "gpipe")
    out["control-no-reduction"] = pipelined("blockshard", "gpipe", skip_reduction=True)
    for s in ZERO_BUBBLE:
        out[f"blockshard-{s}"] = zero_bubble("blockshard", s)
        out[f"stock-{s}"] = zero_bubble("stock", s)
    out["blockshard-zbv-views"] = zero_bubble("blockshard", "zbv", views=True)
    out["stock-zbv-resharded"] = zero_bubble("stock", "zbv", reshard_after_forward=True)
    try:
        zero_bubble("blockshard", "zbv", reshard_after_forward=True)
        out["blockshard-zbv-resharded"] = "no error"
    except Exception as e:  # the refusal, sent back to the test as text
        out["blockshard-zbv-resharded"] = f"{type(e).__name__}: {e}"
    return out
