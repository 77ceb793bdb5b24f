"""This rank's rows of the report: every group and parameter, measured from what the engines hold.

Each row carries this rank's figures only (``held_bytes`` and ``data_bytes`` of length 1); the
report gathers them and joins them rank by rank (``_build.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from blockshard.planner import GroupLayout
from blockshard.runtime._report._external import PartitionGroup, PartitionSource, PlacementNote, placement_note
from blockshard.runtime._report._model import GroupRow, ParamRow
from blockshard.runtime.core._inspect import named_groups, state_name
from blockshard.runtime.core._owners import OwnerComputed
from blockshard.runtime.core._state import ModuleState, state_of
from blockshard.runtime.quantized._frozen import FrozenQuantizedBuffers, frozen_buffers
from blockshard.runtime.quantized._gather import QuantizedGatherBuffers

__all__ = ["Collected", "collect"]


@dataclass
class Collected:
    """This rank's rows and the process group the model is sharded over (``None``: not sharded)."""

    groups: list[GroupRow] = field(default_factory=list)
    params: list[ParamRow] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    process_groups: list[dist.ProcessGroup] = field(default_factory=list)
    managed: set[int] = field(default_factory=set)  # ids of parameter objects the rows cover
    notes: list[str] = field(default_factory=list)

    def engine(self, name: str, pg: dist.ProcessGroup) -> None:
        if name not in self.engines:
            self.engines.append(name)
        if all(pg is not other for other in self.process_groups):
            self.process_groups.append(pg)


