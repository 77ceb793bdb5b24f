"""Placement units vs compute units, stacked experts per expert, and how units combine."""

from __future__ import annotations

import math

import pytest

from blockshard import BlockSemantics, ComputeUnitError, SemanticsError, UnitGrid, get_semantics, register_semantics
from blockshard.semantics import SemanticsRules, TensorSpec, newton_schulz_flops, unregister_semantics
from blockshard.semantics._experts import is_stacked_experts, repeat_grid

FINE = UnitGrid.units


@pytest.mark.parametrize(
    ("spec", "shape", "compute", "placement"),
    [
        ("elementwise", (7, 3), FINE(21, 1), FINE(21, 1)),
        ("matrix", (7, 3), UnitGrid.whole(21), FINE(21, 1)),
        ("rows:2", (7, 3), FINE(21, 6), FINE(21, 1)),
        ("shampoo:4", (10, 5), FINE(50, 20), FINE(50, 1)),
        ("flat:64", (100,), FINE(100, 64), FINE(100, 64)),
        ("bnb8bit", (64, 128), FINE(8192, 256, min_piece=4096), FINE(8192, 256, min_piece=4096)),
        ("ao8bit", (64, 128), FINE(8192, 256, min_piece=4096), FINE(8192, 256, min_piece=4096)),
        ("ao4bit", (64, 192), FINE(12288, 128, min_piece=4096), FINE(12288, 128, min_piece=4096)),
        ("nf4", (3, 64), FINE(192, 64), FINE(192, 64)),
        ("fp4", (3, 64), FINE(192, 64), FINE(192, 64)),
        ("nf4_nested", (300, 128), FINE(38400, 16384), FINE(38400, 16384)),  # the last nested block shorter
        ("fp4_nested", (300, 128), FINE(38400, 16384), FINE(38400, 16384)),
        ("ao_nf4", (4, 4096), FINE(16384, 16384), FINE(16384, 16384)),
        ("mx", (5, 96), FINE(480, 32), FINE(480, 32)),
        ("mx:4", (5, 96), FINE(480, 32), FINE(480, 32)),
        ("fp8_block:128", (300, 7), FINE(2100, 896), FINE(2100, 896)),
        ("expert", (3, 5, 7), FINE(105, 35), FINE(105, 1)),
        ("parts:5:2", (7, 3), FINE(21, 1), FINE(21, 1)),  # declares a fused weight: no unit of its own
    ],
)
def test_every_builtin_states_its_compute_and_placement_units(spec, shape, compute, placement):
    sem = get_semantics(spec)
    assert sem.grid(shape, "bfloat16") == compute
    assert sem.placement_grid(shape, "bfloat16") == placement
    # a compute unit holds whole placement units
    assert compute.combine(placement) == compute


def test_every_registered_builtin_is_covered():
    from blockshard.semantics import _builtins

    covered = {"elementwise", "matrix", "rows", "shampoo", "flat", "bnb8bit", "ao8bit", "ao4bit", "nf4", "ao_nf4"}
    covered |= {"mx", "fp8_block", "expert", "parts"}
    classes = [c for c in vars(_builtins).values() if isinstance(c, type) and issubclass(c, BlockSemantics)]
    assert {c._registered_name for c in classes if c._registered_name} <= covered
    from blockshard.semantics import _quantizers

    covered |= {"fp4", "nf4_nested", "fp4_nested"}
    classes = [c for c in vars(_quantizers).values() if isinstance(c, type) and issubclass(c, BlockSemantics)]
    assert {c._registered_name for c in classes if c._registered_name} <= covered


def test_user_semantics_default_to_one_unit_and_may_state_both():
    @register_semantics("test_tile8")
    class Tile8(BlockSemantics):
        def grid(self, shape, dtype, *, tensor="<tensor>"):
            return UnitGrid.units(math.prod(shape), 8)

    @register_semantics("test_whole_fine")
    class WholeFine(BlockSemantics):
        def grid(self, shape, dtype, *, tensor="<tensor>"):
            return UnitGrid.whole(math.prod(shape))

        def placement_grid(self, shape, dtype, *, tensor="<tensor>"):
            return UnitGrid.units(math.prod(shape), 4)

    try:
        spec = TensorSpec(name="w", shape=(4, 16))
        res = SemanticsRules.coerce("test_tile8").resolve(spec)
        assert res.grid == res.placement == FINE(64, 8)  # placement defaults to the compute grid
        res = SemanticsRules.coerce("test_whole_fine").resolve(spec)
        assert res.grid.is_whole and res.placement == FINE(64, 4)
    finally:
        unregister_semantics("test_tile8")
        unregister_semantics("test_whole_fine")


EXPERTS = dict(name="model.layers.3.mlp.experts.gate_up_proj", shape=(4, 6, 5), module_type="DeepseekV3Experts")


