"""The state of an ``OwnerComputeOptimizer`` as an element-wise optimizer's over the pieces.

[Note: owner-compute state in checkpoints]
The inner optimizer of an :class:`~blockshard.optim.OwnerComputeOptimizer` keeps its state on
compute tensors: views of the rank's pieces, and the full units this rank owns. Element for
element, that state is what an optimizer over the pieces would keep (Muon's momentum, AdamW's
moments are element-wise; only the update between them is not), so a checkpoint stores it as one:
:func:`piece_view` gives a stand-in optimizer (:class:`PieceView`) whose ``param_groups`` hold the
model's pieces and whose state is piece-shaped, the owned units' state sent back to the ranks that
hold their elements (one ``all_to_all`` per state key, the "values back" exchange of
[Note: owner compute]); the checkpoint layer saves it as any optimizer's, so DCP reshards it to
another world size or layout, where :func:`load_piece_view` sends it to the new owners. Per-tensor
scalars (AdamW's ``step``) are the same on every compute tensor of a parameter: the ranks exchange
them by name, so a rank whose piece lies wholly in units owned elsewhere has them too. State that is
neither (a preconditioner, quantized blocks) raises :class:`CheckpointError` naming the key.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from blockshard._errors import CheckpointError
from blockshard.runtime.checkpoint._optim_state import init_optimizer_state

if TYPE_CHECKING:
    from blockshard.optim._owner_optimizer import OwnerComputeOptimizer

__all__ = ["PieceView", "load_piece_view", "piece_view"]

# per parameter name: {state key: ("elementwise", dtype name) | ("scalar", value)}
Schema = dict[str, dict[str, tuple[str, Any]]]


class PieceView(torch.optim.Optimizer):
    """A stand-in optimizer over the model's pieces holding an owner-compute optimizer's state,
    piece-shaped ([Note: owner-compute state in checkpoints]). Its ``step`` does nothing (the
    checkpoint layer steps it at learning rate 0 to create missing state: there is none)."""

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        self.param_groups: list[dict[str, Any]] = groups  # not Optimizer.__init__: groups may be empty
        self.defaults = defaults
        self.state: collections.defaultdict[torch.Tensor, Any] = collections.defaultdict(dict)
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        return None


def _schema(opt: OwnerComputeOptimizer) -> Schema:
    """This rank's state kinds by parameter name; raises for state that is not element-wise or scalar."""
    out: Schema = {}
    for pc in opt._pieces:
        name = opt._params[pc.p].name
        for key, value in opt.inner.state.get(pc.tensor, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == pc.tensor.shape and value.dim() > 0:
                kind: tuple[str, Any] = ("elementwise", str(value.dtype).removeprefix("torch."))
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                kind = ("scalar", value.detach().cpu().clone())
            elif isinstance(value, (int, float, bool)):
                kind = ("scalar", value)
            else:
                raise CheckpointError(
                    f"the state {key!r} of parameter {name!r} in {type(opt.inner).__name__} (inside an "
                    f"OwnerComputeOptimizer) is a {type(value).__name__} of shape {getattr(value, 'shape', None)}, "
                    "neither element-wise nor a scalar: blockshard cannot store it by global position. Fix: save "
                    "the optimizer's own state_dict() per rank (it loads at the same world size)"
                )
            out.setdefault(name, {}).setdefault(key, kind)
    return out


def _exchanges_units(opt: OwnerComputeOptimizer) -> bool:
    """Whether any unit is owner-computed: only then do ranks need each other's state kinds (the
    same answer on every rank: every rank passes the owner-computed tensors, its empty pieces too,
    while a rank may hold none of the others and so have no process group to gather on)."""
    return opt.process_group is not None and opt.world_size > 1 and any(q.planned for q in opt._params)


def _every_rank_schema(opt: OwnerComputeOptimizer, error: str | None) -> Schema:
    mine: tuple[Schema, str | None] = ({}, error) if error else (_schema(opt), None)
    if not _exchanges_units(opt):
        if error:
            raise CheckpointError(error)
        return mine[0]
    everyone: list[Any] = [None] * opt.world_size
    dist.all_gather_object(everyone, mine, group=opt.process_group)
    errors = [e for _, e in everyone if e]
    if errors:
        raise CheckpointError(errors[0])
    merged: Schema = {}
    for schema, _ in everyone:
        for name, keys in schema.items():
            for key, kind in keys.items():
                merged.setdefault(name, {}).setdefault(key, kind)
    return merged


def _dtype_keys(schema: Schema) -> list[tuple[str, str]]:
    """The element-wise state ``(key, state dtype)`` pairs of every rank's ``schema`` (gathered where
    units are exchanged), in one order on every rank: one exchange each."""
    pairs = {(key, value) for keys in schema.values() for key, (kind, value) in keys.items() if kind == "elementwise"}
    return sorted(pairs)


def _ensure_state(opt: OwnerComputeOptimizer) -> None:
    """Create the inner optimizer's missing state (a learning-rate-0 step, as for an optimizer over
    the pieces), for every compute tensor: the owned units and views do not require grad."""
    opt._refresh_views()
    opt._stepping_inner = True  # a reused optimizer refuses other steps ([Note: a reused optimizer])
    try:
        init_optimizer_state(opt.inner, every=True)
    finally:
        opt._stepping_inner = False


@torch.no_grad()
def piece_view(opt: OwnerComputeOptimizer) -> PieceView:
    """Collective: the optimizer's state over the model's pieces ([Note: owner-compute state in checkpoints])."""
    error = None
    try:
        _ensure_state(opt)
    except Exception as e:  # raised on every rank below, by _every_rank_schema
        error = f"creating the state of {type(opt.inner).__name__} failed on rank {opt.rank}: {e}"
    schema = _every_rank_schema(opt, error)
    flats: dict[int, dict[str, torch.Tensor]] = {}
    for t, q in enumerate(opt._params):
        n = q.local().numel()
        flats[t] = {
            key: torch.zeros(n, dtype=getattr(torch, value), device=opt._device)
            for key, (kind, value) in schema.get(q.name, {}).items()
            if kind == "elementwise"
        }
    for pc in opt._pieces:  # the local compute tensors' state, at their places in the pieces
        if pc.unit_start < 0:
            for key, value in opt.inner.state.get(pc.tensor, {}).items():
                if key in flats[pc.p]:
                    flats[pc.p][key][pc.lo : pc.hi].copy_(value.reshape(-1))
    scratch: dict[str, torch.Tensor] = {}
    for key, sdt in _dtype_keys(schema):
        dtype = getattr(torch, sdt)

        def unit(k: int, key: str = key, dtype: torch.dtype = dtype) -> torch.Tensor:
            value = opt.inner.state.get(opt._pieces[opt._unit_piece[k]].tensor, {}).get(key)
            return value.reshape(-1) if value is not None else torch.zeros_like(opt._unit_target(k, False), dtype=dtype)

        def dest(t: int, key: str = key, dtype: torch.dtype = dtype) -> torch.Tensor:
            found = flats[t].get(key)
            if found is not None and found.dtype == dtype:
                return found
            n = opt._params[t].local().numel()
            return scratch.setdefault(f"{t}/{n}", torch.empty(n, dtype=dtype, device=opt._device))

        opt._from_owners(dest, source=unit, dtypes=dict.fromkeys(opt._exchanges, dtype))
    groups: list[dict[str, Any]] = []
    for gi, g in enumerate(opt.inner.param_groups):
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": []})
        for q in opt._params:
            if q.group == gi:
                groups[-1]["params"].append(q.param)
    view = PieceView(groups, dict(opt.inner.defaults))
    for t, q in enumerate(opt._params):
        if q.local().numel() == 0:
            continue  # [Note: empty pieces hold no state]
        entry: dict[str, Any] = {}
        for key, (kind, value) in schema.get(q.name, {}).items():
            entry[key] = flats[t][key].view(q.local().shape) if kind == "elementwise" else _copy(value)
        if entry:
            view.state[q.param] = entry
    return view


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def load_piece_view(opt: OwnerComputeOptimizer, view: PieceView) -> None:
    """Collective: the state of ``view`` (of :func:`piece_view`, loaded from a checkpoint) into
    the inner optimizer's compute tensors, owned units' from their holders; its hyperparameters
    into the inner optimizer's ``param_groups``."""
    for pc in opt._pieces:
        if pc.unit_start < 0:
            live = opt.inner.state.setdefault(pc.tensor, {})
            for key, value in view.state.get(opt._params[pc.p].param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    live[key].view(-1).copy_(value.reshape(-1)[pc.lo : pc.hi])
                else:
                    live[key] = _copy(value)
    kinds = _every_rank_schema(opt, None)  # the inner state's kinds (piece_view created all of it)
    for key, sdt in _dtype_keys(kinds):
        dtype = getattr(torch, sdt)

        def source(t: int, key: str = key) -> torch.Tensor | None:
            value = view.state.get(opt._params[t].param, {}).get(key)
            return value.reshape(-1) if isinstance(value, torch.Tensor) else None

        def target(k: int, key: str = key, dtype: torch.dtype = dtype) -> torch.Tensor:
            found = opt.inner.state.get(opt._pieces[opt._unit_piece[k]].tensor, {}).get(key)
            return found.view(-1) if found is not None else torch.empty_like(opt._unit_target(k, False), dtype=dtype)

        opt._to_owners(source, False, target=target, dtypes=dict.fromkeys(opt._exchanges, dtype))
    scalars = _every_rank_scalars(opt, view)
    for j in opt._unit_piece.values():  # an owned unit's scalars are its parameter's, from its holders
        live = opt.inner.state.setdefault(opt._pieces[j].tensor, {})
        live.update({key: _copy(v) for key, v in scalars.get(opt._params[opt._pieces[j].p].name, {}).items()})
    for mine, loaded in zip(opt.inner.param_groups, view.param_groups, strict=True):
        mine.update({k: v for k, v in loaded.items() if k != "params"})


def _every_rank_scalars(opt: OwnerComputeOptimizer, view: PieceView) -> dict[str, dict[str, Any]]:
    """The scalar state of every parameter by name, from the ranks whose view holds it."""
    mine: dict[str, dict[str, Any]] = {}
    for q in opt._params:
        for key, value in view.state.get(q.param, {}).items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                mine.setdefault(q.name, {})[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    if not _exchanges_units(opt):
        return mine
    everyone: list[Any] = [None] * opt.world_size
    dist.all_gather_object(everyone, mine, group=opt.process_group)
    merged: dict[str, dict[str, Any]] = {}
    for found in everyone:
        for name, keys in found.items():
            for key, value in keys.items():
                merged.setdefault(name, {}).setdefault(key, value)
    return merged
