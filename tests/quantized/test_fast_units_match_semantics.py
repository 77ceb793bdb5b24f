"""The engine's quantized units are the planner's: for each format, the unit a quantized group keeps
whole (values per unit, companion elements per unit) equals the registered block semantics' grid
and companions (``nf4``, ``fp4``, ``nf4_nested``, ``fp4_nested``, ``ao_nf4``, ``mx``, ``mx:4``,
``fp8_block:128``), so ``blockshard plan`` lays out what ``fully_shard`` runs; and the semantics'
storage (its byte sections, [Note: quantized storage]) is the engine's sections byte for byte, with the
companions' dtypes (torchao's quantization factor in the weight's dtype, not fp32)."""

from __future__ import annotations

import itertools
import math

import _fp8_runs
import _qlora
import pytest
import torch

from blockshard.semantics import get_semantics, itemsize_of

SHAPE = (320, 256)  # 81920 values: 5 super-blocks, 1280 blocks of 64, 2.5 stripes of 128 rows


def _bnb(nested: bool, quant_type: str = "nf4"):
    from blockshard.runtime.quantized._bnb4bit import bnb_tensor

    lin = _qlora.quantize_linears(
        torch.nn.Sequential(torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)),
        names=("0",),
        compress_statistics=nested,
        quant_type=quant_type,
    )
    return bnb_tensor("w", [], lin[0].weight, {})


def _ao(dtype=torch.bfloat16):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from blockshard.runtime.quantized._ao_nf4 import ao_nf4_tensor

    return ao_nf4_tensor("w", [], torch.nn.Parameter(to_nf4(torch.randn(SHAPE, dtype=dtype)), requires_grad=False), {})


def _mx(elem=torch.float8_e4m3fn):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    from blockshard.runtime.quantized._mx import mx_tensor

    t = MXTensor.to_mx(torch.randn(SHAPE, dtype=torch.bfloat16), elem, block_size=32)
    return mx_tensor("w", [], torch.nn.Parameter(t, requires_grad=False), {})


def _fp6():
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3

    return DTYPE_FP6_E2M3


def _fp8():
    from blockshard.runtime.core._param import ParamRef
    from blockshard.runtime.quantized._fp8_block import fp8_block_tensor

    q, s = _fp8_runs.quantize_fp8_block(torch.randn(SHAPE))
    m = torch.nn.Module()
    m.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    return fp8_block_tensor(
        "w",
        [],
        torch.nn.Parameter(q, requires_grad=False),
        ("s", ParamRef(m, "weight_scale_inv"), m.weight_scale_inv),
        (128, 128),
    )


# format -> (build, semantics, the weight's dtype, payload values per byte, per companion: the element
# size the engine moves)
CASES = {
    "bnb nf4, fp32 absmax": (lambda: _bnb(False), "nf4", "bfloat16", 2, [4]),
    "bnb fp4, fp32 absmax": (lambda: _bnb(False, "fp4"), "fp4", "bfloat16", 2, [4]),
    "bnb nf4, nested absmax": (lambda: _bnb(True), "nf4_nested", "bfloat16", 2, [1, 4]),  # uint8, state2 fp32
    "bnb fp4, nested absmax": (lambda: _bnb(True, "fp4"), "fp4_nested", "bfloat16", 2, [1, 4]),
    "torchao NF4Tensor": (_ao, "ao_nf4", "bfloat16", 2, [1, 2]),  # scalers int8; the factor in bf16
    "torchao NF4Tensor, fp32": (lambda: _ao(torch.float32), "ao_nf4", "float32", 2, [1, 4]),
    "torchao MXTensor": (_mx, "mx", "bfloat16", 1, [1]),
    "torchao MXTensor, fp4": (lambda: _mx(torch.float4_e2m1fn_x2), "mx:4", "bfloat16", 2, [1]),
    "torchao MXTensor, fp6 (unpacked)": (lambda: _mx(_fp6()), "mx", "bfloat16", 1, [1]),
    "blockwise FP8": (_fp8, "fp8_block:128", "bfloat16", 1, [4]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_units_are_the_semantics_units(case):
    build, spec, dtype, per_byte, sizes = CASES[case]
    t = build()
    sem = get_semantics(spec)
    numel = math.prod(SHAPE)
    grid = sem.grid(SHAPE, dtype)
    assert -(-numel // grid.unit_numel) == t.n_units  # the same number of units
    assert t.sections[0].unit_bytes * per_byte == grid.unit_numel  # the payload of one unit
    for comp, section, size in zip(sem.companions(SHAPE, dtype), t.sections[1:], sizes, strict=True):
        assert section.unit_bytes == comp.per_unit * size, (comp.suffix, section.name)
        assert itemsize_of(comp.dtype) == size, (comp.suffix, comp.dtype)  # the dtype the library stores


@pytest.mark.parametrize("case", list(CASES))
def test_semantics_storage_is_the_engines_sections(case):
    build, spec, dtype, _, _ = CASES[case]
    t = build()
    st = get_semantics(spec).storage(SHAPE, dtype)
    assert st.n_units == t.n_units
    assert [(s.nbytes, s.unit_bytes) for s in st.sections] == [(s.nbytes, s.unit_bytes) for s in t.sections]
    assert [st.bytes_before(k) for k in range(t.n_units + 1)] == _engine_cum(t)


def _engine_cum(t) -> list[int]:
    from blockshard.runtime.quantized._layout import _unit_sizes

    return [0, *itertools.accumulate(int(x) for x in _unit_sizes(t.sections, t.n_units))]


def test_ao_nf4_factor_is_not_fp32_for_a_bf16_weight():
    # the control for the fact fixed in ao_nf4: torchao stores the factor in the weight's dtype
    (_, factor) = get_semantics("ao_nf4").companions(SHAPE, "bfloat16")
    assert factor.dtype == "bfloat16" and _ao().sections[2].unit_bytes == 2 != itemsize_of("float32")
