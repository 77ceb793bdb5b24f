"""Owner-compute: run an unmodified optimizer on whole compute units of cut storage.

[Note: owner compute]
An engine that cuts a tensor's storage inside a compute unit (a Muon matrix, a Shampoo stripe)
gives each cut unit one **owner** rank. Both engines state where a tensor lies in the same way:
rank ``h`` holds elements ``[h * S - offset, (h + 1) * S - offset)`` of its flattening, clipped to
the tensor (FSDP2's ``Shard(0)``: ``offset = 0``, ``S`` = its shard; the ragged engine: the
tensor's offset in its bucket and the bucket's segment, :class:`blockshard.runtime.TensorOwnerPlan`),
and lists its cut units as ``(start, numel, owner)``. From that, every rank derives the same
exchange lists (:func:`exchange_lists`). The owner keeps a persistent full-unit tensor for each unit
it owns; the inner optimizer steps those, so its state for a cut unit lives only at the owner. The
whole compute units inside a rank's piece are stepped in place on a view of it; tensors that are not
owner-computed are stepped on their local pieces.

Communication (``all_to_all_single`` with uneven splits, one call per dtype and direction, none when
no unit is cut; waits bounded as the engine's, ``runtime/core/_collectives.wait``). Buffers are grouped
by peer in rank order; within a peer, pieces follow the order of the cut units, which both sides
know, so no index travels:

* **gradients to owners** (every :meth:`OwnerComputeOptimizer.step`): rank ``r`` sends each rank
  ``o`` its slices of the cut units ``o`` owns and receives from each rank ``h`` ``h``'s slices of
  the units ``r`` owns; the owner copies its own slice locally. The self entry is 0.
* **values back to holders** (after the inner step): the reverse, with the same counts swapped.
* **values to owners** (at construction and :meth:`OwnerComputeOptimizer.resync_params`): as the
  gradient phase, with parameter values, to (re)initialize the owners' full-unit tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn

from blockshard._errors import BlockshardError

__all__ = [
    "Exchange",
    "Holding",
    "OwnerComputeError",
    "add_module_types",
    "exchange_lists",
    "local_region",
    "named_groups",
]


class OwnerComputeError(BlockshardError):
    """Bad input to an ``OwnerComputeOptimizer`` (the message names the parameter and the fix)."""


@dataclass
class Holding:
    """One parameter as owner-compute sees it on this rank.

    ``planned``: part of an owner plan (its storage may cut compute units): rank ``h`` holds
    ``[h * segment - offset, ...)`` clipped to the tensor, ``units`` are its cut units
    ``(start, numel, owner)``, and this rank's piece is ``local_numel`` elements from
    ``local_start``. Otherwise the local tensor is stepped as it is (``direct``: the parameter
    object itself goes to the inner optimizer, with its own ``.grad``). ``matrix_numel > 0``: the
    compute units are the trailing ``(m, n)`` matrices of a stacked tensor (one per expert); the
    inner optimizer gets each as a 2-D view (``torch.optim.Muon`` takes only matrices).
    """

    name: str
    param: torch.Tensor
    shape: tuple[int, ...]
    group: int
    planned: bool = False
    offset: int = 0
    segment: int = 1
    units: tuple[tuple[int, int, int], ...] = ()
    local_start: int = 0
    local_numel: int = 0
    direct: bool = False
    matrix_numel: int = 0
    cuts: tuple[int, ...] = ()  # where the storage cuts it between ranks (element offsets; the same on every rank)
    # a tensor-parallel parameter whose tp placement cuts it ([Note: tensor-parallel parameters]): its
    # TPSpec; ``shape`` is then the TP-local tensor's, ``tp.shape`` the global one
    tp: Any = None
    # a fused weight's parts ([Note: fused parts] in semantics/_builtins.py): the rows of each part of
    # its (TP-local) matrix, or of each expert's; () for one matrix
    parts: tuple[int, ...] = ()

    def local(self) -> torch.Tensor:
        p = self.param
        return (p.to_local() if hasattr(p, "to_local") else p).detach()

    def local_grad(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is None:
            return None
        return (g.to_local() if hasattr(g, "to_local") else g).detach()

    def holders(self, a: int, n: int) -> list[tuple[int, int, int]]:
        """``(rank, offset in that rank's piece, count)`` of every rank holding part of ``[a, a + n)``."""
        S, off = self.segment, self.offset
        out = []
        for h in range((off + a) // S, (off + a + n - 1) // S + 1):
            start = max(h * S - off, 0)
            lo, hi = max(a, start), min(a + n, (h + 1) * S - off)
            if hi > lo:
                out.append((h, lo - start, hi - lo))
        return out


@dataclass
class Exchange:
    """One dtype's all_to_all lists, gradient direction (the update direction swaps them)."""

    sends: list[list[tuple[int, int, int]]]  # [peer] -> (tensor index, local offset, n): my slices of peer's units
    recvs: list[list[tuple[int, int, int]]]  # [peer] -> (owned index, unit offset, n): peer's slices of my units
    send_sizes: list[int] = field(default_factory=list)
    recv_sizes: list[int] = field(default_factory=list)


#: A unit this rank owns: ``(unit index, tensor index, start, numel, own slice or None)``, the own
#: slice ``(local offset, unit offset, n)``.
OwnedUnit: TypeAlias = tuple[int, int, int, int, tuple[int, int, int] | None]
#: ``[(param_group options, [(name, param), ...])]``, as :func:`named_groups` normalizes them.
NamedGroups: TypeAlias = list[tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]]
#: What a user passes as ``params``: a module, one param_group, or an iterable of (name, param)
#: pairs or of param_groups (:func:`named_groups` checks the entries).
ParamsArg: TypeAlias = nn.Module | Mapping[str, Any] | Iterable[Any]
#: ``inner_optimizer_factory``: this rank's param_groups of compute tensors -> the inner optimizer.
InnerFactory: TypeAlias = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def exchange_lists(
    holdings: Sequence[Holding], dtypes: Sequence[str], rank: int, world_size: int
) -> tuple[dict[str, Exchange], list[OwnedUnit]]:
    """Pure: this rank's all_to_all lists per dtype, and the units it owns.

    Units are taken tensor by tensor, in each tensor's order (the same on every rank). Returns
    ``(exchanges, owned)``, ``owned`` a list of ``(unit index, tensor index, start, numel, own slice
    or None)`` where the own slice is ``(local offset, unit offset, n)``; ``recvs`` index ``owned``.
    """
    ex: dict[str, Exchange] = {}
    owned: list[OwnedUnit] = []
    i = 0
    for t, q in enumerate(holdings):
        for a, n, o in q.units:
            e = ex.setdefault(dtypes[t], Exchange([[] for _ in range(world_size)], [[] for _ in range(world_size)]))
            own = None
            for h, loc, cnt in q.holders(a, n):
                uoff = loc + max(h * q.segment - q.offset, 0) - a
                if h == rank and o == rank:
                    own = (loc, uoff, cnt)
                elif h == rank:
                    e.sends[o].append((t, loc, cnt))
                elif o == rank:
                    e.recvs[h].append((len(owned), uoff, cnt))
            if o == rank:
                owned.append((i, t, a, n, own))
            i += 1
    for e in ex.values():
        e.send_sizes = [sum(x[2] for x in lst) for lst in e.sends]
        e.recv_sizes = [sum(x[2] for x in lst) for lst in e.recvs]
    return dict(sorted(ex.items())), owned


def local_region(q: Holding) -> tuple[int, int]:
    """``[lo, hi)``: the whole compute units in this rank's piece of planned tensor ``q`` (its cut
    units overlap only the piece's ends); empty when ``lo >= hi``."""
    lo, hi = q.local_start, q.local_start + q.local_numel
    for a, n, _ in q.units:
        if a <= lo < a + n:
            lo = a + n
        if a < hi <= a + n:
            hi = a
    return lo, hi


def add_module_types(mtypes: dict[int, str], root: nn.Module) -> None:
    """Record the class name of each parameter's owning module (the first owner wins)."""
    for mod in root.modules():
        for p in mod.parameters(recurse=False):
            mtypes.setdefault(id(p), type(mod).__name__)


def named_groups(params: ParamsArg) -> tuple[NamedGroups, dict[int, str]]:
    """Normalize ``params`` to ``[(param_group options, [(name, param), ...])]`` and module types by id.

    Checks what a hand-built ``param_group`` can get wrong, naming the parameter: ``params`` not a
    list, ``param_names`` of another length or not strings, one name given to two tensors.
    """
    mtypes: dict[int, str] = {}
    if isinstance(params, nn.Module):
        add_module_types(mtypes, params)
        params = list(params.named_parameters())
    if isinstance(params, Mapping):  # one param_group, e.g. the first of muon_param_groups(model)
        params = [params]
    params = _as_list(params, "params")
    if not params:
        raise OwnerComputeError(
            "params is empty: pass model.named_parameters(), a list of (name, param) "
            "pairs or param_groups {'params': [(name, param), ...], ...}"
        )
    groups = params if isinstance(params[0], Mapping) else [{"params": params}]
    out: NamedGroups = []
    named_by: dict[str, int] = {}
    for gi, g in enumerate(groups):
        if not isinstance(g, Mapping) or "params" not in g:
            raise OwnerComputeError(
                f"param_groups[{gi}] ({g!r}) must be a dict with a 'params' list of (name, param) pairs"
            )
        named = _as_list(g["params"], f"param_groups[{gi}]['params']")
        if "param_names" in g:  # torch's named param_groups, e.g. blockshard.optim.muon_param_groups(model)
            named = list(zip(_param_names(g, gi, named), named, strict=True))
        for j, x in enumerate(named):
            if not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)):
                what = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise OwnerComputeError(
                    f"param_groups[{gi}]['params'][{j}] is {what}, not a (name, parameter) pair: owner-compute "
                    "needs every parameter's name. Fix: pass model.named_parameters(), [(name, param), ...], or "
                    "param_groups with 'param_names' (blockshard.optim.muon_param_groups(model) returns them)"
                )
            first = named_by.setdefault(x[0], id(x[1]))
            if first != id(x[1]):
                raise OwnerComputeError(
                    f"param_groups[{gi}]: the name {x[0]!r} is given to two different tensors (this one of shape "
                    f"{tuple(x[1].shape)}); every parameter needs its own model.named_parameters() name. Fix: take "
                    "names and parameters together (model.named_parameters() or muon_param_groups(model))"
                )
        out.append(({k: v for k, v in g.items() if k not in ("params", "param_names")}, named))
    return out, mtypes