def _dtype(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def collect(model: nn.Module, sources: list[PartitionSource]) -> Collected:
    out = Collected()
    _ragged(model, out)
    _fsdp2(model, out)
    for src in sources:
        _partitions(model, src, out)
    _replicated(model, out, bool(sources))
    return out


# -- blockshard's engine --------------------------------------------------------------------------
def _ragged(model: nn.Module, out: Collected) -> None:
    for key, prefix, st in named_groups(model):
        b = st.buffers
        layout = b.layout
        pre = f"{prefix}." if prefix else ""
        if isinstance(st, ModuleState) and (fq := frozen_buffers(st)) is not None:
            _frozen(key, pre, fq, out)
        if layout is None:
            continue
        out.engine("blockshard", b.process_group)
        how = "blockshard ragged" + (" (quantized gather)" if isinstance(b, QuantizedGatherBuffers) else "")
        itemsize = b.local.element_size()
        holes = _holes_after(layout)
        index = {t.name: t for t in layout.tensors}
        data = 0
        for sp in b.params:
            t = index[sp.fqn]
            out.managed |= {id(sp.sharded), id(sp.unsharded)}
            data += sp.local_numel * itemsize
            out.params.append(
                ParamRow(
                    name=state_name(pre + sp.fqn),
                    group=key,
                    shape=tuple(sp.shape),
                    dtype=_dtype(b.orig_dtype),
                    sharded=True,
                    how=how,
                    semantics=t.semantics,
                    placement_unit_numel=t.grid.unit_numel,
                    **_compute(b.owner_computed, sp.fqn, t.grid.unit_numel),  # type: ignore[arg-type]
                    held_bytes=(sp.local_numel * itemsize,),
                    padding_bytes=holes[sp.fqn] * itemsize,
                )
            )
        held = b.local.numel() * itemsize
        out.groups.append(
            GroupRow(
                name=key,
                how=how,
                dtype=_dtype(b.orig_dtype),
                world_size=layout.world_size,
                num_params=len(b.params),
                total_bytes=layout.total_numel * itemsize,
                held_bytes=(held,),
                data_bytes=(data,),
                padding_bytes=(layout.padded_numel - layout.total_numel) * itemsize,
                note=_QGATHER_NOTE if isinstance(b, QuantizedGatherBuffers) else "",
            )
        )


_QGATHER_NOTE = (
    "the float masters; the quantized segment each rank also keeps is blockshard.quantized_gather_stats' local_bytes"
)


def _compute(entry: OwnerComputed | None, fqn: str, placement: int) -> dict[str, object]:
    """Compute unit, policy and owners of tensor ``fqn`` ([Note: engine owner plan])."""
    if entry is None or fqn not in entry.compute:
        return {"compute_unit_numel": placement, "policy": "whole"}
    owners = tuple(sorted({o for _, _, o in entry.units.get(fqn, ())}))
    return {"compute_unit_numel": entry.compute[fqn].unit_numel, "policy": "owner", "owner_ranks": owners}


def _holes_after(layout: GroupLayout) -> dict[str, int]:
    """Padding after each tensor in its bucket (holes lie only between tensors and after the last)."""
    out: dict[str, int] = {}
    for i, t in enumerate(layout.tensors):
        nxt = layout.tensors[i + 1] if i + 1 < len(layout.tensors) else None
        end = nxt.offset if nxt is not None and nxt.bucket == t.bucket else layout.world_size * layout.buckets[t.bucket]
        out[t.name] = end - t.end
    return out


def _frozen(key: str, pre: str, fq: FrozenQuantizedBuffers, out: Collected) -> None:
    out.engine("blockshard", fq.process_group)
    lay, rank = fq.layout, fq.rank
    held_by = {p.tensor: sum(hi - lo for lo, hi, _ in p.ranges) for p in lay.pieces[rank]}
    for i, t in enumerate(fq.tensors):
        out.managed |= {id(t.sharded), id(t.unsharded), *map(id, t.extra_sharded), *(id(p) for _, p in t.extra)}
        out.params.append(
            ParamRow(
                name=state_name(pre + t.fqn),
                group=f"{key}[quantized weights]",
                shape=tuple(t.unsharded.shape),
                dtype=t.format,
                sharded=True,
                how=f"blockshard ragged (frozen quantized bytes{', by whole tiles' if t.tiles is not None else ''})",
                placement_unit_numel=t.numel // max(t.n_units, 1),
                held_bytes=(held_by.get(i, 0),),
                note="padding is per group (the byte layout packs every tensor's sections)",
            )
        )
    out.groups.append(
        GroupRow(
            name=f"{key}[quantized weights]",
            how="blockshard ragged (frozen quantized bytes)",
            dtype="uint8",
            world_size=lay.world_size,
            num_params=len(fq.tensors),
            total_bytes=lay.total_bytes,
            held_bytes=(fq.local.numel(),),
            data_bytes=(lay.rank_bytes(rank),),
            padding_bytes=lay.world_size * lay.segment_bytes - lay.total_bytes,
        )
    )


# -- stock FSDP2 (DTensor parameters) --------------------------------------------------------------
def _fsdp2(model: nn.Module, out: Collected) -> None:
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        dims = [(i, pl.dim) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
        local = p.to_local()
        itemsize = local.element_size()
        out.managed.add(id(p))
        shape = tuple(p.shape)
        note = placement_note(p)
        if len(dims) != 1:
            out.params.append(_dtensor_row(name, p, local, "DTensor " + str(p.placements), None, note))
            continue
        mesh_dim, dim = dims[0]
        W = mesh.size(mesh_dim)
        out.engine("fsdp2", mesh.get_group(mesh_dim))
        rest = math.prod(shape) // shape[dim] if shape[dim] else 0
        padded_rows = -(-shape[dim] // W)  # FSDP2 pads every rank's shard to ceil(rows / W) rows
        padding = (W * padded_rows * rest - math.prod(shape)) * itemsize
        out.params.append(_dtensor_row(name, p, local, f"FSDP2 Shard({dim})", padding, note))
        out.groups.append(
            GroupRow(
                name=name,
                how=f"FSDP2 Shard({dim})",
                dtype=_dtype(p.dtype),
                world_size=W,
                num_params=1,
                total_bytes=math.prod(shape) * itemsize,
                held_bytes=(padded_rows * rest * itemsize,),
                data_bytes=(local.numel() * itemsize,),
                padding_bytes=padding,
                note="one row per parameter: FSDP2 pads each parameter's shard on its own",
            )
        )


def _dtensor_row(
    name: str, p: DTensor, local: torch.Tensor, how: str, padding: int | None, known: PlacementNote | None
) -> ParamRow:
    return ParamRow(
        name=name,
        group=name,
        shape=tuple(p.shape),
        dtype=_dtype(p.dtype),
        sharded=True,
        how=how,
        semantics=known.semantics if known else None,
        placement_unit_numel=known.placement_unit_numel if known else None,
        compute_unit_numel=known.compute_unit_numel if known else None,
        policy=("owner" if known.owner_compute else "whole") if known else None,
        held_bytes=(local.numel() * local.element_size(),),
        padding_bytes=padding,
        note=known.reason
        if known
        else "semantics unknown: sharded by torch's fully_shard without blockshard.integrations.fsdp2",
    )


# -- ZeRO partitions (the DeepSpeed hook) ----------------------------------------------------------
def _partitions(model: nn.Module, src: PartitionSource, out: Collected) -> None:
    names = {id(p): state_name(n) for n, p in model.named_parameters()}
    how = f"{src.blockshard_engine()} partition"
    for i, g in enumerate(src.blockshard_partitions()):
        out.engine("deepspeed", g.process_group)
        rank = dist.get_rank(group=g.process_group)
        lay = g.layout
        itemsize = g.partition.element_size()
        held_of = {t: n for t, _, _, n in lay.pieces(rank)}
        name = f"{src.blockshard_engine()} param_group {i}"
        for t, pname in enumerate(g.names):
            out.params.append(
                ParamRow(
                    name=f"{names.get(id(g.params[t]), pname)} [masters]",
                    group=name,
                    shape=g.shapes[t],
                    dtype=_dtype(g.partition.dtype),
                    sharded=True,
                    how=how,
                    semantics=g.semantics[t],
                    placement_unit_numel=g.unit_numels[t],
                    held_bytes=(held_of.get(t, 0) * itemsize,),
                    padding_bytes=lay.paddings[t] * itemsize,
                    note="the fp32 master copy and optimizer state are partitioned; the parameter is whole on every rank",
                )
            )
        out.groups.append(_partition_group(name, how, g, rank, itemsize))


def _partition_group(name: str, how: str, g: PartitionGroup, rank: int, itemsize: int) -> GroupRow:
    lay = g.layout
    return GroupRow(
        name=name,
        how=how,
        dtype=_dtype(g.partition.dtype),
        world_size=lay.world_size,
        num_params=len(g.names),
        total_bytes=lay.data_numel * itemsize,
        held_bytes=(g.partition.numel() * itemsize,),
        data_bytes=(sum(n for _, _, _, n in lay.pieces(rank)) * itemsize,),
        padding_bytes=lay.padding_numel * itemsize,
        note="ZeRO-1/2 partitions masters, gradients and optimizer state, not parameters",
    )


# -- replicated ------------------------------------------------------------------------------------
def _replicated(model: nn.Module, out: Collected, zero: bool) -> None:
    ignored: dict[int, str] = {}
    under: set[int] = set()
    for m in model.modules():
        st = state_of(m)
        if st is not None:
            ignored.update(dict.fromkeys(st.ignored_ids, st.name))
            under |= {id(p) for p in m.parameters()}
    for name, p in _plain(model, out.managed):
        if id(p) in ignored:
            why = f"in ignored_params of fully_shard({ignored[id(p)]}): left whole, its gradients not reduced"
        elif zero:
            why = "ZeRO stage 1/2 keeps whole parameters on every rank (its partitions are listed above)"
        elif id(p) in under:
            why = "under a fully_shard module but not managed by it (added after fully_shard?)"
        else:
            why = "not under any fully_shard"
        nbytes = p.numel() * p.element_size()
        out.params.append(
            ParamRow(
                name=name,
                group="",
                shape=tuple(p.shape),
                dtype=_dtype(p.dtype),
                sharded=False,
                how="replicated",
                held_bytes=(nbytes,),
                note=why,
            )
        )


def _plain(model: nn.Module, managed: set[int]) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters():
        if id(p) not in managed:
            yield state_name(name), p
