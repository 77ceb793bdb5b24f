"""``blockshard plan``'s quantized bytes are the engine's: the same shapes and semantics planned from
specs alone give, per group, exactly the ``blockshard.quantized_stats`` of the sharded model (segment,
gathered, total and replicated bytes, values) and exactly the payload and scales each rank holds
(threaded gloo ranks at W = 2 and 3; [Note: planned quantized bytes] in ``planner/_quantized.py``).

Models: the tiny Llama with its seven decoder linears in bitsandbytes 4-bit (nf4 / fp4, nested
statistics on / off: seven tensors of 2.75, 1, 0.5 ... nested blocks in one group), and stacks of
torchao ``NF4Tensor``, ``MXTensor`` and blockwise FP8 linears, one group per layer or every weight in
the root's group (one mixed group of all three formats too). Control: the planner's cuts are not
trivially equal — at W = 3 the ranks of one group hold different bytes, and a planner that ignored
the scales (payload only) would disagree with the engine.
"""

from __future__ import annotations

from dataclasses import replace

import _ao_runs
import _fp8_runs
import _inproc
import _mx_runs
import _qlora
import pytest
import torch
from torch import nn

import blockshard
from blockshard.planner import plan_model
from blockshard.planner._quantized import plan_quantized_group
from blockshard.runtime import quantized_stats
from blockshard.runtime._state import state_of
from blockshard.semantics import TensorSpec

pytestmark = pytest.mark.timeout(300)


def _engine(rank: int, world: int, build, layers: str | None) -> dict:
    """Per quantized group: this rank's ``quantized_stats`` and the bytes it holds of its segment."""
    with _qlora._serial():
        model = build()
    if layers is not None:
        for layer in model.get_submodule(layers):
            blockshard.fully_shard(layer)
    blockshard.fully_shard(model)
    held = {p: st.group.quantized.layout.rank_bytes(rank) for p, m in model.named_modules() if (st := state_of(m))
            and st.group.quantized is not None}  # fmt: skip
    return {"stats": quantized_stats(model), "held": held}


def _specs(model: nn.Module, layers: str | None, dtype: torch.dtype) -> list[TensorSpec]:
    """The planner's view of ``model``'s unquantized twin: one group per sharded layer, the rest the root's."""
    out = []
    for name, p in model.named_parameters():
        group = None
        if layers is not None and name.startswith(layers + "."):
            group = ".".join(name.split(".")[: layers.count(".") + 2])
        out.append(TensorSpec(name=name, shape=tuple(p.shape), dtype=dtype, group=group))
    return out


def _check(ranks: list[dict], plan) -> None:
    predicted = {q.group: q for q in plan.quantized_groups}
    for rank, got in enumerate(ranks):
        assert set(got["stats"]) == set(predicted), rank
        for group, stats in got["stats"].items():
            q = predicted[group]
            assert stats.local_bytes == q.segment_bytes, (rank, group)
            assert stats.gathered_bytes == q.gathered_bytes, (rank, group)
            assert stats.total_bytes == q.total_bytes, (rank, group)
            assert stats.constant_bytes == q.constant_bytes, (rank, group)
            assert stats.numel == q.numel, (rank, group)
            assert got["held"][group] == q.rank_bytes[rank], (rank, group)


