"""bitsandbytes ``Params4bit`` (NF4/FP4, ``Linear4bit``) as a :class:`QuantizedTensor`.

Sections (one unit grid, see [Note: quantized layout]):
  * without nested statistics, a unit is one quantization block of ``blocksize`` values:
    ``blocksize / 2`` payload bytes and one fp32 absmax (4 bytes);
  * with nested statistics (``compress_statistics=True``) a unit is one nested block of
    ``state2.blocksize`` (256) blocks: ``128 * blocksize`` payload bytes, 256 uint8 absmax and one
    fp32 ``state2.absmax``; the tensor's last unit may be shorter.
The payload moves as bytes whatever ``quant_storage`` is (a bf16-stored payload is ``uint8``-viewed).
Replicated: the code tables (16 or 256 fp32) and the nested ``offset`` (one fp32 scalar).
The unsharded parameter is a new ``Params4bit`` over the gathered tensors with a copy of the quant
state, so ``Linear4bit.forward`` (and peft's LoRA wrapper around it) runs unchanged. State-dict
entries: bitsandbytes' own names ([Note: quantized state dicts]).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from blockshard._errors import QuantizedWeightError
from blockshard.runtime.core._param import ParamRef
from blockshard.runtime.quantized._layout import SectionShape
from blockshard.runtime.quantized._tensor import QuantizedTensor, SharedConstants, StateEntry, byte_view

if TYPE_CHECKING:
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

__all__ = ["bnb_tensor", "is_params4bit"]


def is_params4bit(param: object) -> bool:
    if not type(param).__module__.startswith("bitsandbytes."):  # never import bitsandbytes for other parameters
        return False
    try:
        from bitsandbytes.nn import Params4bit
    except ImportError:  # bitsandbytes is an optional extra
        return False
    return isinstance(param, Params4bit)


def _error(fqn: str, what: str, fix: str) -> QuantizedWeightError:
    return QuantizedWeightError(f"quantized weight {fqn!r} (bitsandbytes Params4bit): {what}. Fix: {fix}")


def _check(fqn: str, p: Params4bit, qs: QuantState | None) -> tuple[int, int]:
    """Validate ``p`` and its quant state; return (numel, number of quantization blocks)."""
    if qs is None or not p.bnb_quantized:
        raise _error(
            fqn,
            "it is not quantized yet (bitsandbytes quantizes a Params4bit when it moves to a device)",
            "move the model to its device before fully_shard, e.g. model.to('cpu') or model.to('cuda')",
        )
    if getattr(qs, "packing_format_for_cpu", False):
        raise _error(
            fqn,
            "its payload was repacked for AVX512 inference by an eval forward (packing_format_for_cpu)",
            "call fully_shard before the first forward in eval mode",
        )
    if p.requires_grad:
        raise _error(fqn, "it requires grad; 4-bit weights are frozen", "freeze it (p.requires_grad_(False))")
    if (p.quant_type, p.blocksize, p.compress_statistics) != (qs.quant_type, qs.blocksize, qs.nested):
        raise _error(
            fqn,
            f"mixed quant states: the parameter says quant_type={p.quant_type!r}, blocksize={p.blocksize}, "
            f"compress_statistics={p.compress_statistics}, its quant_state quant_type={qs.quant_type!r}, "
            f"blocksize={qs.blocksize}, nested={qs.nested}",
            "re-quantize the weight so that parameter and quant_state agree (one Params4bit per quant_state)",
        )
    numel, bs = math.prod(qs.shape), qs.blocksize
    if bs % 2 or numel % bs:
        raise _error(
            fqn,
            f"its {numel} values (shape {tuple(qs.shape)}) are not a whole number of {bs}-value quantization "
            "groups, so no shard boundary can keep every group whole",
            f"quantize only weights whose numel is a multiple of the blocksize {bs}; keep this one unquantized "
            "(e.g. in ignored_params, or an nn.Linear)",
        )
    n_blocks = numel // bs
    payload = p.data.numel() * p.data.element_size()
    if payload != numel // 2 or qs.absmax.numel() != n_blocks:
        raise _error(
            fqn,
            f"its payload has {payload} bytes and {qs.absmax.numel()} absmax values; {numel} 4-bit values in "
            f"{bs}-value blocks need {numel // 2} bytes and {n_blocks} absmax",
            "re-quantize the weight (the quant_state belongs to another tensor)",
        )
    if qs.nested:
        bs2, n2 = qs.state2.blocksize, qs.state2.absmax.numel()
        if qs.absmax.dtype != torch.uint8 or n2 != -(-n_blocks // bs2):
            raise _error(
                fqn,
                f"its nested statistics do not fit: {n_blocks} {qs.absmax.dtype} absmax in nested blocks of "
                f"{bs2} need {-(-n_blocks // bs2)} state2 absmax, it has {n2}",
                "re-quantize the weight with compress_statistics=True (or False) so its state2 fits its absmax",
            )
    return numel, n_blocks


def _shared(t: torch.Tensor, constants: SharedConstants) -> tuple[torch.Tensor, int]:
    """One copy per group of equal constants (every NF4 tensor has the same 16-value code, every
    nested one the same 256-value dynamic map): the tensor to use and the bytes it adds."""
    key = (t.dtype, tuple(t.shape), byte_view(t.detach().contiguous()).cpu().numpy().tobytes())
    if key in constants:
        return constants[key], 0
    constants[key] = t
    return t, t.numel() * t.element_size()


def bnb_tensor(fqn: str, refs: list[ParamRef], p: Params4bit, constants: SharedConstants) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of a bitsandbytes ``Params4bit`` (validated, see ``_check``);
    ``constants``: the group's shared constants (see ``_shared``)."""
    from bitsandbytes.nn import Params4bit

    qs = p.quant_state
    numel, n_blocks = _check(fqn, p, qs)
    bs = qs.blocksize
    payload, absmax = p.data.detach(), qs.absmax
    sections: tuple[SectionShape, ...]
    if qs.nested:
        per = qs.state2.blocksize
        units = -(-n_blocks // per)
        originals = [payload, absmax, qs.state2.absmax]
        sections = (
            SectionShape("payload", numel // 2, per * bs // 2),
            SectionShape("absmax", n_blocks, per),
            SectionShape("state2.absmax", 4 * units, 4),
        )
    else:
        units = n_blocks
        originals = [payload, absmax]
        sections = (SectionShape("payload", numel // 2, bs // 2), SectionShape("absmax", 4 * n_blocks, 4))
    gathered = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in originals]
    state = copy.copy(qs)  # shape, dtype, offset shared (replicated constants)
    state.absmax = gathered[1]
    state.code, added = _shared(qs.code, constants)
    if qs.nested:
        state.state2 = copy.copy(qs.state2)
        state.state2.absmax = gathered[2]
        state.state2.code, more = _shared(qs.state2.code, constants)
        added += more + 4  # + the offset (one fp32 per tensor)
    unsharded = Params4bit(
        gathered[0],
        requires_grad=False,
        quant_state=state,
        blocksize=bs,
        compress_statistics=p.compress_statistics,
        quant_type=p.quant_type,
        quant_storage=p.quant_storage,
        module=p.module,
        bnb_quantized=True,
    )
    entries = _entries(refs[0].attr if refs else "weight", state, gathered)
    storage = "uint8" if payload.dtype == torch.uint8 else str(payload.dtype).removeprefix("torch.")
    nested = "nested absmax" if qs.nested else "fp32 absmax"
    return QuantizedTensor(
        fqn=fqn,
        refs=refs,
        format=f"bitsandbytes {qs.quant_type} ({nested}, {storage} storage)",
        numel=numel,
        n_units=units,
        sections=sections,
        sources=[byte_view(t.detach().contiguous()) for t in originals],
        gathered=gathered,
        targets=[byte_view(t) for t in gathered],
        unsharded=unsharded,
        constant_bytes=added,
        entries=entries,
    )


def _entries(attr: str, state: QuantState, gathered: list[torch.Tensor]) -> list[StateEntry]:
    """The state-dict entries ``Linear4bit._save_to_state_dict`` writes (the payload, then
    ``QuantState.as_dict(packed=True)`` under ``weight.``): gathered tensors as sections, the rest
    (code tables, the packed non-tensor state with the nested offset) as constants."""
    out = [StateEntry(attr, 0, gathered[0].dtype, tuple(gathered[0].shape))]
    for k, v in state.as_dict(packed=True).items():
        section = next((i for i, g in enumerate(gathered) if v is g), None)
        constant = None if section is not None else v.detach().clone()
        out.append(StateEntry(f"{attr}.{k}", section, v.dtype, tuple(v.shape), constant))
    return out


def prepare_module(module: nn.Module) -> None:
    """A ``Linear4bit`` under frozen quantized buffers must keep bitsandbytes' canonical packing: its
    eval-mode AVX512 path rewrites ``weight.data`` in place on the first forward (repacking the
    gathered tensors), so it is turned off for the modules the group manages."""
    if hasattr(module, "support_avx512bf16_for_cpu"):
        module.__dict__["support_avx512bf16_for_cpu"] = False
