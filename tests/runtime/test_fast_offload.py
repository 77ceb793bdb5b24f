"""``offload_policy=CPUOffloadPolicy()`` ([Note: CPU offload] in _buffers.py), in-process.

On this CPU-only machine the device *is* the CPU, but the offload data flow still runs as on a
GPU: the local shard is copied into a separate send buffer before each all-gather, and the
reduce-scatter lands in a device buffer that is copied into the host gradient. So these tests
check the data flow's bookkeeping (every copy exact: results bitwise equal to no offload), and
that parameters, gradients and optimizer state live on the CPU. What they cannot check without a
GPU: pinned memory, non-blocking copies and their synchronization, and the streams
([Note: streams] in _common.py); offloading from a GPU still raises (test below).
"""

from __future__ import annotations

import functools

import _fast_scenarios as fs
import _inproc
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

import blockshard
from blockshard._errors import ShardingError

pytestmark = pytest.mark.timeout(60)

OFFLOAD = {"offload_policy": CPUOffloadPolicy()}


@pytest.fixture(autouse=True)
def _w1(gloo_w1):
    return gloo_w1


def _on(world: int, *args, **kwargs) -> list[dict]:
    if world == 1:
        with _inproc.single_thread():
            return [fs.train(0, 1, *args, **kwargs)]
    return _inproc.run_ranks(fs.train, world, args=args, kwargs=kwargs)


@functools.cache
def _no_offload(world: int, kind: str, micro: int = 1, mp: bool = False) -> list[dict]:
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    return _on(world, kind, sharded=True, micro=micro, shard_kwargs=kw)


_SLOW = pytest.mark.heavy  # the rest of the matrix: in process, out of `make test-fast` (its one-minute budget)


@pytest.mark.parametrize("world", [pytest.param(1, marks=_SLOW), 2])
@pytest.mark.parametrize(
    ("kind", "micro", "mp"),
    [("mlp", 1, False), pytest.param("llama", 1, False, marks=_SLOW), ("mlp", 2, True)]
    + [pytest.param("mlp", 2, False, marks=_SLOW), pytest.param("mlp", 1, True, marks=_SLOW)],
)
def test_offload_equals_no_offload_bitwise(world, kind, micro, mp):
    kw = dict(OFFLOAD)
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    got = _on(world, kind, sharded=True, micro=micro, shard_kwargs=kw)
    for rank, (a, b) in enumerate(zip(got, _no_offload(world, kind, micro, mp), strict=True)):
        assert fs.bitwise_diffs(a, b) == {}, f"rank {rank} of {world}"
        assert a["devices"] == {"params": {"cpu"}, "grads": {"cpu"}, "optimizer": {"cpu"}}, a["devices"]


def test_offload_copies_through_separate_device_buffers():
    """The data flow a GPU would take: a send buffer apart from the local shard, and the
    reduce-scatter output apart from the host gradient (without offload both are the same
    tensor, and the reduce-scatter writes the gradient directly)."""
    groups = {}
    for name, kw in (("off", OFFLOAD), ("on", {})):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        blockshard.fully_shard(model[0], **kw)
        blockshard.fully_shard(model, **kw)
        model(torch.ones(3, 4)).sum().backward()
        g = model[0]._blockshard_state.buffers
        groups[name] = g
        assert g.grad_buffer() is not None and g.local.device.type == "cpu"
    off, on = groups["off"], groups["on"]
    assert off.offload and off.send is not off.local and off.host == torch.device("cpu")
    assert not on.offload and on.send is on.local


def test_offload_from_a_device_raises_naming_the_fix():
    model = nn.Linear(4, 4, device="meta")
    blockshard.fully_shard(model, **OFFLOAD)  # meta is fine: materialized later
    with pytest.raises(ShardingError, match="to_empty\\(device='cpu'\\)"):
        model._blockshard_state.buffers.materialize(torch.device("cuda"))
    model.to_empty(device="cpu")  # the CPU is fine
    assert model._blockshard_state.buffers.local.device.type == "cpu"
