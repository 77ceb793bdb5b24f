"""The engine's state machines ([Note: state machines] in blockshard/runtime/core/_common.py), observed
from inside a real step at W = 1 (a real gloo group in the test process).

Each test records the states of the sharded modules at the moments torch's own hooks fire
(forward hooks of submodules, tensor hooks in backward) and checks them against the diagram.
"""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn

import blockshard
from blockshard._tiny import OddMLP, mlp_batches
from blockshard.runtime import EngineStateError, ShardedState, TrainingState
from blockshard.runtime.core._state import state_of

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("gloo_w1")]

IDLE, FORWARD = TrainingState.IDLE, TrainingState.FORWARD
PRE, POST = TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD
SHARDED, UNSHARDING, UNSHARDED = ShardedState.SHARDED, ShardedState.UNSHARDING, ShardedState.UNSHARDED


def _model() -> OddMLP:
    with _inproc.serial():
        model = OddMLP()
    for block in model.blocks:
        blockshard.fully_shard(block)
    blockshard.fully_shard(model)
    return model


def _states(model: nn.Module) -> list[tuple[TrainingState, ShardedState]]:
    """(training state, sharded state) of the root, then of every block."""
    mods = [model, *model.blocks]
    out = []
    for m in mods:
        st = state_of(m)
        assert st is not None
        out.append((st.training_state, st.buffers.sharded_state))
    return out


def test_forward_walks_idle_forward_idle_and_reshards_all_but_the_root():
    model = _model()
    seen = []
    # inside block 1's forward (its Linear runs): block 1 is FORWARD and unsharded, block 0 done
    model.blocks[1][0].register_forward_hook(lambda *_: seen.append(_states(model)))
    x, y = mlp_batches(1, 4)[0]
    loss = ((model(x) - y) ** 2).mean()
    root, b0, b1, b2 = seen[0]
    assert root == (FORWARD, UNSHARDED)
    assert b0 == (IDLE, SHARDED)  # resharded after its forward
    assert b1 == (FORWARD, UNSHARDED)
    assert b2[0] is IDLE
    after = _states(model)
    assert after[0] == (IDLE, UNSHARDED)  # the root stays gathered: backward follows
    assert all(s == (IDLE, SHARDED) for s in after[1:])
    loss.backward()
    assert all(s == (IDLE, SHARDED) for s in _states(model))  # the final callback


def test_backward_walks_pre_backward_then_post_backward_in_reverse_order():
    model = _model()
    names = {id(state_of(m)): n for n, m in model.named_modules() if state_of(m) is not None}
    events: list[tuple[str, str, TrainingState, ShardedState]] = []
    for m in [model, *model.blocks]:
        st = state_of(m)
        for hook in ("pre_backward", "finish_backward"):
            real = getattr(st, hook)

            def spy(*args, _real=real, _st=st, _hook=hook):
                _real(*args)
                events.append((names[id(_st)], _hook, _st.training_state, _st.buffers.sharded_state))

            setattr(st, hook, spy)  # a spy on this state only (the hooks call it through self)
    x, y = mlp_batches(1, 4)[0]
    ((model(x) - y) ** 2).mean().backward()
    pre = [(n, t, g) for n, h, t, g in events if h == "pre_backward"]
    post = [(n, t, g) for n, h, t, g in events if h == "finish_backward"]
    order = [n for n, _, _ in pre]
    assert [n for n in order if n] == ["blocks.2", "blocks.1", "blocks.0"]  # reverse forward order
    assert order.index("") < order.index("blocks.1")  # the root's output is the loss's input
    assert all(t is PRE and g is UNSHARDED for _, t, g in pre)
    assert {n for n, _, _ in post} == {"", "blocks.0", "blocks.1", "blocks.2"}
    assert all(t is POST and g is SHARDED for _, t, g in post)  # resharded, then reduced
    assert all(s == (IDLE, SHARDED) for s in _states(model))  # the final callback
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.shape


def test_async_unshard_goes_through_unsharding():
    model = _model()
    block = model.blocks[0]
    group = state_of(block).buffers
    handle = block.unshard(async_op=True)
    assert group.sharded_state is UNSHARDING
    handle.wait()
    assert group.sharded_state is UNSHARDED
    assert block[0].weight.shape == (37, 13)  # the full parameter
    block.reshard()
    assert group.sharded_state is SHARDED
    assert group.gathered.untyped_storage().size() == 0


def test_a_transition_from_the_wrong_state_raises():
    model = _model()
    st = state_of(model.blocks[0])
    with pytest.raises(
        EngineStateError, match=r"post-backward of group 'Sequential': expected state PRE_BACKWARD, found IDLE"
    ):
        st.finish_backward()
    with torch.no_grad():
        model(torch.ones(2, 13))  # the first forward makes the root; blocks[0] is not one
    st.training_state = FORWARD  # as if its forward had never ended
    with pytest.raises(EngineStateError, match="pre-forward of group 'Sequential': expected state IDLE, found FORWARD"):
        st.pre_forward(model.blocks[0], (torch.ones(2, 13),), {})
    st.training_state = IDLE
    with pytest.raises(
        EngineStateError, match="post-forward of group 'Sequential': expected state FORWARD, found IDLE"
    ):
        st.post_forward(model.blocks[0], (), torch.ones(2, 37))


def test_a_backward_that_raised_midway_is_reset_by_the_next_forward():
    """A failed backward leaves groups mid-step; the next forward drops its partial gradients and
    starts from IDLE, so the next step equals a step of a fresh model (control: without the
    failure the same model takes the same step)."""
    model, fresh = _model(), _model()
    x, y = mlp_batches(1, 4)[0]

    def boom(_t: torch.Tensor) -> torch.Tensor:
        raise KeyError("failed inside backward")

    handles = []
    # fail when the gradient reaches block 0's output: blocks 2 and 1 are done, block 0 is not
    fwd = model.blocks[0].register_forward_hook(lambda _m, _a, out: handles.append(out.register_hook(boom)))
    with pytest.raises(KeyError):
        ((model(x) - y) ** 2).mean().backward()
    fwd.remove()
    for h in handles:
        h.remove()
    assert any(s != (IDLE, SHARDED) for s in _states(model))  # left mid-step
    model.zero_grad()  # what a loop that goes on does
    for m in (model, fresh):
        ((m(x) - y) ** 2).mean().backward()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert all(s == (IDLE, SHARDED) for s in _states(model))