@pytest.mark.parametrize(
    ("spec", "compute"),
    [
        ("matrix", FINE(120, 30)),  # one expert's matrix
        ("muon", FINE(120, 30)),
        ("shampoo:3", FINE(120, 15)),  # stripes of 3 rows of each expert
        ("shampoo:4", FINE(120, 30)),  # 6 % 4: a shorter last stripe per expert, so one expert
        ("rows:2", FINE(120, 10)),  # 2 rows of each expert, not 2 experts
        ("rows:4", FINE(120, 30)),
        ("fp8_block:2", FINE(120, 10)),
        ("fp8_block:4", FINE(120, 30)),
    ],
)
def test_stacked_experts_are_computed_per_expert(spec, compute):
    res = SemanticsRules.coerce(spec).resolve(TensorSpec(**EXPERTS))
    assert res.grid == compute
    if not spec.startswith("fp8_block"):
        assert res.placement == FINE(120, 1)  # the storage may be cut anywhere


def test_stacked_expert_cost_is_per_expert():
    res = SemanticsRules.coerce("muon").resolve(TensorSpec(**EXPERTS))
    assert res.cost == 4 * newton_schulz_flops((6, 5))
    assert res.label == "matrix+expert"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(name="m.experts.w1", shape=(4, 6, 5)),  # a parameter of a module named experts
        dict(name="m.w", shape=(4, 6, 5), module_type="MixtralExperts"),  # an *Experts module
    ],
)
def test_how_a_stacked_expert_tensor_is_recognized(kwargs):
    assert is_stacked_experts(TensorSpec(**kwargs))
    assert SemanticsRules.coerce("matrix").resolve(TensorSpec(**kwargs)).grid == FINE(120, 30)


def test_the_expert_semantics_marks_a_tensor_as_experts():
    spec = TensorSpec(name="m.w", shape=(4, 6, 5))
    assert not is_stacked_experts(spec)
    assert SemanticsRules.coerce("*.w=matrix,*.w=expert").resolve(spec).grid == FINE(120, 30)


def test_a_3d_tensor_that_is_not_experts_keeps_the_plain_behaviour():
    conv = TensorSpec(name="model.conv1d.weight", shape=(4, 6, 5), module_type="Conv1d")
    assert not is_stacked_experts(conv)
    assert SemanticsRules.coerce("matrix").resolve(conv).grid.is_whole
    assert SemanticsRules.coerce("rows:2").resolve(conv).grid == FINE(120, 60)  # 2 rows of the (4, 30) view
    assert SemanticsRules.coerce("matrix").resolve(conv).cost == newton_schulz_flops((4, 6, 5))
    # 2-D tensors of an experts module (GPT-OSS biases) are not stacked matrices
    assert not is_stacked_experts(TensorSpec(name="m.experts.b", shape=(4, 6), module_type="GptOssExperts"))


def test_repeat_grid():
    assert repeat_grid(UnitGrid.whole(6), 3) == FINE(18, 6)
    assert repeat_grid(FINE(6, 2), 3) == FINE(18, 2)
    assert repeat_grid(FINE(7, 2), 3) == FINE(21, 7)  # shorter last unit: one copy is the unit
    assert repeat_grid(UnitGrid.whole(6), 1).is_whole
    assert repeat_grid(UnitGrid.whole(0), 3) == UnitGrid.whole(0)


W = TensorSpec(name="l.w", shape=(16, 64))


def test_placement_units_combine_to_their_lcm():
    res = SemanticsRules.coerce("*.w=matrix,*.w=nf4").resolve(W)
    assert res.grid.is_whole and res.placement == FINE(1024, 64)  # matrix with 8-bit/quantization: theirs
    res = SemanticsRules.coerce("*.w=rows:4,*.w=mx").resolve(W)
    assert res.placement == FINE(1024, 32) and res.grid == FINE(1024, 256)  # 4 rows of 64 hold whole MX blocks
    res = SemanticsRules.coerce("*.w=expert,*.w=flat:3").resolve(TensorSpec(name="x.w", shape=(2, 3, 4)))
    assert res.placement == FINE(24, 3) and res.grid == FINE(24, 12)


def test_nested_compute_units_combine():
    assert SemanticsRules.coerce("*.w=matrix,*.w=rows:2").resolve(W).grid.is_whole
    assert SemanticsRules.coerce("*.w=rows:4,*.w=rows:2").resolve(W).grid == FINE(1024, 256)
    e = TensorSpec(name="m.experts.w", shape=(4, 6, 5))
    assert SemanticsRules.coerce("*.w=shampoo:3,*.w=expert").resolve(e).grid == FINE(120, 30)


def test_compute_units_that_do_not_nest_raise_naming_both():
    with pytest.raises(ComputeUnitError) as info:
        SemanticsRules.coerce("*.w=rows:3,*.w=rows:2").resolve(W)
    msg = str(info.value)
    assert "'l.w'" in msg and "'rows:3'" in msg and "'rows:2'" in msg and "Fix:" in msg
    assert isinstance(info.value, SemanticsError) and isinstance(info.value, ValueError)


def test_muon_leaves_stacked_expert_biases_elementwise():
    rules = SemanticsRules.coerce("muon")
    bias = TensorSpec(name="model.layers.0.mlp.experts.gate_up_proj_bias", shape=(4, 10), module_type="GptOssExperts")
    assert rules.resolve(bias).grid == FINE(40, 1) and rules.resolve(bias).label == "elementwise"
    up = TensorSpec(name="model.layers.0.mlp.experts.gate_up_proj", shape=(4, 6, 10), module_type="GptOssExperts")
    assert rules.resolve(up).grid == FINE(240, 60)
