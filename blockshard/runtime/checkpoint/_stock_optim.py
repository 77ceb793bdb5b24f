"""Optimizer state that only blockshard holds exactly, written so that stock FSDP2 can load it.

[Note: checkpoints across engines]
A checkpoint written through torch's ``get_state_dict`` (``torch.distributed.checkpoint.state_dict``)
holds the same keys whichever engine wrote it: parameters by name, ``state.NAME.KEY`` and
``param_groups`` of the optimizer (flattened in torchtitan's layout). A stock FSDP2 checkpoint of
AdamW loads into blockshard at another W, and the reverse, and continues bitwise
(tests/runtime/test_checkpoints_across_engines.py): DCP reshards by the global boxes each entry
names, whatever the pieces were.

Optimizer state of a kind stock FSDP2 cannot run has no such key on the other side. bitsandbytes'
8-bit state (``__bnb_optimizer_quant_state__.state1`` uint8 + ``absmax1`` per 256 elements +
``qmap1``) cannot be stepped on FSDP2's DTensors at all (bitsandbytes 0.50: "got mixed
torch.Tensor and DTensor"), so the stock side runs torch's AdamW, whose state is ``exp_avg`` /
``exp_avg_sq`` / ``step``. The refusal cannot live in blockshard: the loader is stock torch, which
never imports blockshard, and DCP reads only the keys the *loader's* state dict names. What stock
torch does, measured on torch 2.13 (the tests keep it true):

* ``dcp.load`` with the default planner raises ``CheckpointException`` (a ``BaseException``) on
  every rank: "Missing key in checkpoint state_dict: optim.state.NAME.exp_avg";
* ``dcp.load(..., planner=DefaultLoadPlanner(allow_partial_load=True))`` then ``set_state_dict``
  load silently: the moments stay the zeros torch's ``set_state_dict`` initialized, ``step`` is the
  checkpoint's; training continues with wrong numbers and nothing can refuse it;
* ``set_optimizer_state_dict(full_state_dict=True)`` of blockshard's full state dict raises
  ``KeyError: 'param_groups.0.alpha'`` (bitsandbytes' extra hyperparameters).

So blockshard gives the conversion instead: :func:`stock_adamw_state_dict` turns an optimizer state
dict of bitsandbytes' two-state 8-bit optimizers (``AdamW8bit``, ``Adam8bit``, their 32-bit state
below ``min_8bit_size``) into torch AdamW's keys, before ``dcp.save``. The moments are dequantized
exactly (``qmap[code] * absmax`` per 256-element block, the fp32 values bitsandbytes' own step
reads); the run that continues is torch's AdamW, not bitsandbytes' 8-bit one (its later steps
quantize again). State that has no AdamW meaning (Muon's ``momentum_buffer``, BlockedShampoo's
tiles, torchao's ``OptimState8bit`` entries, bitsandbytes' non-blockwise ``max1`` / ``unorm_vec``,
a one-state optimizer such as ``Lion8bit``, hyperparameters other than AdamW's) raises
:class:`~blockshard.runtime.CheckpointError` naming the parameter, the key and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from blockshard._errors import CheckpointError
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor

__all__ = ["stock_adamw_state_dict"]

_BNB_NESTED = "__bnb_optimizer_quant_state__"
_BNB_BLOCK = 256  # bitsandbytes' blockwise 8-bit state (Optimizer2State.init_state)
_MOMENTS = (("state1", "absmax1", "qmap1", "exp_avg"), ("state2", "absmax2", "qmap2", "exp_avg_sq"))
_ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")
# bitsandbytes' hyperparameters that have no AdamW meaning, with the value that changes nothing
_NEUTRAL = {"alpha": 0.0, "t_alpha": None, "t_beta3": None, "amsgrad": False, "maximize": False}
_FIX = (
    "keep training this checkpoint on blockshard (blockshard.fully_shard loads it at any W), or save it from an "
    "optimizer whose state stock FSDP2 can run"
)


def stock_adamw_state_dict(optim_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``optim_state_dict`` (torch's layout, from ``get_optimizer_state_dict`` / ``get_state_dict`` on
    a blockshard or unsharded model: sharded PieceTensor entries or full tensors) with every
    parameter's state in ``torch.optim.AdamW``'s keys and every ``param_group`` in AdamW's
    hyperparameters, for ``dcp.save`` and a stock FSDP2 + ``torch.optim.AdamW`` loader
    ([Note: checkpoints across engines]). bitsandbytes' 8-bit moments are dequantized exactly into
    fp32, its 32-bit state renamed; AdamW state passes as it is. Pure (no collective): call it on
    every rank. Raises :class:`CheckpointError` for state AdamW cannot hold."""
    if "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
        raise CheckpointError(
            f"stock_adamw_state_dict got a dict with keys {sorted(optim_state_dict)[:6]}, not torch's optimizer state "
            "dict ({'state': ..., 'param_groups': ...}). Fix: pass get_optimizer_state_dict(model, optimizer) without "
            "flatten_optimizer_state_dict, and flatten the result (torch's _flatten_optim_state_dict) afterwards"
        )
    state = {name: _adamw_entries(str(name), entries) for name, entries in optim_state_dict["state"].items()}
    groups = [_adamw_group(g) for g in optim_state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


def _adamw_entries(name: str, entries: Mapping[str, Any]) -> dict[str, Any]:
    flat = {k: v for k, v in entries.items() if k != _BNB_NESTED} | dict(entries.get(_BNB_NESTED, {}))
    if set(flat) <= set(_ADAMW_STATE):  # torch's AdamW's keys: plain fp32 moments pass as they are
        odd = [k for k, v in flat.items() if k != "step" and not _plain_float(v)]
        if odd:
            raise CheckpointError(
                f"optimizer state {odd} of parameter {name!r} is {[_kind(flat[k]) for k in odd]}, not a plain floating "
                "tensor: quantized state (torchao's OptimState8bit / OptimStateFp8 / OptimState4bit, saved by "
                "blockshard as its codes and scales) that torch's AdamW would not read. Fix: " + _FIX
            )
        return dict(flat)
    unknown = sorted(set(flat) - {"step"} - {k for m in _MOMENTS for k in m[:3]})
    if unknown:
        raise CheckpointError(
            f"optimizer state {unknown} of parameter {name!r} has no meaning for torch's AdamW (bitsandbytes' "
            "non-blockwise 8-bit state keeps max1 / new_max1 / unorm_vec; Muon keeps momentum_buffer, BlockedShampoo "
            "its tiles, torchao OptimState8bit codes and scales): converting would drop it. Fix: " + _FIX
        )
    out: dict[str, Any] = {"step": _step(name, flat.get("step"))}
    for code, absmax, qmap, key in _MOMENTS:
        if code not in flat:
            raise CheckpointError(
                f"optimizer state of parameter {name!r} has keys {sorted(flat)} and no {code!r}: it is not the state of "
                f"bitsandbytes' two-state Adam/AdamW (a one-state optimizer such as Lion8bit or SGD, or another "
                f"optimizer's state), so torch's AdamW has no {key!r} to give it. Fix: {_FIX}"
            )
        out[key] = _moment(name, flat, code, absmax, qmap)
    return out


def _plain_float(value: Any) -> bool:
    return type(value) in (torch.Tensor, PieceTensor) and value.is_floating_point()


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"entries {sorted(value)}"
    return f"{type(value).__name__} of {getattr(value, 'dtype', '?')}"


def _step(name: str, step: Any) -> torch.Tensor:
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        return step.detach().reshape(()).to(torch.float32).clone()
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        return torch.tensor(float(step), dtype=torch.float32)
    raise CheckpointError(
        f"optimizer state 'step' of parameter {name!r} is {step!r}, not a step count. Fix: pass the state dict of an "
        "optimizer that has taken steps (bitsandbytes keeps an int, torch a one-element tensor)"
    )


def _moment(name: str, flat: Mapping[str, Any], code: str, absmax: str, qmap: str) -> torch.Tensor:
    """The fp32 moment: bitsandbytes' 32-bit state as it is, its 8-bit codes as ``qmap[code] *
    absmax`` per 256-element block of the parameter's row-major flattening (a piece starts on a
    block: the bnb8bit semantics place it so)."""
    value = flat[code]
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(
            f"optimizer state {code!r} of parameter {name!r} is {_kind(value)}, not a tensor. Fix: pass the state dict "
            "as get_optimizer_state_dict returns it"
        )
    if value.dtype == torch.float32:
        return value
    if value.dtype != torch.uint8 or absmax not in flat or qmap not in flat:
        raise CheckpointError(
            f"optimizer state {code!r} of parameter {name!r} is {value.dtype} without both {absmax!r} and {qmap!r}: "
            "not bitsandbytes' blockwise 8-bit state, which is the only quantized state this conversion reads. Fix: "
            + _FIX
        )
    codes = value.to_local() if isinstance(value, PieceTensor) else value.detach().reshape(-1)
    scales = flat[absmax]
    scales = scales.to_local() if isinstance(scales, PieceTensor) else scales.detach().reshape(-1)
    if isinstance(value, PieceTensor) and value.local_start % _BNB_BLOCK:
        raise CheckpointError(
            f"optimizer state {code!r} of parameter {name!r}: this rank's piece starts at element "
            f"{value.local_start}, inside a {_BNB_BLOCK}-element block, so its absmax cannot be read. Fix: shard the "
            "parameter with bnb8bit semantics (blockshard.fully_shard(..., semantics='bnb8bit'))"
        )
    if scales.numel() != -(-codes.numel() // _BNB_BLOCK):
        raise CheckpointError(
            f"optimizer state {absmax!r} of parameter {name!r} holds {scales.numel()} scales for {codes.numel()} codes "
            f"(one per {_BNB_BLOCK} expected). Fix: pass the state dict as get_optimizer_state_dict returns it"
        )
    book: torch.Tensor = flat[qmap].detach().reshape(-1).to(torch.float32)
    fp32 = book[codes.long()] * scales.to(torch.float32).repeat_interleave(_BNB_BLOCK)[: codes.numel()]
    if isinstance(value, PieceTensor):
        return value._like(fp32)
    return fp32.reshape(value.shape)


def _adamw_group(group: Mapping[str, Any]) -> dict[str, Any]:
    defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
    odd = {k: group[k] for k, neutral in _NEUTRAL.items() if k in group and group[k] != neutral}
    if odd:
        raise CheckpointError(
            f"optimizer param_group of {list(group.get('params', []))[:3]} has {odd}: hyperparameters torch's AdamW "
            f"does not run (neutral values: {_NEUTRAL}). Fix: {_FIX}"
        )
    return (
        dict(defaults)
        | {k: group[k] for k in ("lr", "betas", "eps", "weight_decay") if k in group}
        | {"params": list(group["params"])}
    )
