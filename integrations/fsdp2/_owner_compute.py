"""Owner-compute: run an unmodified optimizer on whole units of FSDP2's element-wise shards.

FSDP2 (``Shard(0)``) gives rank ``r`` rows ``[r*c, (r+1)*c)`` of every parameter. A block optimizer
(Muon orthogonalizes a whole matrix) must see whole units, so each unit that straddles rank
boundaries gets one **owner** (:func:`blockshard.planner.plan_owners` with ``engine="fsdp2"`` on the
parameters' full shapes, balancing Newton-Schulz cost; every rank computes the same plan). The owner
keeps a persistent full-unit tensor for each unit it owns (initialized from the parameters); the
inner optimizer steps those, so its state for a unit (Muon's momentum) is whole and lives only on the
owner: optimizer state is sharded across ranks by ownership. Units wholly inside one rank's shard --
all units of an aligned parameter -- are stepped in place on a view of that rank's local shard.

Communication (``torch.distributed.all_to_all_single`` with uneven splits, one call per dtype and
phase, skipped when no unit straddles). Buffers are grouped by peer in rank order; within a peer,
pieces follow the plan's order of straddling units, which both sides know, so no index travels:

* **gradients to owners** (every :meth:`OwnerComputeOptimizer.step`): rank ``r`` sends to each rank
  ``o`` the slices of its local gradient shard that belong to straddling units owned by ``o``
  (``input_split_sizes[o]``) and receives from each rank ``h`` ``h``'s slices of the units ``r`` owns
  (``output_split_sizes[h]``); the owner copies its own slice locally. The self entry is 0.
* **parameters back to holders** (after the inner step): the reverse, with the same counts swapped:
  the owner sends each holder ``h`` the updated values of ``h``'s slices of the units it owns, and
  every rank receives from each owner the new values of its slices and writes them into its local
  DTensor shard (the owner copies its own slice).
* **parameters to owners** (at construction and :meth:`OwnerComputeOptimizer.resync_params`): as the
  gradient phase, with parameter values, to (re)initialize the owners' full-unit tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from blockshard._errors import BlockshardError
from blockshard.integrations.fsdp2._placement import decide, dim_split_keeps_units, spec_of
from blockshard.planner import PlanItem, plan_owners
from blockshard.planner._units import block_shape, ceil_div, rows_cols
from blockshard.semantics import SemanticsRules, TensorSpec

__all__ = ["OwnerComputeError", "OwnerComputeOptimizer", "build_exchange"]


class OwnerComputeError(BlockshardError):
    """Bad input to :class:`OwnerComputeOptimizer` (the message names the parameter and the fix)."""


@dataclass
class _Param:
    name: str
    param: torch.Tensor
    spec: TensorSpec
    group: int
    shard0: bool  # FSDP2 Shard(0) DTensor: part of the owner plan
    row_numel: int
    local_start: int = 0  # element offset of this rank's shard in the flattening
    local_numel: int = 0

    def local(self) -> torch.Tensor:
        p = self.param.to_local() if isinstance(self.param, DTensor) else self.param
        return p.detach()

    def local_grad(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is None:
            return None
        return (g.to_local() if isinstance(g, DTensor) else g).detach()


@dataclass
class _Piece:
    """A compute tensor: local rows ``[row_lo, row_hi)`` of a shard (a view) or an owned unit."""

    p: int
    key: tuple
    tensor: torch.Tensor
    row_lo: int = 0
    row_hi: int = 0
    unit_start: int = -1  # >= 0: an owned unit, starting at this element of the flattening
    own: tuple[int, int, int] | None = None  # (local offset, unit offset, n) of the owner's own slice


@dataclass
class _Exchange:
    """One dtype's all_to_all lists, gradient direction (the update direction swaps them)."""

    sends: list[list[tuple[int, int, int]]]  # [peer] -> (param index, local offset, n): my slices of peer's units
    recvs: list[list[tuple[int, int, int]]]  # [peer] -> (piece index, unit offset, n): peer's slices of my units
    send_sizes: list[int] = field(default_factory=list)
    recv_sizes: list[int] = field(default_factory=list)


