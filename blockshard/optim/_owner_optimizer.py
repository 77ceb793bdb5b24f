"""``OwnerComputeOptimizer``: one implementation of [Note: owner compute] for both engines."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from blockshard._arith import block_shape, rows_cols
from blockshard.optim._holdings import process_group_of, ragged_holdings
from blockshard.optim._owner_compute import (
    Holding,
    InnerFactory,
    NamedGroups,
    OwnerComputeError,
    ParamsArg,
    _Piece,
    exchange_lists,
    local_region,
    named_groups,
)
from blockshard.optim._owner_state import PieceView, load_piece_view, piece_view
from blockshard.optim._semantics import computes_on_whole_units, semantics_for_optimizer
from blockshard.optim._step import closure_loss
from blockshard.runtime.core._collectives import agree, wait
from blockshard.runtime.core._optim_guard import mark_stepped, note_inner
from blockshard.runtime.core._traffic import CollectiveCount, Traffic
from blockshard.semantics import get_semantics

__all__ = ["OwnerComputeOptimizer"]


def _wait(work: Any, what: str, group: Any) -> None:

    wait(work, what, group)


class OwnerComputeOptimizer(torch.optim.Optimizer):
    """Step sharded parameters with an unmodified optimizer that sees whole compute units.

    Args:
        inner_optimizer_factory: called once with a list of ``param_groups`` (``{"params": [tensors],
            **options}``) holding this rank's *compute tensors* -- its local pieces, views of the whole
            compute units in them, and the full-unit tensors it owns -- and returns the inner optimizer
            (e.g. ``lambda groups: torch.optim.Muon(groups, lr=0.02)``). A rank may get empty groups.
        params: ``model.named_parameters()`` (or any ``(name, param)`` pairs), a module, or a list of
            ``param_groups`` ``{"params": [(name, param), ...], **options}`` (or ``{"params": [...],
            "param_names": [...]}``, as :func:`blockshard.optim.muon_param_groups` returns).

    On the ragged engine (this class), a tensor that ``fully_shard(..., policy="owner" | "auto")``
    laid out with cut compute units is owner-computed as :func:`blockshard.runtime.owner_plan`
    says; every other piece is stepped where it is. Build it after the last ``fully_shard`` call,
    on every rank. ``inner`` is the inner optimizer; ``param_groups``, ``state_dict`` /
    ``load_state_dict`` (per rank: same world size and plan) and LR schedulers work on this object
    as on it. If parameter values change outside :meth:`step`, call :meth:`resync_params`.
    """

    def __init__(self, inner_optimizer_factory: InnerFactory, params: ParamsArg, *, process_group: Any = None) -> None:
        groups, mtypes = named_groups(params)
        self._factory, self._process_group_arg, self._mtypes = inner_optimizer_factory, process_group, mtypes
        self._build(groups)

    # -- setup ------------------------------------------------------------------------------------
    def _build(self, groups: NamedGroups) -> None:
        """Lay out ``groups`` (``(options, [(name, param)])``) as the engine shards them now."""
        holdings, found = ragged_holdings(groups, getattr(self, "_mtypes", None))
        self._check_holdings(holdings)
        group = process_group_of(self._process_group_arg, found)
        W = group.size() if group is not None else 1
        self._setup(self._factory, groups, holdings, group, W, group.rank() if group is not None else 0)
        units = self._unit_semantics()
        if units is not None:
            self._check_whole(holdings, units)
        if units == "matrix" and not self._steps_parts:
            self._refuse_parts(holdings)

    #: Whether the optimizer steps a fused weight per part ([Note: fused parts]); an inner optimizer
    #: on whole matrices (torch's Muon) would orthogonalize the fused matrix whole
    _steps_parts = False

    def _refuse_parts(self, holdings: list[Holding]) -> None:
        fused = next((q for q in holdings if q.parts), None)
        if fused is not None:
            raise OwnerComputeError(
                f"parameter {fused.name!r} of shape {fused.shape} is a fused weight (its semantics declare parts "
                f"{':'.join(map(str, fused.parts))}), and {type(self.inner).__name__} would orthogonalize it as one "
                "matrix. Fix: shard with blockshard.fully_shard and step it with blockshard.optim.Muon (Muon per "
                "part), or drop its 'parts' semantics if one matrix is meant"
            )

    def _unit_semantics(self) -> str | None:
        """The semantics of the inner optimizer's compute units where they are larger than an
        element (``"matrix"``, ``"shampoo:D"``); None for element-wise or unknown optimizers."""
        return semantics_for_optimizer(self.inner) if computes_on_whole_units(self.inner) else None

    def _check_whole(self, holdings: list[Holding], units: str) -> None:
        """A piece whose storage cut falls inside one of the inner optimizer's compute units (a Muon
        matrix, a Shampoo stripe), with no owner for it, would be computed alone: refuse it. The
        cuts come from the layout, so every rank that passes the parameter raises alike."""
        semantics = get_semantics(units)
        for q in holdings:
            if q.planned or q.matrix_numel or not q.cuts:
                continue
            grid = semantics.grid(q.shape, str(q.param.dtype).removeprefix("torch."), tensor=q.name)
            inside = [c for c in q.cuts if not (grid.min_cut <= c <= grid.max_cut and c % grid.unit_numel == 0)]
            if inside:
                raise OwnerComputeError(
                    f"parameter {q.name!r} of shape {q.shape} is cut between ranks at element {inside[0]}, inside "
                    f"one of {type(self.inner).__name__}'s compute units, and fully_shard gave that unit no owner "
                    "(the model was sharded with other semantics): it would be computed on the piece alone. Fix: "
                    "shard with the optimizer's semantics (semantics='muon', "
                    "blockshard.optim.optimizer_semantics(param_groups)); with Accelerate, blockshard "
                    "accelerate-config --semantics muon"
                )

    def _check_holdings(self, holdings: list[Holding]) -> None:
        """Refuse parameters the inner optimizer cannot step (a subclass's constraint)."""
        return None

    def blockshard_compute_tensors(
        self,
    ) -> tuple[torch.optim.Optimizer, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """For ``blockshard.report`` (a ``ComputeTensors``): the inner optimizer, the parameters this
        optimizer steps and each compute tensor of the inner one with its parameter."""
        params = [q.param for q in self._params]
        return self.inner, params, [(pc.tensor, self._params[pc.p].param) for pc in self._pieces]

    def follow(self, params: Mapping[str, torch.Tensor], names: Mapping[int, str] | None = None) -> bool:
        """Collective (every rank): rebuild over the current tensors ``params`` (name -> tensor, e.g.
        ``dict(model.named_parameters())`` after ``fully_shard``) of the parameters this optimizer
        was built over, found by name (``names``: ``id(old tensor) -> name``, where the names it
        was given are not the model's). For an optimizer built before sharding (Accelerate's
        order: build, then ``prepare``); it must not have stepped. Hyperparameters set on
        ``param_groups`` since (an LR scheduler's) are kept. Returns whether anything changed."""
        names = names or {}
        rebuilt: NamedGroups = []
        stale = False
        for opts, named in self._groups:
            pairs = []
            for name, p in named:
                key = names.get(id(p), name)
                now = params.get(key)
                if now is None:
                    raise OwnerComputeError(
                        f"parameter {name!r} of shape {tuple(p.shape)} is not a parameter of the model being "
                        "sharded; build the optimizer over model.named_parameters() (or "
                        "blockshard.optim.muon_param_groups(model)) of the model you prepare"
                    )
                stale |= now is not p
                pairs.append((key, now))
            rebuilt.append((opts, pairs))
        if not stale:
            return False
        if any(self.inner.state.values()):
            raise OwnerComputeError(
                f"{type(self).__name__} has stepped already, and fully_shard replaced its parameters since: its "
                "state cannot move onto the pieces. Fix: shard (accelerator.prepare) before the first step"
            )
        hyper = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in self.inner.param_groups]
        self._build(rebuilt)
        if len(hyper) == len(self.inner.param_groups):
            for g, h in zip(self.inner.param_groups, hyper, strict=True):
                g.update(h)
        return True

    def _setup(
        self, factory: InnerFactory, groups: NamedGroups, holdings: list[Holding], process_group: Any, W: int, rank: int
    ) -> None:
        if not callable(factory):
            raise OwnerComputeError(
                f"inner_optimizer_factory={factory!r} must be callable: "
                "groups -> optimizer, e.g. lambda groups: torch.optim.Muon(groups, lr=0.02)"
            )
        self._params, self.process_group, self.world_size, self.rank = holdings, process_group, W, rank
        self._factory, self._groups, self._stepping_inner = factory, groups, False
        # [Note: traffic]: the all_to_alls since this layout was built (every constructor, subclasses'
        # too, ends here), for collective_counts; the steps number the log's lines
        self._traffic, self._steps_taken = Traffic(), 0
        # A rank may hold none of the parameters (muon_param_groups leaves out the empty pieces of
        # whole-placed matrices): it has no exchanges, so no device is needed for them.
        self._device = holdings[0].local().device if holdings else torch.device("cpu")
        # Only ranks with owner-computed tensors check: every rank passes those (their empty pieces
        # too), while whole-placed ones, and so the ranks that find the process group, vary by rank.
        if W > 1 and process_group is not None and any(q.planned for q in holdings):
            self._check_same_plan()
        self._build_pieces()
        self.inner = factory(self._inner_groups(groups))
        if not all(hasattr(self.inner, a) for a in ("step", "state_dict", "load_state_dict", "param_groups")):
            raise OwnerComputeError(f"inner_optimizer_factory returned {self.inner!r}, not a torch.optim.Optimizer")
        note_inner(self.inner, type(self).__name__)
        self.resync_params()

    def _check_same_plan(self) -> None:
        """Every rank must hold the same owner-computed tensors (else the all_to_alls would not pair)."""
        mine = [(q.name, q.units) for q in self._params if q.planned]
        digest = hashlib.sha256(repr(mine).encode()).hexdigest()[:16]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (digest, len(mine)), group=self.process_group)
        if len(set(everyone)) > 1:
            by_rank = ", ".join(f"rank {r}: {n} tensors, plan {h}" for r, (h, n) in enumerate(everyone))
            raise OwnerComputeError(
                f"ranks disagree on the owner-computed tensors they pass ({by_rank}). Every rank must pass "
                "the same parameters, its empty pieces too (a rank may own a matrix it holds none of): "
                "pass model.named_parameters() or blockshard.optim.muon_param_groups(model), unfiltered"
            )

    def _inner_groups(self, groups: NamedGroups) -> list[dict[str, Any]]:
        """The inner optimizer's ``param_groups``: this rank's compute tensors, group by group."""
        return [
            {**opts, "params": [pc.tensor for pc in self._pieces if self._params[pc.p].group == gi]}
            for gi, (opts, _) in enumerate(groups)
        ]

    def _build_pieces(self) -> None:
        dtypes = [str(q.param.dtype).removeprefix("torch.") for q in self._params]
        self._exchanges, owned = exchange_lists(self._params, dtypes, self.rank, self.world_size)
        owned_by_param: dict[int, list[tuple[int, int, int, tuple[int, int, int] | None]]] = {}
        for k, (_, p, a, n, own) in enumerate(owned):
            owned_by_param.setdefault(p, []).append((k, a, n, own))
        self._pieces: list[_Piece] = []
        self._unit_piece: dict[int, int] = {}  # position in `owned` -> index in self._pieces
        for i, q in enumerate(self._params):
            local = q.local()
            if not q.planned:
                if q.matrix_numel and local.numel():
                    self._add_matrices(i, q, local, 0, local.numel(), split=True)
                elif local.numel():
                    t = q.param if q.direct else local
                    key = (q.name, "local", tuple(local.shape))
                    self._pieces.append(_Piece(i, key, t, 0, local.numel(), direct=q.direct))
            else:
                self._add_region(i, q, local)
            for k, a, n, own in owned_by_param.get(i, []):
                shape = q.shape[-2:] if q.matrix_numel == n else block_shape(q.shape, a, n)
                unit = torch.empty(shape, dtype=q.param.dtype, device=local.device)
                self._unit_piece[k] = len(self._pieces)
                self._pieces.append(_Piece(i, (q.name, "unit", a, n), unit, unit_start=a, own=own))

    def _add_region(self, i: int, q: Holding, local: torch.Tensor) -> None:
        """The whole compute units of this rank's piece of planned tensor ``q``, as one compute tensor."""
        lo, hi = local_region(q)
        if lo >= hi:
            return
        row = rows_cols(q.shape)[1]
        key = (
            (q.name, "rows", lo // row, hi // row)
            if row and not lo % row and not hi % row
            else (q.name, "elems", lo, hi)
        )
        a, b = lo - q.local_start, hi - q.local_start
        if q.matrix_numel:
            self._add_matrices(i, q, local, a, b, split=False)
        elif q.direct and (a, b) == (0, q.local_numel):
            self._pieces.append(_Piece(i, key, q.param, a, b, direct=True))
        else:
            self._pieces.append(_Piece(i, key, local.reshape(-1)[a:b].view(block_shape(q.shape, lo, hi - lo)), a, b))

    def _add_matrices(self, i: int, q: Holding, local: torch.Tensor, a: int, b: int, *, split: bool) -> None:
        """Elements ``[a, b)`` of the local piece (whole ``(m, n)`` matrices of a stacked tensor) as
        one 2-D compute tensor per matrix, keyed by its first element in the tensor."""
        mn, start = q.matrix_numel, q.local_start if q.planned else 0
        flat = local.reshape(-1)
        for lo in range(a, b, mn):
            view = flat[lo : lo + mn].view(q.shape[-2:])
            self._pieces.append(_Piece(i, (q.name, "matrix", start + lo), view, lo, lo + mn, split=split))

    # -- communication ----------------------------------------------------------------------------
    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int], what: str
    ) -> None:
        # [Note: collective headers]: the sizes are each rank's own, so the header compares the call and dtype
        agree(self.process_group, f"the owner-compute all_to_all ({what})", dtype=inp.dtype)
        planned = sum(in_sizes) * inp.element_size()  # the exchange plan's sends ([Note: traffic])
        where = f"{type(self).__name__}({type(self.inner).__name__}) ({what})"
        self._traffic.record(
            where, 3, inp.numel() * inp.element_size(), planned, inp.dtype, "float", self._steps_taken + 1
        )
        work = dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=self.process_group, async_op=True)
        _wait(work, f"the owner-compute all_to_all ({what})", self.process_group)

    def _to_owners(
        self,
        source: Callable[[int], torch.Tensor | None],
        grads: bool,
        *,
        target: Callable[[int], torch.Tensor] | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """Slices of cut units (``source(t)``: tensor ``t``'s local piece, flat, or ``None``: zeros) ->
        their owners' full-unit tensors (``grads``: their ``.grad``; ``target(k)``: unit ``k``'s flat
        tensor to fill instead, in ``dtypes[param dtype]``, e.g. optimizer state)."""
        for dt, e in self._exchanges.items():
            dtype = dtypes[dt] if dtypes is not None else getattr(torch, dt)
            chunks = []
            for peer in range(self.world_size):
                for t, off, n in e.sends[peer]:
                    src = source(t)
                    chunks.append(
                        src[off : off + n] if src is not None else torch.zeros(n, dtype=dtype, device=self._device)
                    )
            inp = torch.cat(chunks).to(dtype) if chunks else torch.empty(0, dtype=dtype, device=self._device)
            out = torch.empty(sum(e.recv_sizes), dtype=dtype, device=self._device)
            self._all_to_all(out, inp, e.recv_sizes, e.send_sizes, "gradients to owners" if grads else "values")
            pos = 0
            for peer in range(self.world_size):
                for k, uoff, n in e.recvs[peer]:
                    (target(k) if target is not None else self._unit_target(k, grads))[uoff : uoff + n].copy_(
                        out[pos : pos + n]
                    )
                    pos += n
        for k, j in self._unit_piece.items():
            pc = self._pieces[j]
            if pc.own is not None:
                off, uoff, n = pc.own
                src = source(pc.p)
                dst = target(k) if target is not None else self._unit_target(k, grads)
                dst[uoff : uoff + n].copy_(src[off : off + n]) if src is not None else dst[uoff : uoff + n].zero_()

    def _from_owners(
        self,
        dest: Callable[[int], torch.Tensor],
        *,
        source: Callable[[int], torch.Tensor] | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        """Values of owned units (``source(k)``: unit ``k``'s flat tensor to send instead, in
        ``dtypes[param dtype]``) -> every holder's ``dest(t)`` (tensor ``t``'s local piece, flat)."""
        unit = source if source is not None else (lambda k: self._unit_target(k, False))
        for dt, e in self._exchanges.items():
            dtype = dtypes[dt] if dtypes is not None else getattr(torch, dt)
            chunks = [unit(k)[uoff : uoff + n] for peer in range(self.world_size) for k, uoff, n in e.recvs[peer]]
            inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype, device=self._device)
            out = torch.empty(sum(e.send_sizes), dtype=dtype, device=self._device)
            self._all_to_all(out, inp, e.send_sizes, e.recv_sizes, "new values back")
            pos = 0
            for peer in range(self.world_size):
                for t, off, n in e.sends[peer]:
                    dest(t)[off : off + n].copy_(out[pos : pos + n])
                    pos += n
        for k, j in self._unit_piece.items():
            pc = self._pieces[j]
            if pc.own is not None:
                off, uoff, n = pc.own
                dest(pc.p)[off : off + n].copy_(unit(k)[uoff : uoff + n])

    def _flat(self, t: int) -> torch.Tensor:
        """Tensor ``t``'s local piece: a flat view, written in place."""
        return self._params[t].local().view(-1)

    def _flat_grad(self, t: int) -> torch.Tensor | None:
        g = self._params[t].local_grad()
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
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise OwnerComputeError("add_param_group is not supported: build a new OwnerComputeOptimizer with every group")

    @torch.no_grad()
    def resync_params(self) -> None:
        """Collective: re-read the owners' full-unit tensors from the parameters' local pieces."""
        self._refresh_views()
        self._to_owners(self._flat, grads=False)

    def _refresh_views(self) -> None:
        for pc in self._pieces:
            if pc.unit_start < 0 and not pc.direct:  # re-point the view at the current local piece
                q = self._params[pc.p]
                local = q.local()
                sliced = q.planned or pc.split
                pc.tensor.data = local.reshape(-1)[pc.lo : pc.hi].view(pc.tensor.shape) if sliced else local

    def collective_counts(self) -> list[CollectiveCount]:
        """This rank's owner-compute all_to_alls since it was built (gradients to owners, values back,
        and a checkpoint's state), bytes sent against the exchange plan ([Note: traffic])."""
        return self._traffic.counts("", f"{type(self).__name__}({type(self.inner).__name__})")

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Gradients to owners, inner step on whole units and local pieces, new values back."""
        mark_stepped(q.param for q in self._params)  # a rank that owns nothing steps its pieces too
        self._steps_taken += 1
        loss = closure_loss(closure)
        with torch.no_grad():
            self._refresh_views()
            for pc in self._pieces:
                if pc.unit_start < 0 and not pc.direct:
                    q = self._params[pc.p]
                    g = q.local_grad()
                    if g is not None and (q.planned or pc.split):
                        g = g.reshape(-1)[pc.lo : pc.hi].view(pc.tensor.shape)
                    pc.tensor.grad = g
            self._to_owners(self._flat_grad, grads=True)
            for j in self._unit_piece.values():  # a unit whose parameter has no gradient is skipped
                if self._params[self._pieces[j].p].param.grad is None:
                    self._pieces[j].tensor.grad = None
            self._stepping_inner = True  # [Note: a reused optimizer] in _rebind.py
            try:
                self.inner.step()
            finally:
                self._stepping_inner = False
            self._from_owners(self._flat)
            for pc in self._pieces:
                if not pc.direct:
                    pc.tensor.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for q in self._params:
            if q.param.grad is not None:
                if set_to_none:
                    q.param.grad = None
                else:
                    q.param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
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
        if not isinstance(state_dict, Mapping) or not {*mine, "inner"} <= set(state_dict):
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise OwnerComputeError(
                f"{type(self).__name__}.load_state_dict got {keys}; it needs 'inner', 'world_size', 'rank' and "
                f"'layout'. Fix: pass what {type(self).__name__}.state_dict() returned on this rank"
            )
        got = {k: state_dict.get(k) for k in mine}
        if not isinstance(got["layout"], (list, tuple)) or not all(isinstance(x, (list, tuple)) for x in got["layout"]):
            raise OwnerComputeError(
                f"state_dict['layout'] is {got['layout']!r:.80}, not a list of compute-tensor keys. Fix: pass what "
                f"{type(self).__name__}.state_dict() returned on this rank"
            )
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

    def piece_view(self) -> torch.optim.Optimizer:
        """Collective: this optimizer's state as an element-wise optimizer's over the model's
        pieces, what checkpoints save ([Note: owner-compute state in checkpoints])."""
        return piece_view(self)

    def load_piece_view(self, view: torch.optim.Optimizer) -> None:
        """Collective: load the state of a :meth:`piece_view` (filled from a checkpoint), then
        re-read the owned units' values from the pieces (loaded with it)."""
        if not isinstance(view, PieceView):
            raise OwnerComputeError(f"load_piece_view takes what piece_view returns, not a {type(view).__name__}")
        load_piece_view(self, view)
        self.resync_params()

    def owned_units(self) -> list[tuple[str, int, int]]:
        """``(parameter name, start element, numel)`` of every unit this rank owns."""
        return [
            (self._params[pc.p].name, pc.unit_start, pc.tensor.numel()) for pc in self._pieces if pc.unit_start >= 0
        ]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(inner={type(self.inner).__name__}, world_size={self.world_size}, "
            f"rank={self.rank}, compute_tensors={len(self._pieces)}, owned_units={len(self._unit_piece)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        raise OwnerComputeError("an OwnerComputeOptimizer cannot be pickled; save its state_dict() instead")
