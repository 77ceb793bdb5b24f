"""torchao ``NF4Tensor`` (QLoRA NF4 with double-quantized scalers) as a :class:`QuantizedTensor`.

Sections (one unit grid, see [Note: quantized layout]): a unit is one super-block of
``scaler_block_size`` (256) blocks of ``block_size`` (64) values = 16384 values:
``8192`` payload bytes (``quantized_data``, uint8), 256 int8 ``quantized_scalers`` and one
``quantization_factor`` (in the weight's dtype). Replicated: ``scaler_mean`` (a scalar) and the
16-value ``nf4`` table. torchao's own FSDP2 hooks split only on dim 0 and gather the three sections
separately; here a rank's cut is any super-block boundary and the three travel in one all-gather.
The unsharded parameter is a new ``NF4Tensor`` over the gathered tensors (``linear_nf4`` unchanged).
State dicts ([Note: quantized state dicts]): sharded, ``weight`` (the payload),
``weight.quantized_scalers``, ``weight.quantization_factor`` as pieces and ``weight.scaler_mean``,
``weight.nf4`` replicated; full, one ``NF4Tensor`` under ``weight`` (the unsharded model's entry).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from blockshard._errors import QuantizedWeightError
from blockshard.runtime.core._param import ParamRef
from blockshard.runtime.quantized._layout import SectionShape
from blockshard.runtime.quantized._tensor import QuantizedTensor, SharedConstants, StateEntry, byte_view

if TYPE_CHECKING:  # torchao ships no type information: NF4Tensor is Any to mypy
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

__all__ = ["ao_nf4_tensor", "is_ao_nf4"]


def _nf4_class() -> type | None:
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor
    except ImportError:  # torchao is an optional extra
        return None
    cls: type = NF4Tensor
    return cls


def is_ao_nf4(param: object) -> bool:
    if not type(param).__module__.startswith("torchao."):  # never import torchao for other parameters
        return False
    cls = _nf4_class()
    return cls is not None and isinstance(param, cls)


def _error(fqn: str, what: str, fix: str) -> QuantizedWeightError:
    return QuantizedWeightError(f"quantized weight {fqn!r} (torchao NF4Tensor): {what}. Fix: {fix}")


def _check(fqn: str, p: NF4Tensor) -> int:
    numel: int = math.prod(p.shape)
    bs, sbs = p.block_size, p.scaler_block_size
    if p.requires_grad:
        raise _error(fqn, "it requires grad; NF4 weights are frozen", "freeze it (p.requires_grad_(False))")
    if numel % (bs * sbs) or p.n_blocks * bs != numel:
        raise _error(
            fqn,
            f"its {numel} values (shape {tuple(p.shape)}) are not a whole number of {bs} x {sbs} = {bs * sbs}-value "
            f"super-blocks (n_blocks={p.n_blocks})",
            "NF4-quantize only weights whose numel is a multiple of 16384; keep this one unquantized",
        )
    n_super = numel // (bs * sbs)
    got = (p.quantized_data.numel(), p.quantized_scalers.numel(), p.quantization_factor.numel())
    if got != (numel // 2, p.n_blocks, n_super):
        raise _error(
            fqn,
            f"its nested scalers do not fit: {numel} values need {numel // 2} payload bytes, {p.n_blocks} "
            f"quantized scalers and {n_super} quantization factors, it has {got[0]}, {got[1]} and {got[2]}",
            "re-quantize the weight with torchao's to_nf4 (its inner tensors belong to another tensor)",
        )
    return numel


def ao_nf4_tensor(fqn: str, refs: list[ParamRef], p: NF4Tensor, constants: SharedConstants) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a torchao ``NF4Tensor`` parameter (validated, see ``_check``)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs

    numel = _check(fqn, p)
    sbs, units = p.scaler_block_size, numel // (p.block_size * p.scaler_block_size)
    originals = [p.quantized_data, p.quantized_scalers, p.quantization_factor]
    fsize = p.quantization_factor.element_size()
    sections = (
        SectionShape("quantized_data", numel // 2, sbs * p.block_size // 2),
        SectionShape("quantized_scalers", p.n_blocks, sbs),
        SectionShape("quantization_factor", units * fsize, fsize),
    )
    gathered = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in originals]
    key = (p.nf4.dtype, byte_view(p.nf4.contiguous()).cpu().numpy().tobytes())
    added = 0 if key in constants else p.nf4.numel() * p.nf4.element_size()
    nf4 = constants.setdefault(key, p.nf4)
    added += p.scaler_mean.element_size()
    meta = SubclassTensorArgs(p.shape, p.stride(), p.storage_offset(), p.dtype, p.device, False)
    inner = NF4Tensor(meta, p.block_size, p.n_blocks, sbs, gathered[1], gathered[2], p.scaler_mean, gathered[0], nf4)
    attr = refs[0].attr if refs else "weight"
    entries = [StateEntry(attr if k == 0 else f"{attr}.{s.name}", k, g.dtype, tuple(g.shape)) for k, (s, g) in
               enumerate(zip(sections, gathered, strict=True))]  # fmt: skip
    entries += [
        StateEntry(f"{attr}.{n}", None, c.dtype, tuple(c.shape), c.detach().clone())
        for n, c in (("scaler_mean", p.scaler_mean), ("nf4", nf4))
    ]

    def to_full(full: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        sm, table = p.scaler_mean.detach().clone(), nf4.detach().clone()
        return {attr: NF4Tensor(meta, p.block_size, p.n_blocks, sbs, full[1], full[2], sm, full[0], table)}

    def from_full(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        v: Any = values[attr]
        got = (type(v), tuple(v.shape), getattr(v, "block_size", None), getattr(v, "scaler_block_size", None))
        if got != (NF4Tensor, tuple(p.shape), p.block_size, sbs):
            raise _error(
                fqn,
                f"the state dict holds a {got[0].__name__} of shape {got[1]} (block_size {got[2]}, scaler_block_size "
                f"{got[3]}) under {attr!r}, the model an NF4Tensor of shape {tuple(p.shape)} ({p.block_size}, {sbs})",
                "load a state dict of this model (blockshard.full_state_dict, an unsharded model's state_dict(), "
                "or model.state_dict() through torch.distributed.checkpoint)",
            )
        for n, mine in (("scaler_mean", p.scaler_mean), ("nf4", nf4)):
            if not torch.equal(getattr(v, n), mine):
                raise _error(fqn, f"its {n} differs from the model's", "load weights quantized the same way")
        return [v.quantized_data, v.quantized_scalers, v.quantization_factor]

    return QuantizedTensor(
        fqn=fqn,
        refs=refs,
        format="torchao NF4Tensor",
        numel=numel,
        n_units=units,
        sections=sections,
        sources=[byte_view(t.detach().contiguous()) for t in originals],
        gathered=gathered,
        targets=[byte_view(t) for t in gathered],
        unsharded=nn.Parameter(inner, requires_grad=False),
        constant_bytes=added,
        entries=entries,
        full_names=(attr,),
        to_full=to_full,
        from_full=from_full,
    )
