"""On one rank the engine issues no collective, as FSDP2 (FSDP2's own
``test_train_parity_single_worldsize1``, [Note: one rank] in blockshard/runtime/core/_collectives.py):
the all-gather is a copy, the reduce-scatter (the average over one rank) a copy, and the end-of-step
check, the gradient-norm all-reduce and HSDP's all-reduce have nothing to combine. Counted with
torch's ``CommDebugMode`` over forward, backward, ``clip_grad_norm_`` and the optimizer step;
training stays bitwise equal to the unsharded model. The control: the same counter at W = 2 sees
the engine's collectives."""

from __future__ import annotations

import contextlib
import copy

import _inproc
import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import blockshard

pytestmark = pytest.mark.timeout(120)


def _mlp(shapes: list[tuple[int, int]]) -> nn.Sequential:
    torch.manual_seed(42)
    return nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(), nn.Linear(*shapes[1]))


class _C10dOps(TorchDispatchMode):
    """Counts every ``c10d`` op dispatched in this thread (``CommDebugMode``'s module tracker is
    process-wide and breaks with two threaded ranks: this counter serves the W = 2 control)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.namespace == "c10d"
        return func(*args, **(kwargs or {}))


def _train(
    model: nn.Module, steps: int, width: int, *, clip: bool, counted: bool, threaded: bool = False
) -> tuple[list[float], int]:
    """FSDP2's loop (Adam, ``zero_grad`` alternating ``set_to_none``); returns the losses and the
    collectives counted over every step (forward, backward, clipping, step)."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(43)
    inp = torch.randn(4, width)
    losses, count = [], 0
    for i in range(steps):
        optim.zero_grad(set_to_none=i % 2 == 0)
        mode, ops = (contextlib.nullcontext() if threaded else CommDebugMode()), _C10dOps()
        with mode, ops:
            loss = model(inp).sum()
            loss.backward()
            if clip:
                (blockshard.clip_grad_norm_ if counted else nn.utils.clip_grad_norm_)(model.parameters(), 0.5)
            optim.step()
        count += ops.count if threaded else max(ops.count, mode.get_total_counts())
        losses.append(loss.item())
    return losses, count


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("shapes", [[(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]])
def test_one_rank_issues_no_collective_and_trains_as_the_unsharded_model(shapes):
    ref = _mlp(shapes)
    model = copy.deepcopy(ref)
    with _inproc.world1():
        blockshard.fully_shard(model)
        losses, count = _train(model, 10, shapes[0][0], clip=True, counted=True)
        got = _params(model)
    want_losses, _ = _train(ref, 10, shapes[0][0], clip=True, counted=False)
    assert count == 0
    assert losses == want_losses
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), n


def test_nested_groups_mixed_precision_and_a_one_by_one_hsdp_mesh_issue_none():
    ref = _mlp([(16, 17), (17, 8)])
    model = copy.deepcopy(ref)
    with _inproc.world1():
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        blockshard.fully_shard(model[0], mesh=mesh, mp_policy=mp)
        blockshard.fully_shard(model, mesh=mesh, mp_policy=mp)
        model.set_requires_gradient_sync(True)
        _, count = _train(model, 3, 16, clip=True, counted=True)
    assert count == 0


def _two_ranks(rank: int, world_size: int) -> int:
    with _inproc.serial():
        model = _mlp([(16, 15), (15, 8)])
    blockshard.fully_shard(model)
    return _train(model, 2, 16, clip=True, counted=True, threaded=True)[1]


def test_control_the_counter_sees_the_engines_collectives_at_two_ranks():
    counts = _inproc.run_ranks(_two_ranks, 2)
    # per step: an all-gather, a reduce-scatter, the end-of-step check, the gradient-norm all-reduce
    assert counts[0] == counts[1] >= 2 * 4
