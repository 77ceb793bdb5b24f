"""Tensor-parallel parameters in the engine: a DTensor on a ``tp`` mesh, sharded over ``dp``.

[Note: tensor-parallel parameters]
torchtitan's 2-D recipe first applies tensor parallelism (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` on ``mesh["tp"]``), which turns
parameters into DTensors on that 1-D mesh, then ``fully_shard(module, mesh=mesh["dp"])``.
blockshard's engine takes the same call:

* **what is sharded over dp is the TP-local tensor** (``p.to_local()``, the rank's own TP piece):
  its shape is what the group plans, and block semantics are stated for it. Before that,
  :func:`check_tp_units` states the semantics on the *global* tensor and refuses a TP placement
  that cuts one of its units (``split_units`` of [Note: TP and EP plans]: an 8-bit block, a
  Shampoo or FP8 tile straddling a cut), naming the parameter, its placement and the fix: one
  process would compute on units no rank holds whole. The one split it lets through is Muon's
  ``matrix``: the TP-local matrix is then the dp plan's unit, ``blockshard.optim.Muon`` runs
  Newton-Schulz on the matrix gathered across tp ([Note: Muon across tensor parallelism] in
  optim/_muon.py), and the optimizer guard refuses any other optimizer on a TP-split piece but
  element-wise ones and blockwise 8-bit ones whose blocks the cut keeps whole (``_check_tp_cut`` in
  _optim_guard.py).
* **the unsharded parameter is a DTensor again**: the gathered view of the TP-local tensor wrapped
  with the original mesh, placements, global shape and stride (no copy), so the module's TP hooks
  and every DTensor op in forward and backward run exactly as under TP alone.
* **gradients**: autograd accumulates a DTensor gradient; it is redistributed to the parameter's
  placements where it differs (a ``Partial`` gradient of a replicated ``SequenceParallel`` norm is
  summed over tp, as FSDP2 does), and its local tensor is what the reduce-scatter over dp reads
  (copied in: a DTensor parameter cannot take a plain view as ``.grad``, so [Note: gradient views]
  skips it).
* **between steps** the sharded piece is a plain tensor (a piece of the TP-local tensor), as for
  every other parameter, and element-wise optimizers step it as they step FSDP2's DTensor pieces:
  bitwise what stock FSDP2 with the same TP plan computes. ``blockshard.clip_grad_norm_`` sums the
  norms of TP-sharded pieces over tp as well as dp (replicated ones over dp only).

* **checkpoints**: a TP parameter's state-dict entries (``model.state_dict()``, element-wise
  optimizer state of ``blockshard.optimizer_state_dict``, torch's ``get_state_dict`` routes) are
  :class:`PieceTensor` s of its *global* shape whose piece is given as boxes of the global tensor
  (its run of the TP-local tensor, shifted to where that sits: ``TPSpec.boxes``), spread over every
  rank; DCP reshards them between any (dp, tp) layouts and to and from stock FSDP2 + TP.
  ``full_state_dict`` gathers over dp, then tp.
* **meta-device models** (torchtitan's flow: build on meta, parallelize, ``fully_shard``,
  ``to_empty``, then initialize): ``blockshard.init_parameters`` runs each module's
  ``reset_parameters`` on the unsharded DTensors, so the values are the TP model's without dp
  sharding, whatever the dp layout.

``save_checkpoint``'s record gives each TP tensor's placement, degree and global shape beside its
TP-local layout over dp.

Not done (each refused by name, never silent): ``sharded_state_dict``, Hugging Face and peft
exports of TP groups, a dp x tp mesh that
is not the whole world in a state dict, quantized gather of TP parameters, a mesh
with more than one dim per parameter, ``Partial`` and strided placements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from blockshard._arith import run_boxes
from blockshard._errors import ShardingError
from blockshard.planner._parallel import Placement, split_units
from blockshard.semantics import TensorSpec

__all__ = ["TPSpec", "check_tp_units", "refuse_tp_checkpoint", "tp_local", "tp_spec_of"]


@dataclass(frozen=True, eq=False)
class TPSpec:
    """How a TP-local tensor sits in its DTensor: the mesh, placements, global shape and stride."""

    mesh: Any  # DeviceMesh (1-D)
    placements: tuple[Any, ...]
    shape: tuple[int, ...]  # global
    stride: tuple[int, ...]
    offsets: tuple[int, ...]  # where this rank's TP-local tensor starts in the global one

    @property
    def group(self) -> dist.ProcessGroup:
        return cast(dist.ProcessGroup, self.mesh.get_group())

    @property
    def shard_dim(self) -> int | None:
        """The dim the tp axis cuts (None: replicated over tp)."""
        from torch.distributed.tensor import Shard

        p = self.placements[0]
        return p.dim if isinstance(p, Shard) else None

    @property
    def cut(self) -> bool:
        """Whether the tp axis cuts the tensor (a ``Shard`` placement over more than one tp rank)."""
        return self.shard_dim is not None and self.mesh.size() > 1

    def splits_units(self, name: str, dtype: torch.dtype, semantics: str) -> bool:
        """Whether the tp cut splits a unit of ``semantics`` stated on the global tensor (``split_units``
        of [Note: TP and EP plans])."""
        dim = self.shard_dim
        if dim is None or not self.cut:
            return False
        local = list(self.shape)
        local[dim] = -(-local[dim] // self.mesh.size())
        spec = TensorSpec(name=name, shape=self.shape, dtype=dtype)
        place = Placement(name, "dtensor", "tp", dim, self.mesh.size(), self.shape, tuple(local))
        return bool(split_units([spec], [place], semantics))

    def cuts_matrices(self, ndim: int) -> bool:
        """Whether the tp cut runs through the trailing ``(m, n)`` matrices of an ``ndim``-D tensor (a
        cut of dim 0 of a stacked ``(E, m, n)`` expert tensor, expert parallelism, keeps every
        expert's matrix whole)."""
        dim = self.shard_dim
        return dim is not None and self.cut and dim >= ndim - 2

    @property
    def label(self) -> str:
        return f"{self.placements[0]!r} over a tp mesh of {self.mesh.size()}"

    def boxes(
        self, local_shape: tuple[int, ...], start: int, numel: int
    ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Elements ``[start, start + numel)`` of the TP-local tensor's row-major flattening as boxes of
        the global tensor, in that order (each box row-major): a state-dict entry's boxes."""
        return [
            (tuple(o + at for o, at in zip(offsets, self.offsets, strict=True)), sizes)
            for offsets, sizes in run_boxes(local_shape, start, start + numel)
        ]

    def local_of(self, full: torch.Tensor, local_shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's TP-local part of a whole tensor of the global shape."""
        return full[tuple(slice(o, o + n) for o, n in zip(self.offsets, local_shape, strict=True))]

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """A DTensor over ``local`` (no copy), outside autograd: a leaf, as the original parameter was."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            return DTensor.from_local(
                local, self.mesh, self.placements, run_check=False, shape=torch.Size(self.shape), stride=self.stride
            )

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole global tensor from every tp rank's ``local`` (collective over tp)."""
        from torch.distributed.tensor import DTensor

        return cast(DTensor, self.wrap(local)).full_tensor()

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of a DTensor gradient, redistributed to the parameter's placements first."""
        from torch.distributed.tensor import DTensor

        if not isinstance(grad, DTensor):  # a plain gradient assigned by the user: already local
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(self.mesh, self.placements)
        return grad.to_local()


def tp_spec_of(name: str, p: nn.Parameter, dp_group: dist.ProcessGroup) -> TPSpec | None:
    """The :class:`TPSpec` of a DTensor parameter (None for a plain one), checked: a 1-D mesh other
    than the one sharded over, ``Shard`` or ``Replicate``, a plain contiguous local tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    fix = (
        "Fix: apply tensor parallelism on a 1-D tp mesh (parallelize_module(model, mesh['tp'], plan)) and "
        "fully_shard over the dp mesh (mesh['dp']), as torchtitan does"
    )
    if mesh.ndim != 1:
        raise ShardingError(
            f"parameter {name!r} is a DTensor on a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; blockshard shards "
            f"DTensors of a 1-D tensor-parallel mesh over the data-parallel one. {fix}"
        )
    bad = [pl for pl in placements if type(pl) not in (Shard, Replicate)]
    if bad:
        raise ShardingError(
            f"parameter {name!r} is a DTensor with placement {bad[0]}; blockshard shards TP parameters placed "
            f"Shard(dim) or Replicate() (a Partial or strided parameter has no one local value to shard). {fix}"
        )
    tp_group = mesh.get_group()
    if tp_group is dp_group or (
        dist.get_world_size(tp_group) > 1 and dist.get_process_group_ranks(tp_group) == _ranks(dp_group)
    ):
        raise ShardingError(
            f"parameter {name!r} is a DTensor on the mesh fully_shard shards over; blockshard shards the "
            f"TP-local tensor over another (data-parallel) mesh. {fix}"
        )
    shared = sorted(set(_ranks(tp_group)) & set(_ranks(dp_group)))
    if len(shared) > 1:  # the dp group holds other tp ranks: their TP-local tensors are other parts
        raise ShardingError(
            f"parameter {name!r} is a DTensor placed over the tp ranks {_ranks(tp_group)}, and the group "
            f"fully_shard shards over (ranks {_ranks(dp_group)}) holds {len(shared)} of them: their TP-local "
            "tensors are different parts of the weight, not pieces of one tensor (a fully_shard without mesh= "
            f"shards over every rank). {fix}"
        )
    local = p.to_local()
    if type(local) is not torch.Tensor and not isinstance(local, nn.Parameter):
        raise ShardingError(
            f"parameter {name!r} is a DTensor whose local tensor is a {type(local).__name__}; blockshard shards "
            "plain local tensors. Fix: convert it to a plain tensor before fully_shard"
        )
    offsets = [0] * p.ndim
    if isinstance(placements[0], Shard):  # torch.chunk's split, as DTensor's Shard: ceil-sized chunks
        dim, n = placements[0].dim, mesh.size()
        offsets[dim] = min(mesh.get_local_rank() * -(-p.shape[dim] // n), p.shape[dim])
    return TPSpec(mesh, placements, tuple(p.shape), tuple(p.stride()), tuple(offsets))


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def tp_local(p: nn.Parameter) -> nn.Parameter:
    """A plain parameter over a DTensor parameter's local tensor (same storage), for the planner and
    the group's buffers to see the TP-local tensor."""
    from torch.distributed.tensor import DTensor

    return nn.Parameter(cast(DTensor, p).to_local().detach(), requires_grad=p.requires_grad)


def check_tp_units(
    names: Sequence[str],
    params: Sequence[nn.Parameter],
    specs: Mapping[str, TPSpec],
    rules: object,
    module_types: Sequence[str],
) -> None:
    """Refuse a TP placement that cuts a unit of a parameter's semantics, stated on its global shape
    ([Note: tensor-parallel parameters]); replicated parameters cut nothing."""
    tensors, places = [], []
    for n, p, mt in zip(names, params, module_types, strict=True):
        spec = specs.get(n)
        dim = spec.shard_dim if spec is not None and spec.cut else None
        if spec is None or dim is None:
            continue
        tensors.append(TensorSpec(name=n, shape=spec.shape, dtype=p.dtype, module_type=mt))
        local = list(spec.shape)
        local[dim] = math.ceil(local[dim] / spec.mesh.size())
        places.append(Placement(n, "dtensor", "tp", dim, spec.mesh.size(), spec.shape, tuple(local)))
    for cut in split_units(tensors, places, rules):
        if (
            cut.label == "matrix"
        ):  # Muon's: blockshard.optim.Muon computes across tp; the optimizer guard refuses others
            continue
        raise ShardingError(
            f"parameter {cut.name!r} ({cut.label} semantics) is placed {specs[cut.name].label}, which splits its "
            f"units: {cut.why}; one process computes on whole units that no rank would hold. Fix: {cut.fix} "
            "(blockshard computes Muon's matrices across tp; other units, 8-bit blocks and Shampoo tiles included, "
            "only where the cut keeps them whole), or give it semantics the cut keeps whole "
            "(e.g. elementwise)"
        )


def refuse_tp_checkpoint(params: Sequence[Any], where: str) -> None:
    """Refuse a checkpoint path that does not handle TP parameters yet: what records dp layouts or
    writes TP-local pieces by themselves ([Note: tensor-parallel parameters])."""
    tp = [sp.fqn for sp in params if getattr(sp, "tp", None) is not None]
    if tp:
        raise ShardingError(
            f"{where}: parameter(s) {tp[:3]}{' ...' if len(tp) > 3 else ''} are tensor-parallel DTensors, and "
            f"{where} does not handle tensor-parallel groups yet (its records and files describe data-parallel "
            "pieces only). Fix: save and load with torch.distributed.checkpoint: dcp.save({'model': "
            "model.state_dict(), 'optimizer': blockshard.optimizer_state_dict(model, optimizer)}) (or torch's "
            "get_state_dict), which reshards across (dp, tp) layouts; blockshard.full_state_dict(model) for whole tensors"
        )
