"""The first-step optimizer checks: an optimizer that would step sharded pieces otherwise than one
process steps the whole tensors raises, on every rank, before its first step changes anything.

[Note: first-step optimizer checks]
Code written for one process chooses param_groups from what it sees of a parameter; on sharded
pieces that may be another thing on every rank. The optimizer guard's step pre-hook
([Note: optimizer guard] in _optim_guard.py) runs points 2-4 the first time an optimizer steps
(and again when its parameters change), on this rank's pieces, before the step changes anything;
point 1 needs every rank's view and runs once per root at a point every rank reaches.
  1. **Pieces split across param_groups or optimizers** (:func:`compare_across_ranks`). Each first
     step notes on the pieces' root context which (optimizer, param_group) class steps each piece
     here (the class: the optimizer's class name and the text of its param_group's hyperparameters,
     :func:`~blockshard.runtime.core._optim_facts.hyper_text`). At the end-of-step check after the
     first step in which any rank's optimizer stepped the root's pieces (the check's all-reduce tells
     every rank that step, so every rank is there) the ranks exchange, per trainable parameter, the
     classes stepping the pieces of the ranks that hold elements of it (one header, one
     ``all_gather_object``), and every rank raises the same :class:`OptimizerSetupError` where they
     differ: weight decay on some ranks and none on others, a second optimizer on some, or none.
     Ranks holding no element are left out (what they do with an empty piece changes nothing), so
     ranks may build different optimizers over their empty pieces (``muon_param_groups`` gives
     torch's Muon only the matrices a rank holds). The first step has run by then: the message says
     so. An optimizer that first steps later (a GAN's second, every k steps) is checked by points
     2-4 only.
  2. **Param groups chosen by the piece's shape.** Even where every rank agrees, a choice by
     ``p.ndim`` differs from one process where the pieces' ndim differs from the tensors'. Where the
     class of every held piece is a function of the piece's ndim but not of the global tensor's
     (tensors of one global ndim land in other classes, exactly along their pieces' ndim), the
     checks raise with the recipe (:func:`blockshard.global_shape`, :func:`blockshard.param_groups_by`):
     at the first step among one element-wise optimizer's param_groups, and in point 1 among the
     element-wise optimizers (whole-unit optimizers are left out: Muon's matrices are whole on their
     owners, and a Muon chosen by name beside an AdamW holding flat pieces is the usual setup).
  3. **State of another kind** ([Note: state kind] in _optim_facts.py): a piece for which the
     optimizer would keep fp32 state where one process keeps 8-bit state (or the reverse).
  4. **Two optimizers.** A piece that an optimizer still stepping holds when another optimizer
     takes its first step over it: raised at the earlier optimizer's next step (an optimizer that
     was replaced and never steps again is not a second one).
Points 2-4 raise on each rank that sees the case (every rank, where the ranks build their optimizers
alike; a rank alone: its peers' next collective reports its failure). ``BLOCKSHARD_OPTIMIZER_CHECKS=0``
turns all four off (every rank must agree): for a choice by name that only looks like one by ndim.
A piece that a whole-unit optimizer (torch's Muon, BlockedShampoo) would compute on while it cuts a
unit is refused by the guard itself (``_check_not_cut``).

Cost: once per optimizer (and per change of its parameters) a pass over its param_groups; once per
root one exchange of a few bytes per parameter; nothing per step afterwards but a weak-dictionary
lookup.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from blockshard._errors import OptimizerSetupError
from blockshard.runtime.core._collectives import agree
from blockshard.runtime.core._optim_facts import HeldPiece, held_pieces, hyper_crc

__all__ = [
    "CHECKS_ENV",
    "STRICT_ENV",
    "check_first_step",
    "check_still_one",
    "checks_on",
    "compare_across_ranks",
    "strict",
]

#: Set to 0 to turn off the first-step optimizer checks (on by default).
CHECKS_ENV = "BLOCKSHARD_OPTIMIZER_CHECKS"
#: Set to 1 for the checks that may refuse a setup one process accepts (a trainable parameter no optimizer steps).
STRICT_ENV = "BLOCKSHARD_STRICT"

_SHOWN = 3  # parameters named per message


@dataclass(frozen=True)
class _Row:
    """What one rank says about one parameter: whether it holds elements of it, the hyperparameters'
    CRC of the param_group holding its piece here (-1: this optimizer holds none), the piece's and
    the tensor's ndim, the state kinds (piece, whole)."""

    holds: bool
    hyper: int
    piece_ndim: int
    global_ndim: int
    kinds: tuple[str | None, str | None]
    numel: int  # of the piece
    classes: tuple[int, ...] = ()  # compared across ranks: the (optimizer, param_group) classes stepping it here


