"""An int ``reshard_after_forward`` as FSDP2 reads it ([Note: reshard to a smaller world] in
blockshard/runtime/core/_post_forward.py): the argument's checks (pure), and one W = 4 step on
thread ranks (the spawned runs, with stock FSDP2 beside, are test_reshard_smaller_world.py)."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard.runtime import ShardingError
from blockshard.runtime._arguments import check_post_forward, reshard_after_forward_of

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("value", "world", "want"),
    [(None, 4, None), (True, 4, True), (False, 4, False), (1, 4, False), (4, 4, True), (2, 4, 2), (2, 8, 2),
     (4, 8, 4), (1, 1, False)],
)  # fmt: skip
def test_an_int_is_read_as_fsdp2_reads_it(value, world, want):
    got = reshard_after_forward_of(value, world)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value", [3, 0, -2, 8, 2.0, "2"])
def test_an_int_that_is_no_factor_of_the_shard_group_s_size_is_refused_naming_the_factors(value):
    with pytest.raises(ShardingError) as e:
        reshard_after_forward_of(value, 4)
    assert isinstance(e.value, ValueError)  # as FSDP2's ValueError
    text = str(e.value)
    assert f"reshard_after_forward={value!r} must be" in text and "one of [1, 2, 4]" in text and "Fix:" in text


def test_an_int_is_refused_for_buffer_sets_that_gather_quantized_bytes():
    check_post_forward("Block", True, [object()])  # a bool: nothing to refuse
    with pytest.raises(ShardingError, match=r"fully_shard of Block: reshard_after_forward=2 .*frozen quantized"):
        check_post_forward("Block", 2, [object()])


def test_set_reshard_after_forward_takes_bools_only_as_fsdp2_s(gloo_w1):
    """torch 2.13's ``FSDPModule.set_reshard_after_forward`` raises ValueError on an int."""
    model = blockshard.fully_shard(nn.Linear(2, 2))
    with pytest.raises(ShardingError, match="reshard_after_forward=2 must be True or False"):
        model.set_reshard_after_forward(2)


def _step(rank: int, world: int, raf: object) -> tuple[dict, list[int], int, int]:
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8)) for _ in range(2)))
    with torch.no_grad():  # the same values on every thread rank (they share the global generator)
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) / 3)
    for m in model:
        blockshard.fully_shard(m, reshard_after_forward=raf)
    blockshard.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).pow(2).mean()
        held = [m._blockshard_state.buffers for m in model]  # between forward and backward
        run = sum(b._run.numel() for b in held if b._run is not None)
        local = sum(b.local.numel() for b in held)
        loss.backward()
        opt.step()
        opt.zero_grad()
    ks = sorted({c.ranks for c in blockshard.collective_counts(model) if c.kind == "all-gather" and c.calls})
    return blockshard.full_state_dict(model), ks, run, local


def test_a_smaller_world_trains_bitwise_as_true_on_four_thread_ranks():
    got = _inproc.run_ranks(_step, 4, args=(2,))
    want = _inproc.run_ranks(_step, 4, args=(True,))
    params, ks, run, local = got[0]
    assert all(torch.equal(params[n], want[0][0][n]) for n in params)
    assert ks == [2, 4] and want[0][1] == [4]  # backward's all-gathers within 2 ranks; under True over 4
    assert run == 2 * local and want[0][2] == 0  # a run of W / k = 2 segments; True keeps none