# -- bitsandbytes 4-bit on the tiny Llama ----------------------------------------------------------
BNB = [(qt, nested) for qt in ("nf4", "fp4") for nested in (True, False)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("quant_type", "nested"), BNB, ids=lambda x: str(x))
def test_bnb4bit_llama_bytes_equal_the_plan(quant_type, nested, world):
    quant = {"quant_type": quant_type, "compress_statistics": nested}
    ranks = _inproc.run_ranks(_engine, world, args=(lambda: _qlora.qlora_llama(lora=False, **quant), "model.layers"))
    from blockshard._tiny import tiny_llama

    specs = _specs(tiny_llama(0, **_qlora.SHAPE), "model.layers", torch.float32)
    sem = f"*_proj.weight={quant_type}{'_nested' if nested else ''}"
    plan = plan_model(specs, world, semantics=sem)
    _check(ranks, plan)
    assert {q.group for q in plan.quantized_groups} == {"model.layers.0", "model.layers.1"}
    if world == 3 and nested:  # the control: a real cut of whole nested blocks, not W equal shares
        assert len(set(plan.quantized_groups[0].rank_bytes)) > 1
    # the control: the same cuts without the scales (payload only) predict another segment
    q = plan.quantized_groups[0]
    stored = [(it.name, it.storage) for it in plan.items if it.spec.group == q.group and it.storage is not None]
    payload_only = plan_quantized_group(
        q.group, [(n, replace(st, streams=st.streams[:1])) for n, st in stored], world, 16
    )
    assert payload_only.segment_bytes != ranks[0]["stats"][q.group].local_bytes


# -- torchao NF4, MX, blockwise FP8 stacks --------------------------------------------------------
def _mixed() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        i, o = _ao_runs.SHAPES[0]
        return nn.ModuleDict(
            {
                "nf4": _ao_runs.NF4LoRALinear(i, o),
                "mx": _mx_runs.MXLoRALinear(*_mx_runs.SHAPES[1], "float8_e4m3fn"),
                "fp8": _fp8_runs.FP8BlockLinear(*_fp8_runs.SHAPES[0]),
            }
        )


def _twin(shapes) -> nn.Module:
    """A stack's bf16 twin: ``layers.i.weight`` (out, in) and its adapters."""
    stack = nn.Module()
    stack.layers = nn.ModuleList()
    for i, o in shapes:
        layer = nn.Module()
        layer.weight = nn.Parameter(torch.empty(o, i))
        layer.lora_a, layer.lora_b = nn.Parameter(torch.empty(4, i)), nn.Parameter(torch.empty(o, 4))
        stack.layers.append(layer)
    return stack


STACKS = {
    "ao_nf4": (_ao_runs.NF4Stack, _ao_runs.SHAPES, "*.weight=ao_nf4"),
    "mx": (lambda: _mx_runs.MXStack("float8_e4m3fn"), _mx_runs.SHAPES, "*.weight=mx"),
    "mx:4": (lambda: _mx_runs.MXStack("float4_e2m1fn_x2"), _mx_runs.SHAPES, "*.weight=mx:4"),
    "fp8_block:128": (_fp8_runs.FP8Stack, _fp8_runs.SHAPES, "*.weight=fp8_block:128"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layers", ["layers", None], ids=["per-layer", "one-group"])
@pytest.mark.parametrize("fmt", list(STACKS))
def test_torchao_and_fp8_stack_bytes_equal_the_plan(fmt, layers, world):
    build, shapes, sem = STACKS[fmt]
    ranks = _inproc.run_ranks(_engine, world, args=(build, layers))
    plan = plan_model(_specs(_twin(shapes), layers, torch.bfloat16), world, semantics=sem)
    _check(ranks, plan)
    assert len(plan.quantized_groups) == (len(shapes) if layers else 1)


@pytest.mark.parametrize("world", [2, 3])
def test_one_group_of_three_formats_equals_the_plan(world):
    ranks = _inproc.run_ranks(_engine, world, args=(_mixed, None))
    twin = nn.ModuleDict(
        {name: _twin([shape]).layers[0] for name, shape in
         (("nf4", _ao_runs.SHAPES[0]), ("mx", _mx_runs.SHAPES[1]), ("fp8", _fp8_runs.SHAPES[0]))}
    )  # fmt: skip
    sem = "nf4.weight=ao_nf4,mx.weight=mx,fp8.weight=fp8_block:128"
    plan = plan_model(_specs(twin, None, torch.bfloat16), world, semantics=sem)
    _check(ranks, plan)
    (q,) = plan.quantized_groups
    assert q.tensors == ("nf4.weight", "mx.weight", "fp8.weight")
