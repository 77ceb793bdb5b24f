"""The engine's quantized units are the planner's: for each format, the unit a quantized group keeps
whole (values per unit, companion elements per unit) equals the registered block semantics' grid
and companions (``nf4``, ``ao_nf4``, ``mx``, ``fp8_block:128``), so ``blockshard plan`` lays out
what ``fully_shard`` runs. bitsandbytes' nested statistics have no semantics yet (16384-value units)."""

from __future__ import annotations

import math

import _fp8_runs
import _qlora
import pytest
import torch

from blockshard.semantics import get_semantics

SHAPE = (320, 256)  # 81920 values: 5 super-blocks, 1280 blocks of 64, 2.5 stripes of 128 rows


def _bnb(nested: bool):
    from blockshard.runtime._bnb4bit import bnb_tensor

    lin = _qlora.quantize_linears(
        torch.nn.Sequential(torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)), names=("0",), compress_statistics=nested
    )
    return bnb_tensor("w", [], lin[0].weight, {})


def _ao():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from blockshard.runtime._ao_nf4 import ao_nf4_tensor

    return ao_nf4_tensor(
        "w", [], torch.nn.Parameter(to_nf4(torch.randn(SHAPE, dtype=torch.bfloat16)), requires_grad=False), {}
    )


def _mx():
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    from blockshard.runtime._mx import mx_tensor

    t = MXTensor.to_mx(torch.randn(SHAPE, dtype=torch.bfloat16), torch.float8_e4m3fn, block_size=32)
    return mx_tensor("w", [], torch.nn.Parameter(t, requires_grad=False), {})


def _fp8():
    from blockshard.runtime._fp8_block import fp8_block_tensor
    from blockshard.runtime._param import ParamRef

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


# format -> (semantics, payload values per byte, per companion: the element size the engine moves)
CASES = {
    "bnb nf4, fp32 absmax": (lambda: _bnb(False), "nf4", 2, [4]),
    "torchao NF4Tensor": (_ao, "ao_nf4", 2, [1, 2]),  # scalers int8; the factor in the weight's dtype (bf16)
    "torchao MXTensor": (_mx, "mx", 1, [1]),
    "blockwise FP8": (_fp8, "fp8_block:128", 1, [4]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_units_are_the_semantics_units(case):
    build, spec, per_byte, sizes = CASES[case]
    t = build()
    sem = get_semantics(spec)
    numel = math.prod(SHAPE)
    grid = sem.grid(SHAPE, "bfloat16")
    assert -(-numel // grid.unit_numel) == t.n_units  # the same number of units
    assert t.streams[0].unit_bytes * per_byte == grid.unit_numel  # the payload of one unit
    for comp, stream, size in zip(sem.companions(SHAPE, "bfloat16"), t.streams[1:], sizes, strict=True):
        assert stream.unit_bytes == comp.per_unit * size, (comp.suffix, stream.name)
