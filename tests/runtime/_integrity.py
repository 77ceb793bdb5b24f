"""Ranks whose collectives do not line up (for test_integrity.py): each records what it raised.

Every rank writes its outcome to ``<out_dir>/rank<r>.json`` as well as returning it, so a test
still reads the survivors' errors when one rank dies (``spawn_gloo`` then raises for that rank).
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch import nn

TIMEOUT_S = 6.0  # BLOCKSHARD_COLLECTIVE_TIMEOUT_S for these runs (a loaded 2-core machine needs the margin)
STEPS = 3
MISBEHAVING_STEP = 1


class Tower(nn.Module):
    """Three identical 16 x 16 layers (so a rank that skips one still pairs equal-sized buffers)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x))
        return x


class Funnel(Tower):
    """Three layers of other sizes (24, 8, 4 outputs): a rank out of step pairs buffers of other
    sizes, which gloo answers with ``abort()`` unless the headers stop it first ([Note: collective
    headers] in blockshard/runtime/core/_collectives.py)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Linear(16, 24), nn.Linear(24, 8), nn.Linear(8, 4)])
        self.skip = None


def _setup(funnel: bool = False):
    import blockshard

    os.environ["BLOCKSHARD_COLLECTIVE_TIMEOUT_S"] = str(TIMEOUT_S)
    model = Funnel() if funnel else Tower()
    for layer in model.layers:
        blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def case(rank: int, world: int, name: str, out_dir: str, odd_rank: int = 1, funnel: bool = False) -> dict:
    """``STEPS`` steps; in step ``MISBEHAVING_STEP`` rank ``odd_rank`` misbehaves as ``name`` says
    (``funnel``: on :class:`Funnel`, whose layers differ in size)."""
    import blockshard

    model, opt = _setup(funnel)
    start = time.monotonic()
    checkpoint = os.path.join(out_dir, "checkpoint")
    try:
        if name == "load_checkpoint_alone":
            blockshard.save_checkpoint(model, checkpoint)  # on every rank: a checkpoint to load
        for step in range(STEPS):
            odd = rank == odd_rank and step == MISBEHAVING_STEP
            if odd and name == "load_checkpoint_alone":
                blockshard.load_checkpoint(model, checkpoint)
            if odd and name == "full_state_dict_alone":
                blockshard.full_state_dict(model)
            if odd and name == "gradient_sync_off":
                model.set_requires_gradient_sync(False)
            if odd and name == "skipped_step":
                continue
            if odd and name == "dead_peer":
                os._exit(3)
            if odd and name == "unused_module":
                model.skip = 1
            if odd and name == "requires_grad":
                model.layers[0].weight.requires_grad_(False)
            x = torch.ones(4, 16)
            if odd and name == "extra_forward":
                model(x)
            if odd and name == "no_grad_forward":
                with torch.no_grad():
                    model(x)  # e.g. an evaluation on one rank
            if odd and name == "raised_in_forward":
                try:  # the rank catches an error of its own in the middle of a forward and goes on
                    model.layers[0](x)
                    raise ValueError("a bad batch")
                except ValueError:
                    pass
            loss = model(x).square().mean()
            if not (odd and name == "skipped_backward"):
                loss.backward()
            if not (odd and name == "skipped_optimizer_step") and not (rank == odd_rank and name == "never_steps"):
                opt.step()
            opt.zero_grad()
            model.skip = None
            model.set_requires_gradient_sync(True)
        outcome = "no error"
    except Exception as exc:  # the test asserts the type and the text
        outcome = f"{type(exc).__name__}: {exc}"
    result = {"outcome": outcome, "seconds": time.monotonic() - start}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return result