_PARAMS_FIX = "a list of (name, param) pairs, e.g. list(model.named_parameters()), or of param_groups"


def _as_list(value: object, what: str, fix: str = _PARAMS_FIX) -> list[Any]:
    """``list(value)`` for an iterable that is not a tensor or a string; else a clear error."""
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
        raise OwnerComputeError(f"{what} is {type(value).__name__} {value!r:.80}, not a list. Fix: pass {fix}")
    return list(value)


def _param_names(g: Mapping[str, Any], gi: int, params: list[Any]) -> list[str]:
    """``g["param_names"]``, checked: one string per parameter."""
    names = _as_list(g["param_names"], f"param_groups[{gi}]['param_names']", "a list of one name (str) per parameter")
    if len(names) != len(params):
        k = min(len(names), len(params))
        odd = (
            f"param_groups[{gi}]['params'][{k}] (shape {_shape_of(params[k])}) has no name"
            if len(params) > len(names)
            else f"the name {names[k]!r} names no parameter"
        )
        raise OwnerComputeError(
            f"param_groups[{gi}] has {len(params)} params but {len(names)} param_names: {odd}. Fix: give one "
            "name per parameter, in order (blockshard.optim.muon_param_groups(model) returns such groups)"
        )
    for j, n in enumerate(names):
        if not isinstance(n, str):
            raise OwnerComputeError(
                f"param_groups[{gi}]['param_names'][{j}] is {n!r} ({type(n).__name__}), not a parameter name. "
                "Fix: give each parameter its model.named_parameters() name (a str)"
            )
    return names


def _shape_of(x: object) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass
class _Piece:
    """A compute tensor: a view of a local piece (or the parameter itself), or an owned unit."""

    p: int
    key: tuple[object, ...]
    tensor: torch.Tensor
    lo: int = 0  # element range of the view within the local piece
    hi: int = 0
    unit_start: int = -1  # >= 0: an owned unit, starting at this element of the flattening
    own: tuple[int, int, int] | None = None  # (local offset, unit offset, n) of the owner's own slice
    direct: bool = False  # the parameter itself: the inner optimizer reads its own .grad
    split: bool = False  # one (m, n) matrix of a local piece that is not planned (a whole-placed expert)