# earlier optimizer -> (the later one's class name, a parameter both hold): [Note: ...] point 4
_overlaps: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[str, str]] = weakref.WeakKeyDictionary()
_STEPPED_BY = "_blockshard_stepped_by"  # on a piece: a weak reference to the optimizer that first stepped it


def checks_on() -> bool:
    """Whether the first-step optimizer checks run (``BLOCKSHARD_OPTIMIZER_CHECKS``, 1 by default)."""
    raw = os.environ.get(CHECKS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise OptimizerSetupError(
            f"environment variable {CHECKS_ENV}={raw!r} must be 1 (check every optimizer's first step, the default) "
            "or 0 (no check), e.g. unset it"
        )
    return raw != "0"


def strict() -> bool:
    """``BLOCKSHARD_STRICT=1``: the strict checks too (off by default)."""
    raw = os.environ.get(STRICT_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise OptimizerSetupError(
            f"environment variable {STRICT_ENV}={raw!r} must be 1 (the strict checks too) or 0 (the default), e.g. unset it"
        )
    return raw == "1"


def check_still_one(optimizer: torch.optim.Optimizer) -> None:
    """Point 4: raise if another optimizer took over pieces ``optimizer`` holds and it steps still."""
    found = _overlaps.get(optimizer)
    if found is not None:
        other, name = found
        raise OptimizerSetupError(
            f"{type(optimizer).__name__} and {other} both step parameter {name!r} (and any others they share): each "
            "step would update it twice, where one process steps it once per optimizer you meant for it. Fix: give "
            "every parameter to one optimizer (build the second over the parameters the first leaves out; "
            "blockshard.param_groups_by(model, ...) splits a model by name or global shape)"
        )


def _note_overlaps(optimizer: torch.optim.Optimizer, pieces: Sequence[HeldPiece]) -> None:
    """Point 4: note the optimizers that stepped a piece of ``pieces`` first (named by the first
    shared parameter in order, empty pieces included, so every rank names the same)."""
    for piece in pieces:
        p = piece.sp.sharded
        ref = getattr(p, _STEPPED_BY, None)
        first = ref() if isinstance(ref, weakref.ref) else None
        if first is None:
            setattr(p, _STEPPED_BY, weakref.ref(optimizer))
        elif first is not optimizer and first not in _overlaps:
            _overlaps[first] = (type(optimizer).__name__, piece.name)


def _elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Not an optimizer of whole units (torch's or blockshard's Muon, BlockedShampoo, an
    owner-compute wrapper): its param_groups may follow a choice by ndim (point 2)."""
    return type(optimizer).__name__ not in ("Muon", "BlockedShampoo", "OwnerComputeOptimizer")


def _roots(pieces: Sequence[HeldPiece]) -> list[Any]:
    """The root contexts of ``pieces`` (those whose root ran a forward), once each."""
    out: dict[int, Any] = {}
    for piece in pieces:
        root = None if piece.buffers.root is None else piece.buffers.root()
        if root is not None:
            out.setdefault(id(root), root)
    return list(out.values())


def check_first_step(optimizer: torch.optim.Optimizer) -> None:
    """[Note: first-step optimizer checks] at ``optimizer``'s first step: points 2-4 on this rank's
    pieces (raised here, before the step), and the optimizer's param_groups noted on the roots for
    point 1 (compared across ranks at the next end-of-step check: :func:`compare_across_ranks`)."""
    if not checks_on():
        return
    pieces = list(held_pieces(optimizer))
    if not pieces:
        return
    _note_overlaps(optimizer, pieces)
    what, elementwise = type(optimizer).__name__, _elementwise(optimizer)
    rows = {
        h.name: _Row(True, h.hyper_crc, h.sp.sharded.dim(), len(h.sp.shape), h.kinds(optimizer), h.sp.local_numel)
        for h in pieces
        if h.sp.local_numel and h.sp.requires_grad
    }
    local = [(rows, {h.hyper_crc: h.hyper for h in pieces})]
    by_ndim = _chosen_by_piece_ndim(local) if elementwise else []
    if by_ndim:
        raise OptimizerSetupError(_split_message(what, [], {}, by_ndim))
    _check_kinds(what, rows, pieces[0].buffers.rank)
    for root in _roots(pieces):
        classes: dict[int, set[int]] = root.optimizer_classes
        for h in pieces:
            c = hyper_crc(f"{what}: {h.hyper}")
            classes.setdefault(id(h.sp.sharded), set()).add(c)
            root.optimizer_texts[c] = (f"{what} ({h.hyper})", elementwise)


def compare_across_ranks(root: Any, pg: dist.ProcessGroup) -> None:
    """Point 1 (and point 2 across optimizers), once per root, at the end-of-step check after the
    first step in which some rank's optimizer stepped ``root``'s pieces (every rank knows that step
    from the check's all-reduce, so every rank calls this there): every rank raises the same
    :class:`OptimizerSetupError` where the ranks would step one parameter's pieces differently."""
    rows: dict[str, _Row] = {}
    for st in root.states:
        for b in st.param_buffers:
            if b.layout is None or not b.trainable:
                continue
            for sp in b.params:
                if sp.requires_grad:
                    found = sorted(root.optimizer_classes.get(id(sp.sharded), ()))
                    name = f"{b.path}.{sp.fqn}" if b.path else sp.fqn
                    rows[name] = _Row(
                        sp.local_numel > 0, 0, sp.sharded.dim(), len(sp.shape), (None, None), 0, tuple(found)
                    )
    texts = dict(root.optimizer_texts)
    everyone: list[Any] = [(rows, texts)]
    if pg.size() > 1:
        agree(pg, "the end-of-step comparison of the optimizers' param_groups (blockshard's optimizer checks)")
        everyone = [None] * pg.size()
        dist.all_gather_object(everyone, (rows, texts), group=pg)
    _judge_across(everyone)


def _judge_across(everyone: list[tuple[dict[str, _Row], dict[int, tuple[str, bool]]]]) -> None:
    """Every rank sees the same rows, so every rank raises the same error (or none)."""
    texts = {k: v for _, t in everyone for k, v in t.items()}
    names = list(dict.fromkeys(n for rows, _ in everyone for n in rows))
    split: list[tuple[str, dict[int, tuple[int, ...]]]] = []
    for name in names:
        said = {r: rows[name].classes for r, (rows, _) in enumerate(everyone) if name in rows and rows[name].holds}
        if len(set(said.values())) > 1:
            split.append((name, said))
    # point 2 across optimizers: rows stepped by element-wise optimizers only, each set of classes a class
    ndim_rows: list[tuple[dict[str, _Row], Any]] = []
    for rows, _ in everyone:
        kept = {}
        for n, r in rows.items():
            if r.classes and all(texts.get(c, ("", False))[1] for c in r.classes):
                kept[n] = _Row(r.holds, hyper_crc(repr(r.classes)), r.piece_ndim, r.global_ndim, (None, None), 0)
        ndim_rows.append((kept, None))
    by_ndim = _chosen_by_piece_ndim(ndim_rows)
    if split or by_ndim:
        shown = {k: v[0] for k, v in texts.items()}
        raise OptimizerSetupError(_split_message("The optimizers", split, shown, by_ndim, across=True))
    held = [(n, r) for rows, _ in everyone for n, r in rows.items() if r.holds]
    stepped = {c for _, r in held for c in r.classes}
    idle = [text for c, (text, elementwise) in texts.items() if not elementwise and c not in stepped]
    if idle:  # a whole-matrix optimizer that matched nothing (a Muon selected by the pieces' shape, say)
        raise OptimizerSetupError(
            f"{idle[0]} holds no element of any parameter on any rank: it steps nothing (on one process it would "
            "step the matrices it was meant for). Fix: choose its parameters by name or global shape, e.g. "
            "blockshard.optim.muon_param_groups(model) after the last fully_shard, on every rank"
        )
    if strict():
        none = sorted({n for n, r in held if not r.classes} - {n for n, r in held if r.classes})
        if none:
            raise OptimizerSetupError(
                f"no optimizer steps the trainable parameter {none[0]!r}"
                + (f" (and {len(none) - 1} more)" if len(none) > 1 else "")
                + f" ({STRICT_ENV}=1): its gradients are reduced every step and never used. Fix: give it to an "
                "optimizer, or freeze it (p.requires_grad_(False) before fully_shard)"
            )


def _chosen_by_piece_ndim(everyone: Iterable[tuple[dict[str, _Row], Any]]) -> list[str]:
    """Point 2: parameters whose param_group follows their pieces' ndim where one process's would
    follow the tensors' (an empty list where that is not the pattern)."""
    rows = [(n, r) for rs, _ in everyone for n, r in rs.items() if r.holds]
    by_piece: dict[int, set[int]] = {}
    by_global: dict[int, set[int]] = {}
    for _, r in rows:
        by_piece.setdefault(r.piece_ndim, set()).add(r.hyper)
        by_global.setdefault(r.global_ndim, set()).add(r.hyper)
    if len({r.hyper for _, r in rows}) < 2 or any(len(s) > 1 for s in by_piece.values()):  # one class, or not by ndim
        return []
    if all(len(s) == 1 for s in by_global.values()):
        return []
    return list(dict.fromkeys(n for n, r in rows if r.piece_ndim != r.global_ndim))


_RECIPE = (
    "choose param_groups by name or by the global shape: blockshard.global_shape(p) (or p.global_shape) gives a "
    "piece's tensor shape, and blockshard.param_groups_by(model, key, options) builds the param_groups, e.g. "
    "param_groups_by(model, lambda name, shape: 'decay' if len(shape) >= 2 else 'no_decay', "
    "{'decay': {'weight_decay': 0.1}, 'no_decay': {'weight_decay': 0.0}})"
)


def _split_message(
    what: str,
    split: list[tuple[str, dict[int, Any]]],
    texts: dict[int, str],
    by_ndim: list[str],
    *,
    across: bool = False,
) -> str:
    owner = f"{what}'" if across else f"{what}'s"  # "the optimizers'", "AdamW's"
    if by_ndim:
        shown = ", ".join(repr(n) for n in by_ndim[:_SHOWN])
        shown += f" and {len(by_ndim) - _SHOWN} more" if len(by_ndim) > _SHOWN else ""
        head = (
            f"{owner} param_groups follow the ndim of this rank's pieces, not of the parameters: {shown} are "
            "matrices whose pieces are flat (or the reverse) and land in another param_group than on one process "
            "(a choice by p.ndim / p.dim() on sharded parameters, as nanoGPT-style weight decay does)."
        )
    else:
        head = f"{what} would step the pieces of one parameter differently on different ranks."
    details = []
    for name, said in split[:_SHOWN]:
        parts = [f"rank {r}: {_where(c, texts)}" for r, c in said.items()]
        details.append(f"{name!r}: " + "; ".join(parts))
    more = f" ({len(split) - _SHOWN} more parameters)" if len(split) > _SHOWN else ""
    tail = (" " + " | ".join(details) + more + ".") if details else ""
    when = (
        " (Compared at the end of the first backward after the first optimizer step: that step already ran "
        "with these param_groups; restart from the last checkpoint after the fix.)"
        if across
        else ""
    )
    fix = (
        f" Fix: {_RECIPE}; build every rank's optimizer over every rank's pieces (empty ones included) with the same "
        f"selection (a choice by name that only looks like one by ndim: {CHECKS_ENV}=0 turns the checks off)"
    )
    return head + tail + when + fix


def _where(classes: Any, texts: dict[int, str]) -> str:
    if isinstance(classes, tuple):
        return " and ".join(f"in {texts.get(c, '?')}" for c in classes) if classes else "in no optimizer"
    return "not in this optimizer" if classes == -1 else f"({texts.get(classes, '?')})"


def _check_kinds(what: str, rows: dict[str, _Row], rank: int) -> None:
    """Point 3, named by the first of this rank's pieces whose state kind differs from one process's."""
    for name, row in rows.items():
        piece, whole = row.kinds
        if piece is None or whole is None or piece == whole:
            continue
        smallest = min((x.numel for x in rows.values() if x.kinds[0] != x.kinds[1] and x.kinds[0]), default=row.numel)
        raise OptimizerSetupError(
            f"{what} would keep {piece} state for rank {rank}'s piece of {name!r} ({row.numel} elements) where one "
            f"process keeps {whole} state for the whole tensor: a quantizing optimizer chooses its state by the size "
            "of the tensor it is given (bitsandbytes: fp32 below min_8bit_size; torchao: quantized from 4096 "
            "elements and on a multiple of block_size). Fix: shard with the optimizer's semantics "
            "(fully_shard(..., semantics='bnb8bit' / 'ao8bit' / 'ao4bit'), or "
            "blockshard.optim.semantics_for_optimizer(optimizer)): no piece of a large tensor falls below 4096 "
            f"elements; or (bitsandbytes) pass min_8bit_size <= {smallest} on every rank and in the one-process run"
        )
