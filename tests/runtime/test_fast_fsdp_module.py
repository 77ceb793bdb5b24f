"""A blockshard module is an ``FSDPModule`` ([Note: an FSDPModule] in
blockshard/runtime/core/_module.py): ``isinstance`` holds, and each place in torch, Accelerate and
transformers that checks it does what docs/engine.md says, on a real W = 1 gloo group (fixture
``gloo_w1``) or threaded gloo ranks."""

from __future__ import annotations

import _inproc
import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import blockshard
from blockshard.runtime import ShardedModule, ShardingError
from blockshard.runtime.core._module import unswapped_class

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Sequential:
    with _inproc.serial():  # the seed and the draws of one rank at a time (ranks may be threads)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    blockshard.fully_shard(model[0])
    blockshard.fully_shard(model)
    return model


def test_a_sharded_module_is_an_fsdp_module_and_still_its_own_class(gloo_w1):
    model = _model()
    for m in (model, model[0]):
        assert isinstance(m, FSDPModule) and isinstance(m, ShardedModule)
    assert isinstance(model, nn.Sequential) and isinstance(model[0], nn.Linear)
    assert unswapped_class(type(model)) is nn.Sequential and unswapped_class(type(model[0])) is nn.Linear
    assert not isinstance(model[1], FSDPModule)  # not sharded: Tanh keeps its class
    # control: what the class swap is, so the check above is not vacuous
    assert type(model).__name__ == "BlockShardSequential"


def test_every_fsdp_module_method_is_blockshard_s_own():
    """No method of torch's ``FSDPModule`` runs on a blockshard module: each is overridden, except
    the state reader, which raises (below)."""
    torch_own = {n for n, v in vars(FSDPModule).items() if callable(v) and n != "__new__"}
    inherited = {n for n in torch_own if getattr(ShardedModule, n) is getattr(FSDPModule, n)}
    assert inherited == set(), inherited
    assert {"_apply", "_get_fsdp_state", "reshard", "unshard"} <= torch_own  # control: torch's really are there


def test_slicing_a_sharded_container_builds_the_model_s_own_class(gloo_w1):
    """As FSDP2's ``FSDPModule.__new__``: ``type(m)(...)`` (a ``Sequential`` sliced) makes the
    model's own class, not a sharded module without state."""
    model = _model()
    head = model[1:]
    assert type(head) is nn.Sequential and not isinstance(head, FSDPModule)
    assert [type(m) for m in head] == [nn.Tanh, nn.Linear]
    assert head[1] is model[2]


def test_torch_code_that_reads_fsdp2_state_raises_naming_blockshard_s_way(gloo_w1):
    from torch.distributed.fsdp._fully_shard._fully_shard import share_comm_ctx

    model = _model()
    with pytest.raises(ShardingError, match=r"sharded by blockshard\.fully_shard.* Fix: use the public methods"):
        model._get_fsdp_state()
    # torch's share_comm_ctx dispatches on the class, then reads the state
    with pytest.raises(ShardingError, match=r"no FSDP2 internal state"):
        share_comm_ctx([model[0], model])
    # fully_shard.state(m): what torch's pipelining drives is there ([Note: pipelining's gradient
    # reduction], test_pipeline_s_gradient_reduction_...); the rest of FSDP2's state raises
    state = torch_fully_shard.state(model)  # type: ignore[attr-defined]
    with pytest.raises(ShardingError, match=r"torch read FSDP2's state attribute '_fsdp_param_group'"):
        _ = state._fsdp_param_group
    # torch's fully_shard over a module blockshard sharded (sharding it twice) is refused by torch
    with pytest.raises(AssertionError, match=r"fully_shard has already been applied"):
        torch_fully_shard(model[0])


def test_torch_s_replicate_leaves_blockshard_modules_to_blockshard_as_fsdp2_s(gloo_w1):
    """torch's composable ``replicate`` skips the parameters of modules in whose registry it finds
    ``fully_shard`` (DDP over ranks' pieces of other sizes aborts gloo: the spawned
    "replicate over sharded MLPs" row of test_fsdp2_scenarios.py), and refuses a sharded module."""
    from torch.distributed._composable import replicate
    from torch.distributed._composable.replicate import _is_fully_sharded

    model = _model()
    assert _is_fully_sharded(model) and _is_fully_sharded(model[0])
    with pytest.raises(RuntimeError, match=r"already managed by `fully_shard`"):
        replicate(model[0])


