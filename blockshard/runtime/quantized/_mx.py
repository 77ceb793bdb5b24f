"""torchao ``MXTensor`` (OCP microscaling: MXFP8 / MXFP4) frozen weights as a :class:`QuantizedTensor`.

Sections (one unit grid, see [Note: quantized layout]): a unit is one 1 x ``block_size`` (32) block
along the last dim, contiguous in the row-major flattening: its ``qdata`` bytes (32 for fp8
elements, 16 for packed fp4) and its one E8M0 ``scale`` byte. Scales must be in row-major order
(``is_swizzled_scales=False``): a swizzled (blocked, for cuBLAS) scale layout does not follow the
blocks. The unsharded parameter is a new ``MXTensor`` over the gathered tensors
(``__tensor_unflatten__`` with the original's metadata).
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

if TYPE_CHECKING:  # torchao ships no type information: MXTensor is Any to mypy
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

__all__ = ["is_mx", "mx_tensor"]


def is_mx(param: object) -> bool:
    if not type(param).__module__.startswith("torchao."):  # never import torchao for other parameters
        return False
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except ImportError:
        return False
    return isinstance(param, MXTensor)


def _error(fqn: str, what: str, fix: str) -> QuantizedWeightError:
    return QuantizedWeightError(f"quantized weight {fqn!r} (torchao MXTensor): {what}. Fix: {fix}")


def mx_tensor(fqn: str, refs: list[ParamRef], p: MXTensor, constants: SharedConstants) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a torchao ``MXTensor`` parameter (frozen, row-major scales)."""
    names, ctx = p.__tensor_flatten__()
    qdata, scale = p.qdata, p.scale
    numel, bs = math.prod(p.shape), p.block_size
    if p.requires_grad:
        raise _error(fqn, "it requires grad; MX weights here are frozen", "freeze it (p.requires_grad_(False))")
    if names != ["qdata", "scale"] or ctx.get("is_swizzled_scales"):
        raise _error(
            fqn,
            f"its scales are swizzled (is_swizzled_scales={ctx.get('is_swizzled_scales')}) or it holds {names}",
            "shard the weight before swizzling its scales for a kernel (to_mx(..., is_swizzled_scales=False))",
        )
    if not p.shape or p.shape[-1] % bs or scale.numel() != numel // bs:
        raise _error(
            fqn,
            f"its {numel} values (shape {tuple(p.shape)}) are not whole 1 x {bs} blocks along the last dim "
            f"with one scale each ({scale.numel()} scales)",
            f"MX-quantize only weights whose last dim is a multiple of {bs}",
        )
    payload = qdata.numel() * qdata.element_size()
    if payload * bs % numel:
        raise _error(fqn, f"its payload of {payload} bytes does not split into {numel // bs} blocks", "re-quantize it")
    originals = [qdata, scale]
    sections = (
        SectionShape("qdata", payload, payload // (numel // bs)),
        SectionShape("scale", scale.numel() * scale.element_size(), scale.element_size()),
    )
    gathered = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in originals]
    inner = type(p).__tensor_unflatten__(dict(zip(names, gathered, strict=True)), ctx, p.shape, p.stride())
    attr, cls, shape, stride = refs[0].attr if refs else "weight", type(p), p.shape, p.stride()
    entries = [StateEntry(attr if k == 0 else f"{attr}.{n}", k, g.dtype, tuple(g.shape)) for k, (n, g) in
               enumerate(zip(names, gathered, strict=True))]  # fmt: skip

    def to_full(full: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {attr: cls.__tensor_unflatten__(dict(zip(names, full, strict=True)), ctx, shape, stride)}

    def from_full(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        v: Any = values[attr]
        if type(v) is not cls or tuple(v.shape) != tuple(shape) or v.__tensor_flatten__()[1] != ctx:
            raise _error(
                fqn,
                f"the state dict holds a {type(v).__name__} of shape {tuple(v.shape)} under {attr!r}, the model an "
                f"MXTensor of shape {tuple(shape)} ({ctx['elem_dtype']}, 1 x {bs})",
                "load a state dict of this model (blockshard.full_state_dict, an unsharded model's state_dict())",
            )
        return [getattr(v, n) for n in names]

    return QuantizedTensor(
        fqn=fqn,
        refs=refs,
        format=f"torchao MXTensor ({ctx['elem_dtype']}, 1 x {bs})",
        numel=numel,
        n_units=numel // bs,
        sections=sections,
        sources=[byte_view(t.detach().contiguous()) for t in originals],
        gathered=gathered,
        targets=[byte_view(t) for t in gathered],
        unsharded=nn.Parameter(inner, requires_grad=False),
        entries=entries,
        full_names=(attr,),
        to_full=to_full,
        from_full=from_full,
    )
