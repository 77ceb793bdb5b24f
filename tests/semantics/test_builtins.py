"""Built-in semantics: the unit each one gives, on shapes that are not multiples of anything."""

from __future__ import annotations

import pytest

from blockshard import SemanticsError, UnitGrid, get_semantics, registered_semantics
from blockshard.semantics import newton_schulz_flops

BUILTINS = {
    "elementwise", "matrix", "rows", "shampoo", "flat", "bnb8bit", "ao8bit", "ao4bit",
    "nf4", "ao_nf4", "mx", "fp8_block", "expert", "fp4", "nf4_nested", "fp4_nested",
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
        ("fp4", (3, 64), UnitGrid.units(192, 64)),
        ("nf4_nested", (300, 128), UnitGrid.units(38400, 16384)),  # 2 nested blocks + one of 88 blocks
        ("nf4_nested", (2, 64), UnitGrid.whole(128)),  # fewer than 256 blocks: one nested block
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
        ("fp4", (3, 5), r"numel 15 is not a multiple of the 64-value FP4 quantization block"),
        ("nf4_nested", (3, 5), r"numel 15 is not a multiple of the 64-value NF4 quantization block"),
        ("ao_nf4", (3, 64), r"its 3 blocks do not fill whole nested blocks of 256 scalers.*'nf4_nested'"),
        ("ao_nf4", (3, 5), r"numel 15 is not a multiple of the torchao NF4 block of 64 values"),
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


def test_nested_companions_and_the_ao_factor_dtype():
    absmax, state2 = get_semantics("nf4_nested").companions((300, 128), "bfloat16")
    assert (absmax.numel, absmax.dtype, absmax.per_unit) == (600, "uint8", 256)
    assert (state2.numel, state2.dtype, state2.per_unit) == (3, "float32", 1)
    # torchao stores the quantization factor in the weight's dtype (to_nf4 of a bf16 / fp32 weight)
    for dtype in ("bfloat16", "float32"):
        _, factor = get_semantics("ao_nf4").companions((4, 4096), dtype)
        assert factor.dtype == dtype and factor.numel == 1


@pytest.mark.parametrize(
    ("spec", "shape", "unit_numel", "sections", "constants"),
    [
        ("nf4", (3, 64), 64, [(96, 32), (12, 4)], 64),
        ("fp4", (3, 64), 64, [(96, 32), (12, 4)], 64),
        ("nf4_nested", (300, 128), 16384, [(19200, 8192), (600, 256), (12, 4)], 64 + 1024 + 4),
        ("ao_nf4", (4, 4096), 16384, [(8192, 8192), (256, 256), (2, 2)], 32 + 2),  # bf16 table, scaler_mean
        ("mx", (5, 96), 32, [(480, 32), (15, 1)], 0),
        ("mx:4", (5, 96), 32, [(240, 16), (15, 1)], 0),
        ("fp8_block:128", (300, 200), 128 * 200, [(60000, 25600), (24, 8)], 0),
        ("fp8_block:4", (3, 6, 5), 30, [(90, 30), (3 * 2 * 2 * 4, 16)], 0),  # per expert: one expert a unit
    ],
)
def test_quantizers_state_their_storage(spec, shape, unit_numel, sections, constants):
    st = get_semantics(spec).storage(shape, "bfloat16")
    assert st.unit_numel == unit_numel and [(s.nbytes, s.unit_bytes) for s in st.sections] == sections
    assert sum(b for _, b in st.shared_constants) + st.tensor_constant_bytes == constants
    assert st.bytes_before(st.n_units) == st.nbytes and st.bytes_before(1) == min(st.unit_bytes, st.nbytes)


def test_non_quantizers_have_no_storage():
    for spec in ("elementwise", "matrix", "bnb8bit", "shampoo:4", "flat:64", "expert"):
        assert get_semantics(spec).storage((8, 64), "bfloat16") is None


def test_newton_schulz_cost():
    assert newton_schulz_flops((4, 8)) == 20 * 16 * 8 + 10 * 64
    assert newton_schulz_flops((8, 4)) == newton_schulz_flops((4, 8))
    assert get_semantics("matrix").cost((4, 8), "bfloat16") == newton_schulz_flops((4, 8))
