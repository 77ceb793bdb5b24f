"""Every kind of buffer set in one group, behind one interface ([Note: buffer sets] in
blockshard/runtime/core/_buffer_set.py): a ``fully_shard`` call over an fp32 trainable Linear, a
frozen bf16 Linear, a frozen bitsandbytes NF4 Linear and an MX weight gathered quantized gives its
module state four buffer sets, in the documented order, each a ``BufferSet``; a step walks every
one (each gathered, then resharded), reduces exactly the ones that train, and ``reset_iter_state``
after an interrupted backward puts every one back. In-process gloo, W = 1.

Control: freezing the MX weight takes its buffer set out of the reduced ones (its parameter gets
no gradient), while the primary one still reduces.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("gloo_w1")]


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import bitsandbytes as bnb

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.adapter = nn.Linear(64, 64)
            self.frozen = nn.Linear(64, 64).to(torch.bfloat16).requires_grad_(False)
            q = bnb.nn.Linear4bit(64, 64, bias=False, compress_statistics=False, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(torch.randn(64, 64) / 8, requires_grad=False, quant_type="nf4")
            self.q = q.to("cpu")  # bitsandbytes quantizes on .to()
            self.proj = nn.Linear(64, 64, bias=False)
        self.interrupt = False  # raise in backward, between the last module's backward and the first's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.adapter(x))
        if self.interrupt:
            x.register_hook(_interrupt)
        x = x + self.frozen(x.to(torch.bfloat16)).float()
        return self.proj(torch.tanh(self.q(x)))


def _interrupt(_grad: torch.Tensor) -> None:
    raise RuntimeError("interrupted")


def _sharded() -> tuple[Mixed, object]:
    import blockshard
    from blockshard.runtime.core._state import state_of

    model = Mixed()
    blockshard.fully_shard(model, semantics={"proj.weight": "mx"}, quantized_gather=True)
    return model, state_of(model)


def test_a_group_holds_every_kind_of_buffer_set_in_order_behind_one_interface():
    from blockshard.runtime.core._buffer_set import BufferSet
    from blockshard.runtime.core._buffers import ParamBuffers
    from blockshard.runtime.quantized._frozen import FrozenQuantizedBuffers, frozen_buffers
    from blockshard.runtime.quantized._gather import QuantizedGatherBuffers

    model, st = _sharded()
    kinds = [type(b) for b in st.buffer_sets]
    assert kinds == [FrozenQuantizedBuffers, ParamBuffers, ParamBuffers, QuantizedGatherBuffers]
    assert all(isinstance(b, BufferSet) for b in st.buffer_sets)
    assert st.buffers is st.buffer_sets[1] and frozen_buffers(st) is st.buffer_sets[0]
    assert [b.name for b in st.buffer_sets] == ["Mixed", "Mixed", "Mixed[bfloat16]", "Mixed[quantized gather]"]
    assert st.extra_param_buffers == st.buffer_sets[2:]
    assert not any(hasattr(type(b), "trainable_extra") for b in st.buffer_sets)  # no class-variable flag
    assert {id(b.controls) for b in st.param_buffers} == {id(st.controls)}  # one set of FSDP2 controls

    seen: dict[str, list[str]] = {}

    def spy(*_) -> None:  # every buffer set's state when the adapter (the first module) has run
        seen["forward"] = [b.sharded_state.name for b in st.buffer_sets]

    hook = model.adapter.register_forward_hook(spy)
    model(torch.ones(2, 64)).square().mean().backward()
    hook.remove()
    assert seen["forward"] == ["UNSHARDED"] * 4
    assert [b.sharded_state.name for b in st.buffer_sets] == ["SHARDED"] * 4
    assert st.training_sets == [st.buffer_sets[1], st.buffer_sets[3]]  # the primary and the quantized gather
    assert model.adapter.weight.grad is not None and model.proj.weight.grad is not None
    assert model.frozen.weight.grad is None

    model.proj.weight.requires_grad_(False)  # the control
    assert st.training_sets == [st.buffer_sets[1]]


def test_reset_iter_state_after_an_interrupted_backward_resets_every_buffer_set():
    model, st = _sharded()
    model.interrupt = True
    with pytest.raises(RuntimeError, match="interrupted"):
        model(torch.ones(2, 64)).square().mean().backward()
    model.interrupt = False
    # the control: the step was left midway, the root's buffer sets still gathered
    assert st.training_state.name != "IDLE"
    assert [b.sharded_state.name for b in st.buffer_sets] == ["UNSHARDED"] * 4
    model.reset_iter_state()
    assert [b.sharded_state.name for b in st.buffer_sets] == ["SHARDED"] * 4
    assert st.training_state.name == "IDLE" and not st.ctx.reducing
    assert all(sp.unsharded.grad is None and sp.accumulated is None for b in st.param_buffers for sp in b.params)
    model(torch.ones(2, 64)).square().mean().backward()  # the next step runs normally
    assert model.adapter.weight.grad is not None
