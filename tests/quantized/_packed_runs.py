"""Trainable blockwise-FP8 masters in packed tile order (``fully_shard(..., quantized_gather=True,
tile_placement=True)``, [Note: packed tile order in the engine]): rank functions and the one-process
reference. ``(rank, world, ...)``; the reference is the plain model whose weights pass through a
straight-through fake quantization by the pure-torch blockwise FP8 reference (``_qgather_runs``).

The model is GPT-OSS-shaped and scaled down: stacked experts ``up`` (4, 180, 352) and ``down``
(4, 360, 180) in 32 x 32 tiles in the root's group, and a projection (200, 360) in a group of its
own. ``up`` is GPT-OSS's ``gate_up_proj`` (2880 = 22.5 x 128 rows, 5760 = 45 x 128 columns): 180 =
5 x 32 + 20, 352 = 11 x 32, only the rows have an edge (its 20 x 32 edge tiles one to a slot);
``down`` and the projection have edges in both dims (360 = 11 x 32 + 8, 200 = 6 x 32 + 8: their
32 x 8 and 8 x 32 edge tiles four to a slot, the corners several).
"""

from __future__ import annotations

import math

import _qgather_runs as Q
import torch
from torch import nn
from torch.nn.utils import parametrize

TILE = 32
SPEC = f"fp8_block:{TILE}"
SHAPES = {"up": (4, 180, 352), "down": (4, 360, 180), "proj.weight": (200, 360)}
BATCH = 6


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.up = nn.Parameter(torch.randn(*SHAPES["up"]) / math.sqrt(352))
            self.down = nn.Parameter(torch.randn(*SHAPES["down"]) / math.sqrt(180))
            self.proj = nn.Linear(360, 200)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(torch.einsum("nc,erc->ner", x, self.up))
        return self.proj(torch.einsum("ner,ecr->nc", h, self.down))


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, 352, generator=torch.Generator().manual_seed(step))


def build(world: int, tile_placement: bool | str = True) -> nn.Module:
    """The model sharded with quantized gather (``world`` > 0), else with the reference fake quantization."""
    import blockshard

    with Q._serial():
        model = Experts()
    if world:
        kw = {"quantized_gather": True, "tile_placement": tile_placement}
        blockshard.fully_shard(model.proj, semantics={"weight": SPEC}, **kw)
        blockshard.fully_shard(model, semantics={"up": SPEC, "down": SPEC}, **kw)
    else:
        for module, name in ((model, "up"), (model, "down"), (model.proj, "weight")):
            parametrize.register_parametrization(module, name, Q.FakeQuant(SPEC))
    return model


def _full(model: nn.Module, world: int) -> dict[str, torch.Tensor]:
    import blockshard

    if world:
        full = blockshard.full_state_dict(model)
    else:
        full = {n.replace("parametrizations.", "").replace(".original", ""): p for n, p in model.named_parameters()}
    return {n: t.detach().clone() for n, t in full.items()}


def gathered(rank: int, world: int, tile_placement: bool | str = True) -> dict:
    """The gathered payload and scales per weight, the unsharded weights during an unshard, the
    whole masters, and the bytes each rank's quantized-gather buffer sets hold (segment, masters)."""
    import blockshard
    from blockshard.runtime import full_quantized
    from blockshard.runtime.quantized._gather import _gather_sets

    model = build(world, tile_placement)
    out: dict = {"masters": _full(model, world), "payload": full_quantized(model), "unsharded": {}}
    model.unshard()
    model.proj.unshard()
    out["unsharded"] = {"up": model.up.detach().clone(), "down": model.down.detach().clone()}
    out["unsharded"]["proj.weight"] = model.proj.weight.detach().clone()
    model.proj.reshard()
    model.reshard()
    sets = _gather_sets(model)
    out["segment_numel"] = {p: g.layout.segment_numel for p, g in sets}
    out["layouts"] = {p: g.layout for p, g in sets}
    out["stats"] = blockshard.quantized_gather_stats(model)
    return out


def train(rank: int, world: int, steps: int = 3, tile_placement: bool | str = True) -> dict:
    """Logits per step and the whole parameters after ``steps`` AdamW steps (``world == 0``: one
    process with the reference fake quantization)."""
    model = build(world, tile_placement)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return {"logits": _steps(model, opt, range(steps)), "params": _full(model, world)}


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    logits = []
    for step in steps:
        y = model(batch(step))
        y.square().mean().backward()
        logits.append(y.detach().clone())
        opt.step()
        opt.zero_grad()
    return logits


def save_then_resume(rank: int, world: int, path: str, phase: str, steps: tuple[int, int] = (2, 1)) -> dict:
    """``phase == "save"``: ``steps[0]`` AdamW steps, then ``blockshard.save_checkpoint`` (DCP) of
    the model and optimizer; ``"load"``: a fresh model at this ``world`` loads it and takes
    ``steps[1]`` more. Returns the logits and the whole parameters after them."""
    import blockshard

    model = build(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if phase == "save":
        logits = _steps(model, opt, range(steps[0]))
        blockshard.save_checkpoint(model, path, optimizer=opt)
    else:
        blockshard.load_checkpoint(model, path, optimizer=opt)
        logits = _steps(model, opt, range(steps[0], steps[0] + steps[1]))
    return {"logits": logits, "params": _full(model, world)}


def one_process(rank: int, world: int, steps: int = 3) -> dict:
    """:func:`train`'s one-process reference, for ``blockshard._launch.run_single`` (which passes W = 1)."""
    return train(0, 0, steps)
