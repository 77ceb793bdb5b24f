"""Optimizer state of a sharded model by parameter name, with global shapes: what DCP can reshard.

[Note: optimizer state entries]
An optimizer over the sharded parameters keeps per-parameter state that describes the rank's
*piece*: element-wise tensors of the piece's block shape (AdamW's ``exp_avg``, Muon's
``momentum_buffer``, bitsandbytes' quantized ``state1``), one value per block of the piece
(bitsandbytes' ``absmax``), tensor subclasses (torchao's ``OptimState8bit``), per-tile lists
(BlockedShampoo). Each becomes entries of *global* tensors of which this rank's state is one flat
run, a :class:`PieceTensor` ([Note: optimizer state codecs] in ``_optim_codecs.py``), so DCP reshards
it like the parameter. A one-element tensor that is not a piece (AdamW's ``step``) is the same on
every rank and is saved once. State blockshard does not know raises
:class:`~blockshard.runtime.CheckpointError` naming the key instead of being saved as if every rank
held the same value (DCP keeps one rank's copy of a plain entry).
The layout is FQN-keyed, as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``:
``{"state": {name: {key: value}}, "param_groups": [{hyperparameters..., "params": [names]}]}``.
Ranks may build their optimizers over different parameters (a rank leaves out the tensors it
holds no element of): each ``param_group``'s ``params`` lists the names of every rank's
(gathered, in the model's order), and a rank loads the state of the names it holds.

[Note: empty pieces hold no state]
A rank may hold a 0-element piece of a parameter (another rank holds it whole, or the cut falls
past it), and the README's recipe builds the optimizer over every piece, empty ones too. An
optimizer gives such a piece state of its own kind, which need not be the kind the other pieces
have: bitsandbytes keeps 32-bit state below ``min_8bit_size`` (an fp32 ``state1`` of 0 elements
beside the holder's uint8 ``state1`` and its ``absmax1``), torchao keeps plain fp32 tensors where
the holder has ``OptimState8bit`` (entries ``exp_avg`` against ``exp_avg.codes`` /
``exp_avg.scale``). Such an entry has nothing to save or load, yet its dtype and keys are checked
against the checkpoint. So an empty piece holds no state in the state dict: its parameter stays in
its ``param_group``'s ``params``, its entries are left out (as for a rank that left the piece out
of its optimizer), loading leaves its live state (0 elements) alone, and torch's full state dict
gets its empty entries from the ranks that hold elements (:func:`_with_every_rank_state`). Saving
and loading work the same whether the optimizer holds the empty pieces or not. The ranks that do
hold elements of a parameter must hold state of one kind (the same keys and dtypes): the gather of
the names compares them, so mixed state (e.g. a piece below ``min_8bit_size`` beside 8-bit pieces,
whose bytes DCP would reshard as one dtype) raises :class:`~blockshard.runtime.CheckpointError`
on every rank, naming the parameter and the ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from blockshard._errors import CheckpointError
from blockshard.runtime.checkpoint._optim_codecs import decode_state, encode_state
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor
from blockshard.runtime.core._inspect import agree_on_call, join_name, states_under
from blockshard.runtime.core._inspect import state_name as _name
from blockshard.runtime.core._optim_guard import uncounted_steps
from blockshard.runtime.core._param import ShardedParam

__all__ = ["HasPieceView", "load_optimizer_state_dict", "optimizer_state_dict"]


@runtime_checkable
class HasPieceView(Protocol):
    """An optimizer whose state lives on tensors other than the model's pieces (owner compute:
    whole units at their owners) and that presents it as an element-wise optimizer's over the
    pieces, which is what is saved and loaded (blockshard/optim/_owner_state.py,
    [Note: owner-compute state in checkpoints]). Both methods are collective."""

    def piece_view(self) -> torch.optim.Optimizer: ...

    def load_piece_view(self, view: torch.optim.Optimizer) -> None: ...


def _by_param(model: nn.Module) -> dict[int, tuple[str, ShardedParam | None]]:
    """``id(param) -> (name, sharded param or None)`` for what ``model.parameters()`` yields."""
    out: dict[int, tuple[str, ShardedParam | None]] = {
        id(sp.sharded): (join_name(prefix, sp.fqn), sp)
        for prefix, st in states_under(model)
        for sp in st.buffers.params
    }
    gathered = {id(sp.unsharded) for _, st in states_under(model) for sp in st.buffers.params}
    for name, p in model.named_parameters():  # parameters outside any group
        if id(p) not in out and id(p) not in gathered:
            out[id(p)] = (_name(name), None)
    return out


def _optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter, Any]]:

    names = _by_param(model)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError(
                    f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter of the model. "
                    "Fix: build the optimizer over model.parameters() after fully_shard"
                )
            name, sp = names[id(p)]
            out.append((name, p, sp))
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer, *, every: bool = False) -> None:
    """Create the state of trainable parameters that have none yet (a fresh optimizer, or a
    parameter that never had a gradient) with one step at learning rate 0 that sees a zero
    gradient for those parameters only (the others' gradients are hidden, so their state is not
    touched), as torch's ``set_optimizer_state_dict`` does; a fresh optimizer then has tensors
    for ``dcp.load`` to fill. The parameters do not change (an update scaled by 0). ``every``: of
    every tensor it holds, whether it requires grad or not (owner compute's compute tensors)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = {id(p) for p in params if (every or p.requires_grad) and not optimizer.state.get(p)}
    if not missing:
        return
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in missing else None
    try:
        with uncounted_steps():  # not a training step ([Note: collective integrity])
            optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state by parameter name, as entries of global tensors (:class:`PieceTensor`,
    views of the live state where the state is one flat run; see [Note: optimizer state entries]).
    State that does not exist yet is created first (:func:`init_optimizer_state`). Collective
    (every rank calls it) when the model is sharded over more than one rank: the ranks' parameter
    names are gathered."""
    agree_on_call(model, "blockshard.optimizer_state_dict")  # [Note: collective headers]
    if isinstance(optimizer, HasPieceView):
        optimizer = optimizer.piece_view()
    init_optimizer_state(optimizer)
    params = _optimizer_params(model, optimizer)
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    error = None
    for g, members in zip(optimizer.param_groups, _by_group(params, optimizer), strict=True):
        for name, p, sp in members:
            try:
                if (entries := optimizer.state.get(p)) and not _empty(sp):  # [Note: empty pieces hold no state]
                    state[name] = {k: encode_state(name, k, v, p, sp, (optimizer, g)) for k, v in entries.items()}
            except CheckpointError as e:  # raised on every rank below
                error = error or str(e)
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": [n for n, _, _ in members]})
    held = [g["params"] for g in groups]
    names = _every_rank_names(model, held, error, _kinds(state, held))
    for group, every in zip(groups, names, strict=True):
        group["params"] = every
    return {"state": state, "param_groups": groups}


def _empty(sp: ShardedParam | None) -> bool:
    """A 0-element piece of a sharded parameter ([Note: empty pieces hold no state])."""
    return sp is not None and sp.local_numel == 0


Kinds = tuple[list[str], list[int]]  # distinct kinds of state, and each held name's (-1: no state)


def _kinds(state: Mapping[str, Any], names: list[list[str]]) -> Kinds:
    """What :func:`_check_one_kind` compares, compactly (every rank sends it to every rank): the
    distinct kinds of this rank's state (the dtype of each PieceTensor entry by dotted key), and
    for each of ``names`` (flattened) the index of its kind, -1 where it has no state."""

    def walk(entries: Any, prefix: str, out: dict[str, str]) -> dict[str, str]:
        for key, value in entries.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.", out)
            elif isinstance(value, PieceTensor):
                out[f"{prefix}{key}"] = str(value.dtype).removeprefix("torch.")
        return out

    table: dict[str, int] = {}
    ids = []
    for name in (n for group in names for n in group):
        if name not in state:
            ids.append(-1)
            continue
        kind = repr(dict(sorted(walk(state[name], "", {}).items())))
        ids.append(table.setdefault(kind, len(table)))
    return list(table), ids


def _check_one_kind(gathered: list[tuple[list[list[str]], Kinds]]) -> None:
    """Raise :class:`CheckpointError` if two ranks hold state of one parameter with other keys or
    dtypes (``gathered``: every rank's names and :func:`_kinds`)."""

    first: dict[str, tuple[int, str]] = {}
    for rank, (names, (table, ids)) in enumerate(gathered):
        for name, i in zip((n for group in names for n in group), ids, strict=True):
            if i < 0:
                continue
            r0, k0 = first.setdefault(name, (rank, table[i]))
            if table[i] != k0:
                raise CheckpointError(
                    f"the optimizer state of parameter {name!r} differs between the ranks that hold its elements: "
                    f"rank {r0} holds {k0}, rank {rank} holds {table[i]} (e.g. bitsandbytes keeps 32-bit state for "
                    "a piece below min_8bit_size, 8-bit state for the others): a checkpoint would mix them. Fix: "
                    "shard it with the optimizer's block semantics (e.g. semantics='bnb8bit' or 'ao8bit'), or give "
                    "the optimizer a min_8bit_size below every rank's piece of it"
                )


def _by_group(
    params: list[tuple[str, nn.Parameter, Any]], optimizer: torch.optim.Optimizer
) -> list[list[tuple[str, nn.Parameter, Any]]]:
    it = iter(params)
    return [[next(it) for _ in g["params"]] for g in optimizer.param_groups]


def _every_rank_names(model: nn.Module, names: list[list[str]], error: str | None, kinds: Kinds) -> list[list[str]]:
    """Per ``param_group``, the names every rank's optimizer holds, in the model's order; raises
    :class:`CheckpointError` on every rank if one rank's state could not be placed (``error``)
    or the ranks' state of one parameter is not of one kind (``kinds``, see :func:`_kinds`)."""
    import torch.distributed as dist

    states = states_under(model)
    pg = states[0][1].buffers.process_group if states else None
    if pg is None or not dist.is_initialized() or dist.get_world_size(pg) == 1:
        if error:
            raise CheckpointError(error)
        return names
    gathered: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, (names, error, kinds), group=pg)
    errors = [(r, e) for r, (_, e, _) in enumerate(gathered) if e]
    if errors:
        raise CheckpointError(f"{errors[0][1]} (on rank {errors[0][0]}; {len(errors)} of {len(gathered)} ranks)")
    if len({len(n) for n, _, _ in gathered}) != 1:
        raise CheckpointError(
            f"the ranks' optimizers have different numbers of param_groups ({[len(n) for n, _, _ in gathered]}). "
            "Fix: build the same param_groups on every rank (a group may be empty)"
        )
    _check_one_kind([(n, k) for n, _, k in gathered])
    order = {_name(n): i for i, n in enumerate(n for n, _ in model.named_parameters())}
    return [sorted(set().union(*(n[i] for n, _, _ in gathered)), key=order.__getitem__) for i in range(len(names))]


@torch.no_grad()
def load_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Copy a state dict of :func:`optimizer_state_dict`'s form into the optimizer (the entries
    ``dcp.load`` filled in place are copied onto themselves; other pieces must match this rank's)."""
    agree_on_call(model, "blockshard.load_optimizer_state_dict")  # [Note: collective headers]
    if isinstance(optimizer, HasPieceView):
        view = optimizer.piece_view()
        load_optimizer_state_dict(model, view, state)
        optimizer.load_piece_view(view)
        return
    params = _optimizer_params(model, optimizer)
    saved_groups = state["param_groups"]
    mine = _by_group(params, optimizer)
    unknown = [n for g, members in zip(saved_groups, mine, strict=False) for n, _, _ in members if n not in g["params"]]
    if len(saved_groups) != len(mine) or unknown:
        raise CheckpointError(
            f"the optimizer state has {len(saved_groups)} param_groups for parameters "
            f"{[g['params'][:3] for g in saved_groups]}, this optimizer has {len(mine)} holding "
            f"{[[n for n, _, _ in m][:3] for m in mine]} (not in the state: {unknown[:5]}): another model or another "
            "optimizer set-up. Fix: load the state of this optimizer"
        )
    init_optimizer_state(optimizer)
    for g, members in zip(optimizer.param_groups, mine, strict=True):
        for name, p, sp in members:
            if _empty(sp):  # nothing to load into ([Note: empty pieces hold no state])
                continue
            live = optimizer.state[p]
            for key, value in state["state"].get(name, {}).items():
                live[key] = decode_state(name, key, value, live.get(key), sp, (optimizer, g))
    for g, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
