"""``blockshard.optim.Muon``: torch's Muon with its momentum on the storage shards.

[Note: momentum-sharded Muon]
``torch.optim.Muon`` does, per matrix: ``buf.lerp_(g, 1 - mu)``; the Nesterov direction
``d = g.lerp(buf, mu)``; ``O = NS(d)`` (Newton-Schulz on the whole matrix, in bfloat16); then
``p.mul_(1 - lr * wd)`` and ``p.add_(O, alpha=-adjusted_lr(shape))``. Everything but ``NS`` is
element-wise, so this optimizer keeps ``buf`` on each rank's piece (optimizer state even across
ranks whatever the matrix sizes, as veScale-FSDP runs it) and moves only ``d``: the pieces of every
cut matrix go to its owner (one ``all_to_all_single``, [Note: owner compute]), the owner runs
torch's own ``NS`` on the whole matrix, and the ``O`` pieces come back (one more) to be applied
where they are. Matrices inside one rank's piece never move. Each element sees the same float
operations in the same order as under ``torch.optim.Muon`` on one process, so the result is
bitwise the same (bfloat16 ``O`` travels as its exact float32 value).

[Note: Muon across tensor parallelism]
A matrix that tensor parallelism splits (a DTensor placed ``Shard(0)`` / ``Shard(1)`` on a tp mesh,
[Note: tensor-parallel parameters] in runtime/core/_tp.py) is sharded over dp as its TP-local
matrix, with ``matrix`` semantics on that local shape: each TP-local matrix's direction ``d`` is
whole on one dp rank (its owner, or the rank whose piece holds it), the *same* dp rank on every tp
rank (the tp ranks plan identical local shapes alike; checked once when the optimizer is built).
There, ``NS`` runs on the global matrix, once, at one tp rank: the step's TP-split matrices get tp
owners (largest ``NS`` first, each to the tp rank with the least ``NS`` work so far; every tp rank
computes the same assignment from the same list), one ``all_to_all_single`` over tp sends each
matrix's ``d`` pieces to its owner, the owner concatenates them along the placement's dim (per part
of a fused weight), runs torch's ``NS`` on the whole matrix and keeps its rows (columns), and a
second ``all_to_all_single`` sends every other tp rank its rows (columns) of ``O``. The learning rate
is adjusted by the global shape. The same float operations on the same values as one process's
``NS`` of the matrix, so bitwise the same; the ``NS`` work is spread over tp instead of repeated on
every tp rank. Bytes per step: each TP-split matrix's fp32 direction ``(tp - 1) / tp`` of it to its
owner and as much of ``O`` back, counted in ``collective_counts()`` as all-to-alls over ``tp`` ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as _newton_schulz

from blockshard.optim._owner_compute import Holding, NamedGroups, OwnerComputeError, ParamsArg, named_groups
from blockshard.optim._owner_optimizer import OwnerComputeOptimizer
from blockshard.optim._step import closure_loss
from blockshard.runtime.core._collectives import wait as _wait
from blockshard.runtime.core._param import managed_tag

__all__ = ["Muon"]


class _MomentumOnShards(torch.optim.Optimizer):
    """The inner optimizer of :class:`Muon`: its ``param_groups`` hold the local pieces and its state
    their momentum; its ``step`` is the element-wise part, with the owner exchange in between."""

    # Newton-Schulz on a TP-split matrix runs on the whole matrix gathered across tp
    # ([Note: Muon across tensor parallelism]); the optimizer guard lets it hold such pieces
    computes_across_tp = True

    def __init__(self, groups: list[dict[str, Any]], defaults: dict[str, Any], outer: Muon) -> None:
        super().__init__(groups, defaults)
        self._outer = outer

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        outer = self._outer
        dirs: dict[int, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                d = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                dirs[outer._index[id(p)]] = d.reshape(-1)
        updates = outer._orthogonalize(dirs)
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                t = outer._index[id(p)]
                if t not in dirs:
                    continue
                q = outer._params[t]
                p.mul_(1 - lr * wd)
                if not q.parts:
                    shape = q.tp.shape if q.tp is not None else q.shape  # the global matrix's, across tp too
                    adjusted = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size(shape[-2:]))
                    p.add_(updates[t].view(p.shape), alpha=-adjusted)
                    continue
                flat, update = p.view(-1), updates[t]
                for a, b, part in _part_runs(q, p.numel()):  # [Note: fused parts]: each part's own lr
                    flat[a:b].add_(update[a:b], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], torch.Size(part)))


class Muon(OwnerComputeOptimizer):
    """``torch.optim.Muon``'s update on the ragged engine's pieces, momentum kept on the shards.

    ``params``: named matrices as :class:`OwnerComputeOptimizer` takes them (``(name, param)``
    pairs, or param_groups such as ``blockshard.optim.muon_param_groups(model)[0]``); every one 2-D
    in its *global* shape, or a stacked ``(E, m, n)`` expert tensor, stepped per expert's ``(m, n)``
    matrix (sharded with a per-expert grid: [Note: experts under Muon] in ``_semantics.py``). The
    other arguments are ``torch.optim.Muon``'s, with its defaults.
    Shard with ``semantics="matrix"`` (or the ``"muon"`` preset) and ``policy="owner"`` or
    ``"auto"``: a matrix the storage cuts is orthogonalized at its owner; see
    [Note: momentum-sharded Muon].
    """

    def __init__(
        self,
        params: ParamsArg,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        process_group: Any = None,
    ) -> None:
        kwargs = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        try:  # torch's own checks of the arguments, and its defaults
            probe = torch.optim.Muon([torch.zeros(1, 1)], **kwargs)  # type: ignore[arg-type]
        except TypeError as exc:
            raise OwnerComputeError(
                f"Muon's arguments {kwargs} are not of the types torch.optim.Muon takes ({exc}). Fix: pass numbers "
                "(lr=0.02, momentum=0.95), a 3-tuple of ns_coefficients and an int ns_steps"
            ) from None
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise OwnerComputeError(
                f"Muon(ns_steps={ns_steps!r}): the number of Newton-Schulz steps must be an int >= 1. Fix: pass "
                f"ns_steps={DEFAULT_NS_STEPS} (torch's default)"
            )
        defaults = dict(probe.defaults)
        groups, mtypes = named_groups(params)
        self._factory = lambda gs: _MomentumOnShards(gs, defaults, self)
        self._process_group_arg, self._mtypes = process_group, mtypes
        self._build(groups)

    _steps_parts = True  # NS and the lr per part of a fused weight ([Note: fused parts])

    def _unit_semantics(self) -> str | None:
        return "matrix"  # Newton-Schulz on whole matrices

    def _check_holdings(self, holdings: list[Holding]) -> None:
        for q in holdings:
            _per_expert(q)
            _check_tp_matrix(q)
        _check_same_across_tp(holdings)

    def _inner_groups(self, groups: NamedGroups) -> list[dict[str, Any]]:
        """The local pieces (momentum lives with them), not the compute tensors."""
        self._index = {id(q.param): t for t, q in enumerate(self._params)}
        return [
            {**opts, "params": [q.param for q in self._params if q.group == gi and q.local().numel()]}
            for gi, (opts, _) in enumerate(groups)
        ]

    #: How a TP-split matrix's ``NS`` runs: ``"owners"`` (once, at one tp rank; [Note: Muon across
    #: tensor parallelism]) or ``"every_rank"`` (every tp rank all-gathers the matrix and runs ``NS``
    #: on it, the same result: ``benchmarks/muon_tp.py``'s baseline).
    ns_across_tp = "owners"

    def _ns(self, t: int, d: torch.Tensor) -> torch.Tensor:
        """``NS`` of one matrix's direction ``d`` (not TP-split), per part of a fused weight ([Note: fused parts])."""
        q = self._params[t]
        g = self.inner.param_groups[q.group]
        outs = [
            _newton_schulz(x, g["ns_coefficients"], g["ns_steps"], g["eps"]) for x in d.split(q.parts or (d.shape[0],))
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _ns_whole(self, t: int, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """``NS`` of a TP-split matrix from every tp rank's direction ``pieces`` (tp rank order): each
        part's global matrix joined along the placement's dim; every tp rank's rows (columns) of ``O``."""
        q = self._params[t]
        assert q.tp is not None and q.tp.shard_dim is not None  # a TP-split matrix (_tp_jobs)
        g = self.inner.param_groups[q.group]
        dim, rows = q.tp.shard_dim, q.parts or (pieces[0].shape[0],)
        per_rank: list[list[torch.Tensor]] = [[] for _ in pieces]
        for i in range(len(rows)):  # part i of the global matrix: part i of every tp rank's
            parts = [x.split(rows)[i] for x in pieces]
            o = _newton_schulz(torch.cat(parts, dim=dim), g["ns_coefficients"], g["ns_steps"], g["eps"])
            for r, mine in enumerate(parts):
                per_rank[r].append(o.narrow(dim, r * mine.shape[dim], mine.shape[dim]))
        return [x[0] if len(x) == 1 else torch.cat(x) for x in per_rank]

    def _ns_all(self, jobs: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """``NS`` of every job ``(tensor index, direction)``, in order: TP-split matrices at their tp
        owners ([Note: Muon across tensor parallelism]), the others here."""
        out: list[torch.Tensor | None] = [None] * len(jobs)
        by_group: dict[tuple[int, torch.dtype], list[int]] = {}
        for k, (t, d) in enumerate(jobs):
            q = self._params[t]
            if q.tp is None or not q.tp.cut:
                out[k] = self._ns(t, d)
            else:
                by_group.setdefault((id(q.tp.group), d.dtype), []).append(k)
        for ks in by_group.values():
            for k, o in zip(ks, self._tp_jobs([jobs[k] for k in ks]), strict=True):
                out[k] = o
        return [o for o in out if o is not None]

    def _tp_jobs(self, jobs: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """``NS`` of TP-split matrices of one tp group and dtype, each at one tp owner: directions to the
        owners, ``NS`` there, each tp rank's rows (columns) of ``O`` back (two ``all_to_all_single``)."""
        tp = self._params[jobs[0][0]].tp
        assert tp is not None
        size, me, dtype = tp.mesh.size(), tp.mesh.get_local_rank(), jobs[0][1].dtype
        if self.ns_across_tp == "every_rank":  # the baseline: every tp rank gathers and orthogonalizes all
            out = []
            for t, d in jobs:
                gathered = [torch.empty_like(d) for _ in range(size)]
                nbytes = d.numel() * d.element_size() * size
                where = f"{type(self).__name__} (directions across tp)"
                self._traffic.record(where, 0, nbytes, nbytes, dtype, "float", self._steps_taken + 1, ranks=size)
                dist.all_gather(gathered, d.contiguous(), group=tp.group)
                out.append(self._ns_whole(t, gathered)[me])
            return out
        owners = _tp_owners([self._params[t] for t, _ in jobs], size)
        numels = [d.numel() for _, d in jobs]  # the same on every tp rank (even TP shards, same layout)
        sends = [[k for k in range(len(jobs)) if owners[k] == r] if r != me else [] for r in range(size)]
        mine = [k for k in range(len(jobs)) if owners[k] == me]
        recv = [sum(numels[k] for k in mine) if r != me else 0 for r in range(size)]
        send = [sum(numels[k] for k in ks) for ks in sends]
        flat = [jobs[k][1].reshape(-1) for ks in sends for k in ks]
        got = self._tp_exchange(tp, flat, send, recv, dtype, "directions to tp owners")
        at = 0
        whole: dict[int, list[torch.Tensor]] = {}
        for r in range(size):  # from each tp rank, its piece of every matrix this rank owns
            for k in mine:
                piece = jobs[k][1] if r == me else got[at : at + numels[k]].view(jobs[k][1].shape)
                at += 0 if r == me else numels[k]
                whole.setdefault(k, []).append(piece)
        results = {k: self._ns_whole(jobs[k][0], whole[k]) for k in mine}
        back = [results[k][r].reshape(-1).to(dtype) for r in range(size) if r != me for k in mine]  # bf16 O: exact
        got = self._tp_exchange(tp, back, recv, send, dtype, "NS results from tp owners")
        out, at = [], 0
        offsets = {}
        for r in range(size):
            for k in sends[r]:
                offsets[k] = at
                at += numels[k]
        for k, (_, d) in enumerate(jobs):
            out.append(results[k][me] if owners[k] == me else got[offsets[k] : offsets[k] + numels[k]].view(d.shape))
        return out

    def _tp_exchange(
        self, tp: Any, chunks: list[torch.Tensor], send: list[int], recv: list[int], dtype: torch.dtype, what: str
    ) -> torch.Tensor:
        """One ``all_to_all_single`` over tp: ``chunks`` (``send[r]`` elements to tp rank ``r``, in rank
        order) out, ``sum(recv)`` elements (``recv[r]`` from rank ``r``) back; counted ([Note: traffic])."""
        inp = torch.cat(chunks) if chunks else torch.empty(0, dtype=dtype)
        out = torch.empty(sum(recv), dtype=dtype)
        nbytes = inp.numel() * inp.element_size()
        where = f"{type(self).__name__} ({what})"
        self._traffic.record(where, 3, nbytes, nbytes, dtype, "float", self._steps_taken + 1, ranks=len(send))
        work = dist.all_to_all_single(out, inp, recv, send, group=tp.group, async_op=True)
        _wait(work, f"blockshard.optim.Muon's all_to_all over tp ({what})", tp.group)
        return out

    def _orthogonalize(self, dirs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``NS`` of every matrix's direction, as flat pieces of this rank: whole matrices here,
        cut ones at their owners (``dirs``: local pieces' directions by tensor index)."""
        self._to_owners(lambda t: dirs.get(t), grads=True)
        updates = {t: torch.zeros_like(self._flat(t)) for t, q in enumerate(self._params) if q.planned or t in dirs}
        jobs: list[tuple[int, torch.Tensor]] = []
        writes: list[Callable[[torch.Tensor], Any]] = []
        for j in self._unit_piece.values():  # the matrices this rank owns over dp
            pc = self._pieces[j]
            d = pc.tensor.grad
            if d is not None and self._params[pc.p].param.grad is not None:
                jobs.append((pc.p, d.view(pc.tensor.shape)))
                writes.append(pc.tensor.copy_)
            pc.tensor.grad = None
        for pc in self._pieces:  # the matrices whole in this rank's pieces
            if pc.unit_start < 0 and pc.p in dirs:
                jobs.append((pc.p, dirs[pc.p][pc.lo : pc.hi].view(pc.tensor.shape)))
                writes.append(functools.partial(_write, updates[pc.p][pc.lo : pc.hi]))
        for write, o in zip(writes, self._ns_all(jobs), strict=True):
            write(o)
        self._from_owners(lambda t: updates[t])
        return updates

    @torch.no_grad()
    def piece_view(self) -> torch.optim.Optimizer:
        """The momentum lives on the pieces already: the inner optimizer is what checkpoints save
        (missing momentum is created as the first step would, zeros, with no exchange)."""
        for group in self.inner.param_groups:
            for p in group["params"]:
                if "momentum_buffer" not in self.inner.state.get(p, {}):
                    self.inner.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return self.inner

    def load_piece_view(self, view: torch.optim.Optimizer) -> None:
        if view is not self.inner:
            raise OwnerComputeError("load_piece_view takes what piece_view returns (the inner optimizer)")

    @torch.no_grad()
    def resync_params(self) -> None:
        """Nothing to resync: owners hold no copy of the parameters (only directions, per step)."""
        self._refresh_views()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        self._refresh_views()
        self.inner.step()
        self._steps_taken += 1  # [Note: traffic]: the next step's collectives count as that step's
        return loss


def _part_runs(q: Holding, numel: int) -> list[tuple[int, int, tuple[int, int]]]:
    """``(a, b, global part shape)`` of each run of this rank's piece of ``q`` (``numel`` elements from
    ``q.local_start`` of the TP-local tensor) inside one part of a fused weight ([Note: fused parts])."""
    rows, cols = q.shape[-2], q.shape[-1]
    grow, gcol = (q.tp.shape[-2] // rows, q.tp.shape[-1] // cols) if q.tp is not None else (1, 1)
    start, end, runs = q.local_start, q.local_start + numel, []
    for m in range(start // (rows * cols), -(-end // (rows * cols))):
        at = m * rows * cols
        for r in q.parts:
            a, b = max(at, start), min(at + r * cols, end)
            if a < b:
                runs.append((a - start, b - start, (r * grow, cols * gcol)))
            at += r * cols
    return runs


def _write(into: torch.Tensor, o: torch.Tensor) -> None:
    into.copy_(o.reshape(-1))


def _tp_owners(matrices: list[Holding], size: int) -> list[int]:
    """The tp rank that runs ``NS`` of each TP-split matrix: largest first (by the global matrix's
    ``NS`` work, ``m * n * min(m, n)`` per part), each to the tp rank with the least work so far, ties
    to the lowest rank; the same on every tp rank."""

    def work(q: Holding) -> int:
        assert q.tp is not None
        m, n = q.tp.shape[-2], q.tp.shape[-1]
        rows = [r * m // q.shape[-2] for r in q.parts] if q.parts else [m]
        return sum(r * n * min(r, n) for r in rows)

    load, owners = [0] * size, [0] * len(matrices)
    for k in sorted(range(len(matrices)), key=lambda k: (-work(matrices[k]), k)):
        owners[k] = min(range(size), key=lambda r: (load[r], r))
        load[owners[k]] += work(matrices[k])
    return owners


def _check_tp_matrix(q: Holding) -> None:
    """A TP-split matrix Muon can gather across tp: 2-D, cut evenly ([Note: Muon across tensor parallelism])."""
    tp = q.tp
    if tp is None:
        return
    if len(q.shape) != 2 or q.matrix_numel or tp.shape[tp.shard_dim] % tp.mesh.size():
        raise OwnerComputeError(
            f"parameter {q.name!r} (global shape {tp.shape}, {q.shape} on this tp rank) is placed {tp.label}: Muon "
            "gathers a TP-split matrix across tp only for a 2-D matrix whose placement's dim the tp degree divides "
            "(stacked experts and uneven TP shards are not supported yet). Fix: choose a tp degree that divides "
            f"dim {tp.shard_dim}, or leave {q.name!r} out of the TP plan"
        )


def _check_same_across_tp(holdings: list[Holding]) -> None:
    """Every tp rank must see each TP-split matrix laid out alike over dp (its ``NS`` exchanges over tp
    where the matrix is whole, in the same order on every tp rank): one all_gather_object per tp
    group, when the optimizer is built."""
    by_group: dict[int, tuple[Any, list[tuple[object, ...]]]] = {}
    for q in holdings:
        if q.tp is not None:
            entry = by_group.setdefault(id(q.tp.group), (q.tp.group, []))
            entry[1].append((q.name, q.shape, q.planned, q.units, q.local_start, q.local_numel, q.cuts))
    for group, mine in by_group.values():
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        if any(other != mine for other in every):
            first = next(other for other in every if other != mine)
            raise OwnerComputeError(
                f"blockshard.optim.Muon: the tp ranks lay out their TP-split matrices differently over dp ({mine[:1]} "
                f"here, {first[:1]} on another tp rank), so Newton-Schulz across tp cannot pair them. Fix: shard every "
                "tp rank's modules with the same fully_shard calls and arguments, and build the optimizer over the "
                "same parameters on every rank"
            )


def _per_expert(q: Holding) -> None:
    """Muon's compute units of ``q``: a 2-D matrix whole; a stacked ``(E, m, n)`` tensor one ``(m, n)``
    matrix per expert (the engine's per-expert grid, or the whole tensor when it is not sharded)."""
    if len(q.shape) == 2:
        return
    if len(q.shape) == 3 and not q.matrix_numel and q.param.ndim == 3 and managed_tag(q.param) is None:
        q.matrix_numel = q.shape[1] * q.shape[2]  # not sharded: every expert's matrix is here
    if len(q.shape) == 3 and q.matrix_numel:
        return
    if len(q.shape) == 3:
        raise OwnerComputeError(
            f"parameter {q.name!r} has global shape {q.shape}, and fully_shard gave it compute units that are not "
            f"one expert's {q.shape[1]} x {q.shape[2]} matrix: Muon orthogonalizes each expert's matrix. Fix: shard "
            "with semantics='muon' or optimizer_semantics(muon_param_groups(model)) (a stacked expert tensor: its "
            "module's class ends in 'Experts' or the module is named 'experts'; else add the 'expert' semantics)"
        )
    raise OwnerComputeError(
        f"parameter {q.name!r} has global shape {q.shape}; Muon orthogonalizes 2-D matrices (and stacked "
        "(E, m, n) experts, per expert) only. Fix: pass Muon's matrices by name, e.g. "
        "blockshard.optim.muon_param_groups(model)[0], and the rest to AdamW"
    )