def test_torch_s_forward_method_registration_with_the_routes_off_raises_at_the_call(gloo_w1, monkeypatch):
    """With ``BLOCKSHARD_TORCH_ROUTES=none`` torch's ``register_fsdp_forward_method`` sees an
    ``FSDPModule`` and wraps the method; the wrapped call raises (before: a silent no-op, the
    method ran on the local pieces)."""
    from blockshard.runtime.routes import install_torch_routes, uninstall_torch_routes

    uninstall_torch_routes()
    monkeypatch.setenv("BLOCKSHARD_TORCH_ROUTES", "none")
    try:
        from torch.distributed.fsdp import register_fsdp_forward_method

        torch.manual_seed(0)
        lin = nn.Linear(4, 4)
        lin.encode = lin.forward  # type: ignore[method-assign]
        blockshard.fully_shard(lin)
        register_fsdp_forward_method(lin, "encode")
        with pytest.raises(ShardingError, match=r"register_fsdp_forward_method with BLOCKSHARD_TORCH_ROUTES off"):
            lin.encode(torch.ones(1, 4))
    finally:
        monkeypatch.delenv("BLOCKSHARD_TORCH_ROUTES")
        uninstall_torch_routes()
        install_torch_routes()


def test_accelerate_s_fsdp2_preparation_keeps_a_blockshard_model(gloo_w1):
    """Accelerate's ``fsdp2_prepare_model`` returns a model that already is an ``FSDPModule`` as
    it is (before, it went on to apply stock FSDP2 over blockshard's groups); its auto-wrap skips
    submodules that are."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    model = _model()
    before = dict(model.named_parameters())
    assert fsdp2_prepare_model(None, model) is model  # Accelerate reads nothing else first
    assert dict(model.named_parameters()) == before
    assert torch_fully_shard.state(model)._text  # type: ignore[attr-defined]  # still blockshard's, not torch's


def _trainer_reshard(rank: int, world: int) -> list[bool]:
    """The HF Trainer's loop before it builds the optimizer (``for m in model.modules(): if
    isinstance(m, FSDPModule): m.reshard()``) after a forward that kept the groups gathered: every blockshard group is sharded again, so the optimizer gets the pieces."""
    model = _model()
    model.set_reshard_after_forward(False)  # every group keeps its parameters gathered after forward
    model(torch.ones(2, 6))  # with autograd on (under no_grad blockshard reshards after forward anyway)
    kept = model[2].weight.numel() + model[2].bias.numel()  # the root's own: gathered
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    piece = model[2].weight.numel() + model[2].bias.numel()
    return [kept == 10 * 3 + 3, piece < kept, model[0].weight.numel() < 6 * 10]


def test_the_hf_trainer_s_reshard_loop_shards_every_group_again():
    assert _inproc.run_ranks(_trainer_reshard, 2) == [[True] * 3] * 2


def test_pipeline_s_gradient_reduction_reduces_what_the_micro_batches_accumulated(gloo_w1):
    """torch's pipelining (``ScheduleGPipe``, one stage) runs each micro-batch's backward with sync
    off, then ``perform_reduce_grad`` through ``fully_shard.state``: the step equals one process.
    The spawned W = 2 runs, bitwise against stock FSDP2, are in test_pipelining.py."""
    import _pipeline_runs

    with _inproc.serial():
        want = _pipeline_runs.reference()
    got = _pipeline_runs.pipelined("blockshard", "gpipe")
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    # control: the same run with the schedule's reduction made a no-op differs
    skipped = _pipeline_runs.pipelined("blockshard", "gpipe", skip_reduction=True)
    assert max((skipped[k] - want[k]).abs().max().item() for k in want) > 1e-3


def test_a_zero_bubble_weight_pass_adds_to_what_earlier_micro_batches_left(gloo_w1):
    """``ScheduleZBVZeroBubble`` (two stages on the rank): the weight pass assigns ``.grad`` after the
    input pass folded the earlier micro-batch's gradient into its view (views are on at W = 1): the
    step is bitwise stock FSDP2's (before the fix, the second micro-batch's gradient replaced the
    first's). Groups resharded after forward get no weight gradient at all: refused, where stock
    FSDP2 leaves the second stage unstepped. The spawned W = 2 runs are in test_pipelining.py."""
    import _pipeline_runs

    ours = _pipeline_runs.zero_bubble("blockshard", "zbv")
    stock = _pipeline_runs.zero_bubble("stock", "zbv")
    assert all(torch.equal(ours[k], v) for k, v in stock.items())
    with pytest.raises(ShardingError, match=r"zero-bubble schedule .* reshard_after_forward=False"):
        _pipeline_runs.zero_bubble("blockshard", "zbv", reshard_after_forward=True)