def build_exchange(plan, rank: int, dtypes: list[str]) -> tuple[dict[str, _Exchange], list[tuple]]:
    """Pure: this rank's all_to_all lists per dtype from an owner plan, and its owned units.

    ``dtypes[t]`` is the dtype name of plan tensor ``t``. Returns ``(exchanges, owned)`` with
    ``owned`` a list of ``(plan unit index, tensor index, start, numel, own slice or None)``;
    ``recvs`` refer to positions in ``owned``.
    """
    w = plan.world_size
    ex: dict[str, _Exchange] = {}
    owned: list[tuple] = []
    for i, (t, a, n, o) in enumerate(
        zip(
            plan.unit_tensor.tolist(),
            plan.unit_start.tolist(),
            plan.unit_numel.tolist(),
            plan.unit_owner.tolist(),
            strict=True,
        )
    ):
        s = int(plan.tensor_shard_numel[t])
        e = ex.setdefault(dtypes[t], _Exchange([[] for _ in range(w)], [[] for _ in range(w)]))
        own = None
        for h, cnt in plan.unit_pieces(i):
            lo = max(a, h * s)
            if h == rank and o == rank:
                own = (lo - h * s, lo - a, cnt)
            elif h == rank:
                e.sends[o].append((t, lo - h * s, cnt))
            elif o == rank:
                e.recvs[h].append((len(owned), lo - a, cnt))
        if o == rank:
            owned.append((i, t, a, n, own))
    for e in ex.values():
        e.send_sizes = [sum(x[2] for x in lst) for lst in e.sends]
        e.recv_sizes = [sum(x[2] for x in lst) for lst in e.recvs]
    return dict(sorted(ex.items())), owned


def _add_module_types(mtypes: dict[int, str], root: nn.Module) -> None:
    """Record the class name of each parameter's owning module (the first owner wins)."""
    for mod in root.modules():
        for p in mod.parameters(recurse=False):
            mtypes.setdefault(id(p), type(mod).__name__)


def _named_groups(params) -> tuple[list[tuple[dict, list[tuple[str, torch.Tensor]]]], dict[int, str]]:
    """Normalize ``params`` to ``[(param_group options, [(name, param), ...])]`` and module types by id."""
    mtypes: dict[int, str] = {}
    if isinstance(params, nn.Module):
        _add_module_types(mtypes, params)
        params = list(params.named_parameters())
    params = list(params)
    if not params:
        raise OwnerComputeError(
            "params is empty: pass model.named_parameters(), a list of (name, param) "
            "pairs or param_groups {'params': [(name, param), ...], ...}"
        )
    groups = params if isinstance(params[0], Mapping) else [{"params": params}]
    out = []
    for gi, g in enumerate(groups):
        if not isinstance(g, Mapping) or "params" not in g:
            raise OwnerComputeError(
                f"param_groups[{gi}] ({g!r}) must be a dict with a 'params' list of (name, param) pairs"
            )
        named = list(g["params"])
        if "param_names" in g:  # torch's named param_groups, e.g. blockshard.optim.muon_param_groups(model)
            names = list(g["param_names"])
            if len(names) != len(named):
                raise OwnerComputeError(
                    f"param_groups[{gi}] has {len(named)} params but {len(names)} param_names; give one name per parameter"
                )
            named = list(zip(names, named, strict=True))
        for x in named:
            if not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)):
                raise OwnerComputeError(
                    f"param_groups[{gi}]: {type(x).__name__} entry is not a (name, parameter) pair; rules match "
                    "parameter names, so pass model.named_parameters() or [(name, param), ...]"
                )
        out.append(({k: v for k, v in g.items() if k not in ("params", "param_names")}, named))
    return out, mtypes


