"""``blockshard.report``: every rank's rows, gathered and joined into one :class:`Report`.

[Note: report collective]
Where the model is sharded over ``W > 1`` ranks the report is a collective: every rank of that
process group calls it. For blockshard's engine the guarded agreement (:func:`agree_on_call`,
[Note: collective headers]) runs first, so a rank that calls it while a peer is in a forward
raises on every rank instead of mispairing; then one ``all_gather_object`` of each rank's rows.
Every rank returns the same report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from blockshard._errors import ReportError
from blockshard.runtime._report._collect import Collected, collect
from blockshard.runtime._report._external import PartitionSource
from blockshard.runtime._report._model import GroupRow, OptimizerRow, ParamRow, Report, StateRow
from blockshard.runtime._report._optim import LocalOptimizers, joined_check, optimizer_rows, state_kind
from blockshard.runtime.core._inspect import agree_on_call, states_under

__all__ = ["report"]


def report(model: nn.Module, optimizers: Sequence[object] | None = None) -> Report:
    """What was sharded and how, what is replicated and why, bytes held per rank against total / W,
    padding, and what each of ``optimizers`` steps (its state tensors' dtypes and bytes; the trainable
    parameters none of them steps). See [Note: run report].

    ``model``: a model sharded by ``blockshard.fully_shard``, by ``blockshard.integrations.fsdp2`` (or
    torch's ``fully_shard``: DTensor parameters), a DeepSpeed engine made by
    ``blockshard.integrations.deepspeed.initialize``, or not sharded at all. A collective where the
    model is sharded over more than one rank: call it on every rank ([Note: report collective]).
    """
    if not isinstance(model, nn.Module):
        raise ReportError(f"report(model={type(model).__name__}): pass the torch.nn.Module you shard (or its engine)")
    opts = list(optimizers) if optimizers is not None else []
    sources = [o for o in opts if isinstance(o, PartitionSource)]
    own = vars(model).get("optimizer")  # a DeepSpeed engine holds its ZeRO optimizer
    if isinstance(own, PartitionSource) and all(own is not s for s in sources):
        sources.append(own)
    if states_under(model):
        agree_on_call(model, "blockshard.report")  # [Note: report collective]
    local = collect(model, sources)
    local_opt = optimizer_rows(model, opts)
    pg = _process_group(local)
    mine = _rows(local, local_opt)
    every: list[Any] = [mine]
    if pg is not None and dist.get_world_size(pg) > 1:
        every = [None] * dist.get_world_size(pg)
        dist.all_gather_object(every, mine, group=pg)
    return _join(every, local, bool(optimizers is not None))


def _process_group(local: Collected) -> dist.ProcessGroup | None:
    pgs = local.process_groups
    if not pgs:
        return None
    sizes = sorted({dist.get_world_size(pg) for pg in pgs})
    if len(sizes) > 1:
        raise ReportError(
            f"the model is sharded over process groups of sizes {sizes} ({', '.join(local.engines)}); the report "
            "gathers per-rank figures over one shard group. Fix: report each part (submodule) on its own"
        )
    return pgs[0]


def _rows(local: Collected, opt: LocalOptimizers) -> dict[str, Any]:
    return {
        "groups": local.groups,
        "params": local.params,
        "optimizers": opt.rows,
        "trainable": opt.trainable,
        "stepped": sorted(opt.stepped),
    }


def _join(every: Sequence[Any], local: Collected, given: bool) -> Report:
    W = len(every)
    groups = [_joined(rows, ("held_bytes", "data_bytes")) for rows in _aligned(every, "groups")]
    params = [_joined(rows, ("held_bytes",)) for rows in _aligned(every, "params")]
    optims = [_joined_optimizer(rows, W) for rows in _aligned(every, "optimizers")]
    stepped = set().union(*(e["stepped"] for e in every))
    trainable = sorted(set().union(*(e["trainable"] for e in every)))
    return Report(
        world_size=W,
        engine="+".join(local.engines) or "none",
        groups=tuple(groups),
        params=tuple(params),
        optimizers=tuple(optims),
        not_stepped=tuple(n for n in trainable if n not in stepped) if given else (),
        optimizers_given=given,
        notes=tuple(local.notes),
    )


def _aligned(every: Sequence[Any], key: str) -> list[list[Any]]:
    """Rows of ``key`` rank by rank: every rank must list the same rows in the same order."""
    first = every[0][key]
    for r, e in enumerate(every):
        if [_name(x) for x in e[key]] != [_name(x) for x in first]:
            raise ReportError(
                f"rank {r} lists other {key} than rank 0 ({[_name(x) for x in e[key]][:4]} against "
                f"{[_name(x) for x in first][:4]}): every rank must call blockshard.report on the same model "
                "and optimizers"
            )
    return [[e[key][i] for e in every] for i in range(len(first))]


def _name(row: GroupRow | ParamRow | OptimizerRow) -> str:
    return row.name if not isinstance(row, OptimizerRow) else f"{row.index}:{row.name}"


def _joined(rows: list[Any], fields: tuple[str, ...]) -> Any:
    return dataclasses.replace(rows[0], **{f: tuple(getattr(r, f)[0] for r in rows) for f in fields})


def _joined_optimizer(rows: list[OptimizerRow], W: int) -> OptimizerRow:
    steps: list[str] = []
    for r in rows:
        steps += [s for s in r.steps if s not in steps]
    keys: list[tuple[str, str]] = []
    by_rank: list[dict[tuple[str, str], StateRow]] = []
    for r in rows:
        mine = {(s.param, s.key): s for s in r.states}
        keys += [k for k in mine if k not in keys]
        by_rank.append(mine)
    states = []
    for k in keys:
        present = [m[k] for m in by_rank if k in m]
        dtypes = sorted({d for s in present for d in s.dtype.split("|")})
        states.append(
            StateRow(
                param=k[0],
                key=k[1],
                dtype="|".join(dtypes),
                bytes=tuple(m[k].bytes[0] if k in m else 0 for m in by_rank),
                kind="|".join(state_kind(d) for d in dtypes),
                as_one_process=joined_check(s.as_one_process for s in present),
                note="" if len(dtypes) == 1 else "the ranks keep this state in different dtypes",
            )
        )
    return dataclasses.replace(rows[0], steps=tuple(steps), states=tuple(states))
