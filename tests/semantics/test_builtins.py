"""Built-in semantics: the unit each one gives, on shapes that are not multiples of anything."""

from __future__ import annotations

import pytest

from blockshard import SemanticsError, UnitGrid, get_semantics, registered_semantics
from blockshard.semantics import newton_schulz_flops

BUILTINS = {
    "elementwise", "matrix", "rows", "shampoo", "flat", "bnb8bit", "ao8bit", "ao4bit",
    "nf4", "ao_nf4", "mx", "fp8_block", "expert",
}  # fmt: skip


def test_every_builtin_is_registered():
    assert BUILTINS <= set(registered_semantics())


@pytest.mark.parametrize(
    ("spec", "shape", "expected"),
    [
        ("elementwise", (7, 3), UnitGrid.units(21, 1)),
        ("matrix", (7, 3), UnitGrid.whole(21)),
        ("rows:2", (7, 3), UnitGrid.units(21, 6)),  # 3 stripes of 2 rows + one of 1 row
        ("shampoo:4", (10, 5), UnitGrid.units(50, 20)),  # stripes of 4 rows hold whole 4x4 tiles
        ("shampoo:4", (10,), UnitGrid.units(10, 4)),  # 1-D: runs of 4
        ("flat:64", (100,), UnitGrid.units(100, 64)),
        ("nf4", (3, 64), UnitGrid.units(192, 64)),
        ("ao_nf4", (4, 4096), UnitGrid.units(16384, 16384)),
        ("mx", (5, 96), UnitGrid.units(480, 32)),
        ("fp8_block:128", (300, 7), UnitGrid.units(2100, 896)),  # 128-row stripes, partial last
        ("fp8_block:4", (3, 8, 5), UnitGrid.units(120, 20)),  # stacked experts, rows % tile == 0
        ("fp8_block:4", (3, 6, 5), UnitGrid.units(90, 30)),  # partial stripe per expert: one expert
        ("expert", (3, 5, 7), UnitGrid.units(105, 35)),
    ],
)
def test_builtin_grids(spec, shape, expected):
    assert get_semantics(spec).grid(shape, "bfloat16") == expected


def test_quantized_optimizer_state_follows_the_fp32_fallback_rules():
    # bitsandbytes: < 4096 elements -> fp32 state on one process -> keep whole on its owner
    assert get_semantics("bnb8bit").grid((4095,), "float32").is_whole
    g = get_semantics("bnb8bit").grid((100, 123), "float32")  # 12300 elements, not a multiple of 256
    assert (g.unit_numel, g.min_cut, g.max_cut) == (256, 4096, 8192)  # every piece >= 4096
    # torchao: fp32 state unless numel % block == 0 and numel >= 4096
    assert get_semantics("ao8bit").grid((100, 123), "float32").is_whole
    assert get_semantics("ao8bit").grid((64, 128), "float32") == UnitGrid.units(8192, 256, min_piece=4096)
    assert get_semantics("ao4bit").grid((64, 96), "float32").is_whole  # 6144: no two pieces of >= 4096
    assert get_semantics("ao4bit").grid((64, 192), "float32").unit_numel == 128


def test_unit_grid_cuts():
    g = UnitGrid.units(1000, 256, min_piece=300)
    assert [x for x in range(1, 1000) if g.allows_cut(x)] == [512]
    assert g.largest_unit == 512 and g.num_units == 2
    w = UnitGrid.whole(10)
    assert not any(w.allows_cut(x) for x in range(1, 10)) and w.largest_unit == 10
    assert UnitGrid.units(96, 8).combine(UnitGrid.units(96, 12)) == UnitGrid.units(96, 24)


@pytest.mark.parametrize(
    ("spec", "shape", "pattern"),
    [
        (
            "nf4",
            (3, 5),
            r"'nf4' cannot divide tensor 'layer.w' of shape \(3, 5\).*numel 15 is not a multiple of the 64",
        ),
        ("ao_nf4", (64, 64), r"not a multiple of the torchao NF4 super-block 64 x 256 = 16384"),
        ("mx", (4, 33), r"last dim 33 is not a multiple of the MX block of 32"),
        ("fp8_block:128", (256,), r"blockwise FP8 tiles 2-D weights.*Fix: apply fp8_block to 2-D weights only"),
        ("fp8_block:128", (2, 2, 256, 256), r"this tensor has 4 dims"),
        ("expert", (8,), r"stacked expert weight has shape \(num_experts, \.\.\.\)"),
    ],
)
def test_indivisible_shapes_raise_naming_tensor_constraint_and_fix(spec, shape, pattern):
    with pytest.raises(SemanticsError, match=pattern) as info:
        get_semantics(spec).grid(shape, "bfloat16", tensor="layer.w")
    assert "Fix:" in str(info.value) and isinstance(info.value, ValueError)


def test_bad_arguments_raise():
    with pytest.raises(SemanticsError, match=r"must be >= 1"):
        get_semantics("rows:0")
    with pytest.raises(SemanticsError, match=r"must be integers"):
        get_semantics("shampoo:big")
    with pytest.raises(SemanticsError, match=r"wrong number of arguments"):
        get_semantics("nf4:3")


def test_companions_follow_units():
    (absmax,) = get_semantics("nf4").companions((128, 64), "bfloat16")
    assert absmax.numel == 128 and absmax.per_unit == 1
    (scale,) = get_semantics("fp8_block:128").companions((300, 200), "bfloat16")
    assert scale.numel == 3 * 2 and scale.per_unit == 2


def test_newton_schulz_cost():
    assert newton_schulz_flops((4, 8)) == 20 * 16 * 8 + 10 * 64
    assert newton_schulz_flops((8, 4)) == newton_schulz_flops((4, 8))
    assert get_semantics("matrix").cost((4, 8), "bfloat16") == newton_schulz_flops((4, 8))