class OwnerComputeOptimizer:
    """Step FSDP2-sharded parameters with an unmodified optimizer that sees whole units.

    Args:
        inner_optimizer_factory: called once with a list of ``param_groups`` (``{"params": [tensors],
            **options}``) holding this rank's *compute tensors* -- views of whole units in its local
            shards and the full-unit tensors it owns -- and returns the inner optimizer (e.g.
            ``lambda groups: torch.optim.Muon(groups, lr=0.02)``). A rank may get empty ``param_groups``.
        params: ``model.named_parameters()`` (or any ``(name, param)`` pairs), a module, or a list of
            ``param_groups`` ``{"params": [(name, param), ...], **options}`` (or ``{"params": [param, ...],
            "param_names": [name, ...], ...}``, as :func:`blockshard.optim.muon_param_groups` returns);
            names are what ``semantics`` rules match (use the root model's names, as :func:`fully_shard`
            with ``root=``).
        semantics: rules as :meth:`SemanticsRules.coerce` accepts (``"matrix"`` for Muon, ``None``
            for element-wise optimizers, ``"bnb8bit"``, ...).
        process_group: the FSDP2 shard group; default: the group of the parameters' 1-D mesh.
        model: the root module, to give rules module types when ``params`` is not a module.

    Parameters may be FSDP2 ``Shard(0)`` DTensors (block-aligned: stepped locally; units split by
    ``Shard(0)``: owner-compute, see the module docstring), ``Shard(d)`` DTensors whose units are
    whole, ``Replicate`` DTensors or plain tensors (stepped locally). Gradients must be ``None`` on
    all ranks or on none (FSDP2 guarantees that). ``inner`` is the inner optimizer (attach LR
    schedulers to it). :meth:`state_dict` is per rank: load it at the same world size and semantics.
    If parameter values are changed outside :meth:`step` (e.g. ``model.load_state_dict``), call
    :meth:`resync_params` (or :meth:`load_state_dict`, which does) on every rank.
    """

    def __init__(
        self,
        inner_optimizer_factory: Callable,
        params,
        *,
        semantics: object = None,
        process_group: dist.ProcessGroup | None = None,
        model: nn.Module | None = None,
    ) -> None:
        if not callable(inner_optimizer_factory):
            raise OwnerComputeError(
                f"inner_optimizer_factory={inner_optimizer_factory!r} must be callable: "
                "groups -> optimizer, e.g. lambda groups: torch.optim.Muon(groups, lr=0.02)"
            )
        rules = SemanticsRules.coerce(semantics)
        groups, mtypes = _named_groups(params)
        if model is not None:
            _add_module_types(mtypes, model)
        self._params: list[_Param] = []
        mesh: DeviceMesh | None = None
        seen: dict[int, str] = {}
        for gi, (_, named) in enumerate(groups):
            for name, p in named:
                if id(p) in seen:
                    raise OwnerComputeError(
                        f"parameter {name!r} is the same tensor as {seen[id(p)]!r}; pass each parameter once"
                    )
                seen[id(p)] = name
                spec = spec_of(name, p, mtypes.get(id(p)))
                if isinstance(p, DTensor):
                    if mesh is None:
                        mesh = p.device_mesh
                    if p.device_mesh.ndim != 1 or p.device_mesh != mesh:
                        raise OwnerComputeError(
                            f"parameter {name!r} lives on mesh {p.device_mesh}, but all DTensor parameters "
                            f"must share one 1-D mesh (first one: {mesh}); HSDP / 2-D meshes are not supported"
                        )
                self._params.append(_Param(name, p, spec, gi, False, rows_cols(spec.shape)[1]))
        self.world_size = mesh.size() if mesh is not None else 1
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.process_group = process_group if process_group is not None else (mesh.get_group() if mesh else None)
        if process_group is not None and mesh is not None:
            if dist.get_world_size(process_group) != self.world_size or dist.get_rank(process_group) != self.rank:
                raise OwnerComputeError(
                    f"process_group has size {dist.get_world_size(process_group)} and this rank is "
                    f"{dist.get_rank(process_group)} in it, but the parameters' mesh has size {self.world_size} "
                    f"and this rank is {self.rank} in it; pass the FSDP2 shard group (or None)"
                )
        self._classify(rules)
        self.plan = plan_owners([self._item(q) for q in self._params if q.shard0], self.world_size, engine="fsdp2")
        self._build_pieces()
        self.inner = inner_optimizer_factory(
            [
                {**opts, "params": [pc.tensor for pc in self._pieces if self._params[pc.p].group == gi]}
                for gi, (opts, _) in enumerate(groups)
            ]
        )
        if not all(hasattr(self.inner, a) for a in ("step", "state_dict", "load_state_dict", "param_groups")):
            raise OwnerComputeError(f"inner_optimizer_factory returned {self.inner!r}, not a torch.optim.Optimizer")
        self.resync_params()

    # -- setup ------------------------------------------------------------------------------------
    def _classify(self, rules: SemanticsRules) -> None:
        w, r = self.world_size, self.rank
        self._resolved = {}
        for q in self._params:
            res = rules.resolve(q.spec)
            self._resolved[q.name] = res
            p = q.param
            if not isinstance(p, DTensor) or w == 1:
                continue
            (pl,) = p.placements
            if isinstance(pl, Replicate):
                continue
            if type(pl) is not Shard:
                raise OwnerComputeError(
                    f"parameter {q.name!r} has placement {pl}; expected FSDP2's Shard(dim) or Replicate"
                )
            if pl.dim != 0:
                if not dim_split_keeps_units(res.grid, q.spec.shape, pl.dim, w):
                    raise OwnerComputeError(
                        f"parameter {q.name!r} of shape {q.spec.shape} is sharded by FSDP2 with {pl}, which splits "
                        f"its units under semantics {res.label!r} at W={w}; shard the model with "
                        "blockshard.integrations.fsdp2.fully_shard(..., semantics=...)"
                    )
                continue
            decide(q.spec, res, w, other_dims=False)  # raises FSDP2PlacementError where nothing works
            rows, row_numel = rows_cols(q.spec.shape)
            c = ceil_div(rows, w)
            lo, hi = min(r * c, rows), min((r + 1) * c, rows)
            local = p.to_local()
            if tuple(local.shape) != (hi - lo, *q.spec.shape[1:]) or not local.is_contiguous():
                raise OwnerComputeError(
                    f"parameter {q.name!r}: local shard has shape {tuple(local.shape)} (contiguous: "
                    f"{local.is_contiguous()}), but FSDP2's Shard(0) at W={w} gives rank {r} rows [{lo}, {hi}); "
                    "is it sharded by torch.distributed.fsdp.fully_shard on this mesh?"
                )
            q.shard0, q.local_start, q.local_numel = True, lo * row_numel, (hi - lo) * row_numel

    def _item(self, q: _Param) -> PlanItem:
        res = self._resolved[q.name]
        return PlanItem(q.spec, res.grid, res.cost, res.label)

    def _build_pieces(self) -> None:
        shard0 = self._shard0 = [i for i, q in enumerate(self._params) if q.shard0]
        self._plan_index = {i: t for t, i in enumerate(shard0)}
        self._device = self._params[0].local().device
        dtypes = [str(self._params[i].spec.dtype) for i in shard0]
        self._exchanges, owned = build_exchange(self.plan, self.rank, dtypes)
        straddling: dict[int, list[tuple[int, int]]] = {}
        for t, a, n in zip(
            self.plan.unit_tensor.tolist(), self.plan.unit_start.tolist(), self.plan.unit_numel.tolist(), strict=True
        ):
            straddling.setdefault(shard0[t], []).append((a, a + n))
        owned_by_param: dict[int, list[tuple]] = {}
        for k, (_, t, a, n, own) in enumerate(owned):
            owned_by_param.setdefault(shard0[t], []).append((k, a, n, own))
        self._pieces: list[_Piece] = []
        self._unit_piece: dict[int, int] = {}  # position in `owned` -> index in self._pieces
        for i, q in enumerate(self._params):
            local = q.local()
            if not q.shard0:
                if local.numel():  # not sharded block-misaligned: the whole local tensor
                    self._pieces.append(_Piece(i, (q.name, "local", tuple(local.shape)), local))
            else:
                lo, hi = q.local_start, q.local_start + q.local_numel
                for a, b in straddling.get(i, []):  # straddling units overlap only the shard's ends
                    if a <= lo < b:
                        lo = b
                    if a < hi <= b:
                        hi = a
                if lo < hi:
                    rlo, rhi = (lo - q.local_start) // q.row_numel, (hi - q.local_start) // q.row_numel
                    g0 = q.local_start // q.row_numel
                    self._pieces.append(_Piece(i, (q.name, "rows", g0 + rlo, g0 + rhi), local[rlo:rhi], rlo, rhi))
            for k, a, n, own in owned_by_param.get(i, []):
                shape = block_shape(q.spec.shape, a, n)  # the whole tensor, or whole rows of it
                t = torch.empty(shape, dtype=q.param.dtype, device=local.device)
                self._unit_piece[k] = len(self._pieces)
                self._pieces.append(_Piece(i, (q.name, "unit", a, n), t, unit_start=a, own=own))

    # -- communication ----------------------------------------------------------------------------
    def _to_owners(self, grads: bool) -> None:
        """Gradient (or parameter) slices of straddling units -> their owners' full-unit tensors."""
        for dt, e in self._exchanges.items():
            dtype = getattr(torch, dt)
            chunks = []
            for peer in range(self.world_size):
                for t, off, n in e.sends[peer]:
                    src = self._flat_grad(t) if grads else self._flat(t)
                    chunks.append(
                        src[off : off + n] if src is not None else torch.zeros(n, dtype=dtype, device=self._device)
                    )
            inp = torch.cat(chunks).to(dtype) if chunks else torch.empty(0, dtype=dtype, device=self._device)
            out = torch.empty(sum(e.recv_sizes), dtype=dtype, device=self._device)
            dist.all_to_all_single(out, inp, e.recv_sizes, e.send_sizes, group=self.process_group)
            pos = 0
            for peer in range(self.world_size):
                for k, uoff, n in e.recvs[peer]:
                    self._unit_target(k, grads)[uoff : uoff + n].copy_(out[pos : pos + n])
                    pos += n
        for k, j in self._unit_piece.items():
            pc = self._pieces[j]
            if pc.own is not None:
                off, uoff, n = pc.own
                t = self._plan_index[pc.p]
                src = self._flat_grad(t) if grads else self._flat(t)
                dst = self._unit_target(k, grads)
                dst[uoff : uoff + n].copy_(src[off : off + n]) if src is not None else dst[uoff : uoff + n].zero_()

    def _from_owners(self) -> None:
        """Updated values of owned units -> every holder's local DTensor shard."""
        for dt, e in self._exchanges.items():
            dtype = getattr(torch, dt)
            chunks = [
                self._unit_target(k, False)[uoff : uoff + n]
                for peer in range(self.world_size)
                for k, uoff, n in e.recvs[peer]
            ]
            inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=self._device)
            out = torch.empty(sum(e.send_sizes), dtype=dtype, device=self._device)
            dist.all_to_all_single(out, inp, e.send_sizes, e.recv_sizes, group=self.process_group)
            pos = 0
            for peer in range(self.world_size):
                for t, off, n in e.sends[peer]:
                    self._flat(t)[off : off + n].copy_(out[pos : pos + n])
                    pos += n
        for _k, j in self._unit_piece.items():
            pc = self._pieces[j]
            if pc.own is not None:
                off, uoff, n = pc.own
                self._flat(self._plan_index[pc.p])[off : off + n].copy_(pc.tensor.view(-1)[uoff : uoff + n])

    def _flat(self, t: int) -> torch.Tensor:
        """Plan tensor ``t``'s local shard: a flat view, written in place."""
        return self._params[self._shard0[t]].local().view(-1)

    def _flat_grad(self, t: int) -> torch.Tensor | None:
        """Plan tensor ``t``'s local gradient shard, flat (read only); ``None`` if it has no gradient."""
        g = self._params[self._shard0[t]].local_grad()
        return None if g is None else g.reshape(-1)

    def _unit_target(self, k: int, grads: bool) -> torch.Tensor:
        t = self._pieces[self._unit_piece[k]].tensor
        if grads:
            if t.grad is None:
                t.grad = torch.empty_like(t)
            return t.grad.view(-1)
        return t.view(-1)

    # -- optimizer surface -------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @torch.no_grad()
    def resync_params(self) -> None:
        """Collective: re-read the owners' full-unit tensors from the parameters' local shards."""
        self._refresh_views()
        self._to_owners(grads=False)

    def _refresh_views(self) -> None:
        for pc in self._pieces:
            if pc.unit_start < 0:  # a view: re-point it at the current local shard (same tensor object)
                q = self._params[pc.p]
                local = q.local()
                pc.tensor.data = local[pc.row_lo : pc.row_hi] if q.shard0 else local

    def step(self, closure: Callable | None = None):
        """Gradients to owners, inner step on whole units and local views, new values back to holders."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._refresh_views()
            for pc in self._pieces:
                if pc.unit_start < 0:
                    q = self._params[pc.p]
                    g = q.local_grad()
                    pc.tensor.grad = None if g is None else (g[pc.row_lo : pc.row_hi] if q.shard0 else g)
            self._to_owners(grads=True)
            for _k, j in self._unit_piece.items():  # a unit whose parameter has no gradient is skipped
                if self._params[self._pieces[j].p].param.grad is None:
                    self._pieces[j].tensor.grad = None
            self.inner.step()
            self._from_owners()
            for pc in self._pieces:
                pc.tensor.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for q in self._params:
            if q.param.grad is not None:
                if set_to_none:
                    q.param.grad = None
                else:
                    q.param.grad.zero_()

    def state_dict(self) -> dict:
        """This rank's state: the inner optimizer's state dict and the layout it belongs to."""
        return {
            "inner": self.inner.state_dict(),
            "world_size": self.world_size,
            "rank": self.rank,
            "layout": [pc.key for pc in self._pieces],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Collective: load a state dict saved by this rank at the same world size, then resync."""
        mine = {"world_size": self.world_size, "rank": self.rank, "layout": [pc.key for pc in self._pieces]}
        got = {k: state_dict.get(k) for k in mine}
        if [got["world_size"], got["rank"]] != [mine["world_size"], mine["rank"]] or [
            tuple(x) for x in (got["layout"] or [])
        ] != mine["layout"]:
            raise OwnerComputeError(
                f"state dict was saved for world_size={got['world_size']}, rank={got['rank']} with "
                f"{len(got['layout'] or [])} compute tensors; this optimizer is world_size={self.world_size}, "
                f"rank={self.rank} with {len(self._pieces)}: owner-compute state is per rank, load it at "
                "the same world size, semantics and parameter shapes"
            )
        self.inner.load_state_dict(state_dict["inner"])
        self.resync_params()

    def owned_units(self) -> list[tuple[str, int, int]]:
        """``(parameter name, start element, numel)`` of every unit this rank owns."""
        return [
            (self._params[pc.p].name, pc.unit_start, pc.tensor.numel()) for pc in self._pieces if pc.unit_start >= 0
        ]

    def __repr__(self) -> str:
        return (
            f"OwnerComputeOptimizer(inner={type(self.inner).__name__}, world_size={self.world_size}, "
            f"rank={self.rank}, compute_tensors={len(self._pieces)}, owned_units={len(self._unit_piece)})"
        )
