"""Parameters of several dtypes in one ``fully_shard`` group: one flat buffer (and collective) per dtype.

[Note: mixed dtypes]
FSDP2 (torch 2.13, ``_fsdp_param_group.py``, ``_init_mp_dtypes``) accepts parameters of several
dtypes in one group only if its *trainable* parameters share one original dtype (and so one reduce
dtype): frozen ones may differ (a bf16 base model under fp32 adapters, integer tables). It then
all-gathers them as bytes in one collective. blockshard does the same with one planned layout and
one buffer set per dtype: the group's trainable dtype (or, if nothing is trainable, its first
parameter's) is the *primary* buffer set, ``state.buffers``; each other dtype gets its own
(``ParamBuffers(trainable=False)`` in ``state.buffer_sets``, named ``<group>[bfloat16]``...),
gathered with the primary one (all all-gathers issued, then waited for) and resharded with it, and
never reduced (it holds no trainable parameter). ``mp_policy``'s ``param_dtype`` applies to every
floating-point buffer set, as FSDP2 casts every floating-point parameter; integer ones are gathered
as they are. As in FSDP2,
trainable parameters of two dtypes in one group are refused, at ``fully_shard`` and whenever a
forward finds one unfrozen since (FSDP2 checks at its first forward): put them in different groups,
or cast them to one dtype. State dicts, ``full_state_dict``, checkpoints and exports see every
buffer set as a group of its own under the module's prefix. One kind of extra buffer set does
train: the weights gathered quantized ([Note: quantized gather] in _gather.py), which reduces its
gradients beside the primary one (``ModuleState.training_sets``) and may hold a dtype of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from blockshard._errors import BlockshardError, ShardingError
from blockshard.runtime.core._param import ParamRef

if TYPE_CHECKING:
    from blockshard.runtime.core._buffers import ParamBuffers

__all__ = ["check_trainable_dtypes", "split_by_dtype"]

_Part = tuple[list[str], list[nn.Parameter], list[list[ParamRef]]]


def _error(message: str) -> BlockshardError:
    return ShardingError(message)


def split_by_dtype(names: list[str], params: list[nn.Parameter], refs: list[list[ParamRef]]) -> list[_Part]:
    """The group's parameters by dtype, the primary dtype first ([Note: mixed dtypes]); one empty
    part for a module without parameters of its own."""
    trainable = {p.dtype: n for n, p in zip(names, params, strict=True) if p.requires_grad}
    if len(trainable) > 1:
        raise _error(_mixed_message(sorted(trainable.items(), key=str)))
    if not params:
        return [([], [], [])]
    primary = next(iter(trainable)) if trainable else params[0].dtype
    dtypes = [primary] + [d for d in dict.fromkeys(p.dtype for p in params) if d != primary]
    parts = []
    for d in dtypes:
        keep = [i for i, p in enumerate(params) if p.dtype == d]
        parts.append(([names[i] for i in keep], [params[i] for i in keep], [refs[i] for i in keep]))
    return parts


def _mixed_message(examples: list[tuple[torch.dtype, str]]) -> str:
    shown = ", ".join(f"{n!r} ({str(d).removeprefix('torch.')})" for d, n in examples)
    return (
        f"trainable parameters of several dtypes in one group: {shown}. As FSDP2 (which expects a uniform "
        "original dtype for the parameters it reduces), one group reduces gradients of one dtype; frozen "
        "parameters may have other dtypes. Fix: cast them to one dtype before fully_shard, freeze the "
        "others, or shard the modules that hold them in separate fully_shard calls"
    )


def check_trainable_dtypes(primary: ParamBuffers, buffer_sets: list[ParamBuffers]) -> None:
    """Raise if a parameter of a frozen buffer set (another dtype's) was unfrozen after ``fully_shard``."""
    for g in buffer_sets:
        if g.trainable:  # the primary, or a quantized gather's ([Note: quantized gather]): it reduces
            continue
        for sp in g.params:
            if sp.sharded.requires_grad:
                first = next((q.fqn for q in primary.params if q.sharded.requires_grad), None)
                examples = [(g.orig_dtype, sp.fqn)] + ([(primary.orig_dtype, first)] if first else [])
                if first is None:
                    raise _error(
                        f"parameter {sp.fqn!r} ({g.orig_dtype}) of group {primary.name!r} was unfrozen after "
                        f"fully_shard, while the group was planned to reduce {primary.orig_dtype} gradients (its "
                        "trainable dtype then). Fix: set requires_grad before fully_shard, or shard it in a "
                        "separate fully_shard call"
                    )
                raise _error(_mixed_message(examples))


# -- state dicts of the extra buffer sets ------------------------------------------------------
