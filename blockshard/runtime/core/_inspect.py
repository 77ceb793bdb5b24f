"""Inspection of a sharded model: its groups by name, layouts, global shapes, buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from blockshard.planner import GroupLayout
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._collectives import agree_call
from blockshard.runtime.core._list_groups import bind_names
from blockshard.runtime.core._param import managed_tag
from blockshard.runtime.core._state import ModuleState, state_of
from blockshard.runtime.core._tp import refuse_tp_checkpoint
from blockshard.runtime.core._traffic import CollectiveCount, tagged_traffic

__all__ = [
    "agree_on_call",
    "collective_counts",
    "global_shape",
    "global_shapes",
    "group_layouts",
    "local_buffers",
    "named_groups",
]


def agree_on_call(model: nn.Module, call: str) -> None:
    """[Note: collective headers] in _collectives.py: at the start of the public call ``call`` on
    ``model``, every rank of each process group ``model`` is sharded over makes it (one header per
    group); else every rank raises, before a collective of the call could pair with a peer's
    forward or backward."""
    seen: list[dist.ProcessGroup] = []
    for _, st in states_under(model):
        pg = st.buffers.process_group
        if all(pg is not other for other in seen):
            seen.append(pg)
            agree_call(pg, call)


def checkpoint_states(model: nn.Module, where: str) -> list[tuple[str, ModuleState | BuffersView]]:
    """:func:`states_under` for a checkpoint path that does not handle tensor-parallel groups yet
    (records, exports): refused for them ([Note: tensor-parallel parameters])."""
    states = states_under(model)
    refuse_tp_checkpoint([sp for _, st in states for sp in st.buffers.params], where)
    return states


def states_under(model: nn.Module) -> list[tuple[str, ModuleState | BuffersView]]:
    """Every group under ``model`` once, with the path of the module its names are relative to
    (a list group's modules' common ancestor, [Note: a list of modules]; one not wholly under
    ``model`` is left out)."""
    paths: dict[int, str] = {}
    states: dict[int, ModuleState] = {}
    for prefix, m in model.named_modules():
        paths.setdefault(id(m), prefix)
        if (st := state_of(m)) is not None:
            states.setdefault(id(st), st)
    out: list[tuple[str, ModuleState | BuffersView]] = []
    for st in states.values():
        if not bind_names(st, model):
            continue
        if id(st.module) not in paths:  # bound to an ancestor above model
            continue
        out.append((paths[id(st.module)], st))
        # [Note: mixed dtypes] each other dtype's buffer set is a group of its own to the readers
        out += [(paths[id(st.module)], BuffersView(st.module, g, st.modules)) for g in st.extra_param_buffers]
    return out


@dataclass(frozen=True, eq=False)
class BuffersView:
    """One extra buffer set of a mixed-dtype group, read by state dicts and checkpoints as a
    group of its own: ``module`` and ``modules`` as its :class:`ModuleState`'s, ``buffers`` the
    buffer set (a state's ``buffers`` is its primary one)."""

    module: nn.Module
    buffers: ParamBuffers
    modules: tuple[nn.Module, ...]


def named_groups(model: nn.Module) -> list[tuple[str, str, ModuleState | BuffersView]]:
    """Every group as ``(key, prefix, state)``: ``key`` the sharded module's name (a list's: its
    modules' names joined by ``+``; another buffer set's ends in ``[<dtype>]``), ``prefix`` the
    path its tensor names are relative to (as :func:`states_under`)."""
    paths = {id(m): p for p, m in reversed(list(model.named_modules()))}
    out: list[tuple[str, str, ModuleState | BuffersView]] = []
    for prefix, st in states_under(model):
        key = "+".join(paths[id(m)] for m in st.modules) if len(st.modules) > 1 else prefix
        if isinstance(st, BuffersView):  # the group's name ends in its dtype: "<group>[bfloat16]"
            key += st.buffers.name[st.buffers.name.rindex("[") :]
        out.append((key, prefix, st))
    return out


def _keyed(model: nn.Module) -> list[tuple[str, ModuleState | BuffersView]]:
    """Every group by the sharded module's name (a list's: its modules' names joined by ``+``)."""
    return [(key, st) for key, _, st in named_groups(model)]


def group_layouts(model: nn.Module) -> dict[str, GroupLayout]:
    """The layout of every group under ``model``, by the sharded module's name (a list's group:
    its modules' names joined by ``+``, e.g. ``"model.norm+lm_head"``)."""
    return {key: st.buffers.layout for key, st in _keyed(model) if st.buffers.layout is not None}


def collective_counts(model: nn.Module) -> list[CollectiveCount]:
    """This rank's collectives of every buffer set under ``model`` since it was sharded: per kind,
    wire format and dtype, the calls, the bytes they moved and the bytes the plan predicts for them
    ([Note: traffic] in _traffic.py). Also another engine's, where an adapter counts them: stock
    FSDP2 groups sharded by ``blockshard.integrations.fsdp2.fully_shard`` (buffer set ``"FSDP2"``)
    and a DeepSpeed engine with blockshard's hook (``collective_counts(engine)``). Reads counters
    only: no collective."""
    out: list[CollectiveCount] = []
    for _, st in states_under(model):
        if isinstance(st, ModuleState):
            for b in st.buffer_sets:
                out.extend(b.collective_counts())
    for path, m in model.named_modules():  # another engine's, counted by an adapter (tag_traffic)
        for name, traffic in tagged_traffic(m):
            out.extend(traffic.counts(path, name))
    return out


def global_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape by name (``model.named_parameters()`` names, tied names too).

    For a parameter the engine manages, the shape of the whole tensor, whatever piece (or empty
    ``(0,)`` piece) this rank holds; for a DeepSpeed ZeRO-3 placeholder, its ``ds_shape``; for any
    other parameter (not sharded, or an FSDP2 DTensor, whose ``shape`` is already global), its own
    shape. Names are stable across sharding.
    """
    managed = {
        id(p): sp.shape for _, st in states_under(model) for sp in st.buffers.params for p in (sp.sharded, sp.unsharded)
    }
    return {n: managed.get(id(p), partitioned_shape(p)) for n, p in model.named_parameters(remove_duplicate=False)}


def partitioned_shape(p: torch.Tensor) -> tuple[int, ...]:
    """``p``'s whole shape where another engine partitioned it in place: DeepSpeed ZeRO-3 (and
    ``deepspeed.zero.Init``) leaves each parameter a 1-D placeholder and keeps its shape as
    ``ds_shape``; ``p``'s own shape for anything else."""
    shape = getattr(p, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(p.shape)


def global_shape(p: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor ``p`` is a piece of (its own shape for anything else: a
    parameter that is not sharded, or an FSDP2 DTensor, whose ``shape`` is global already).

    For code written for one process that chooses by shape (``p.ndim >= 2`` for weight decay,
    ``p.ndim == 2`` for Muon): on a sharded model a piece's own shape is its block shape here
    (flat, a row stripe, empty), so choose by ``len(blockshard.global_shape(p)) >= 2``. A sharded
    piece also carries it as ``p.global_shape``. A parameter DeepSpeed ZeRO-3 (or
    ``deepspeed.zero.Init``) partitioned in place gives its ``ds_shape``.
    """
    tag = managed_tag(p)
    if tag is not None and not tag.original and tag.group is not None:
        buffers = tag.group()  # type: ignore[operator]  # a weakref.ref to the ParamBuffers
        if buffers is not None:
            for sp in buffers.params:
                if sp.sharded is p:
                    return torch.Size(sp.shape)
    return torch.Size(partitioned_shape(p))


def local_buffers(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The buffers of every group, for memory checks: ``local`` (persistent) and ``grad`` while a
    sharded ``.grad`` views it (see [Note: buffers] in _buffers.py)."""
    out = {}
    for prefix, st in _keyed(model):
        if st.buffers.layout is not None:
            out[prefix] = {"local": st.buffers.local}
            if (grad := st.buffers.grad_buffer()) is not None:
                out[prefix]["grad"] = grad
    return out


def state_name(fqn: str) -> str:
    """A name as ``state_dict()`` gives it: without torch's ``checkpoint_wrapper`` level (its
    hooks drop ``_checkpoint_wrapped_module.``, as DCP's ``get_state_dict`` does), so state saved
    with activation checkpointing loads without it and back."""
    return fqn.replace(_CHECKPOINT_PREFIX, "")


_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper._CHECKPOINT_PREFIX


def join_name(prefix: str, name: str) -> str:
    return state_name(f"{prefix}.{name}" if prefix else name)
