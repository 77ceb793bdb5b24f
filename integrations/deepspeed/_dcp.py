"""DeepSpeed ZeRO-1/2/3 checkpoints to and from DCP checkpoints of torch's ``get_state_dict`` layout.

[Note: DeepSpeed to DCP]
``engine.save_checkpoint(dir)`` at ZeRO-1/2 writes, under ``dir/<tag>/``, the module's state dict
(``mp_rank_00_model_states.pt``: every parameter whole, in the compute dtype) and one file per
data-parallel rank (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``): that rank's fp32 partition of
each ``param_group``'s flat buffer and its inner optimizer's ``state_dict()``. :func:`export_dcp`
reads them in one process and writes what torch's ``get_state_dict(model, optimizer)`` gives for the
same model, as ``{"model": ..., "optim": ...}``: the parameters by name (the fp32 masters where
DeepSpeed keeps them, so a bf16 run continues from its masters), the optimizer state by parameter
name, its ``param_groups`` by names. Any engine that loads a DCP checkpoint with ``dcp.load`` +
``set_state_dict`` (``blockshard.fully_shard``, stock FSDP2, one process) resumes from it at any
world size.

Where each parameter's values are:
  * stock DeepSpeed: the flat buffer is the ranks' partitions one after the other, and each
    rank's ``param_slice_mappings`` names the run of its partition each parameter holds; a
    parameter is its runs in rank order. The inner optimizer's state is one flat tensor per group,
    cut the same way;
  * with blockshard's hook ([Note: the hook] in _hook.py): the checkpoint's ``blockshard_layout``
    gives each parameter's start in the flat buffer and the segment per rank; the inner optimizer
    holds one view per (parameter, rank) piece, in the layout's order, so its state is per piece.
Only element-wise state converts this way (tensors with one value per element: AdamW's moments,
SGD's momentum; scalars such as ``step``): anything else (bitsandbytes' 8-bit blocks, Muon's whole
matrices on one owner) raises :class:`~blockshard.runtime.CheckpointError` naming the parameter and
the key. A checkpoint with tensor or pipeline parallelism, ZeRO-3, or files missing raises too.

[Note: DCP into DeepSpeed]
:func:`import_dcp` goes the other way, into a live ZeRO-1/2 engine (stock or hooked, any W): every
rank reads the whole checkpoint (ZeRO-1/2 keeps every parameter whole on every rank anyway),
copies the parameters into the module, and cuts the fp32 masters and the optimizer state into its
own partition: parameter ``j`` of ``param_group`` ``i`` starts at ``round_robin_bit16_offsets[i][j]``
of the group's flat buffer (the hook sets these to its layout's starts), rank ``r`` holds
``[r * P, (r + 1) * P)`` with ``P = partition_size[i]``. The inner optimizer's state is set per
tensor it steps: the one flat partition (stock; a scalar such as ``step`` must then agree across
the group's parameters) or each parameter piece's view (the hook). Its hyperparameters stay the
engine's (DeepSpeed sets them from its config and scheduler).

Into a ZeRO-3 engine, each parameter ``p`` is partitioned on its own: rank ``r`` of its group holds
``[r * P, (r + 1) * P)`` of the flattened parameter, ``P = p.partition_numel()``, in ``p.ds_tensor``
(the compute dtype; a persistent parameter also keeps its gathered tensor, written whole), and each
sub-group's flat fp32 master holds its parameters' partitions in turn. The state goes to the
sub-group's flat partition (stock) or, under the hook's owner-compute, to each run this rank owns
([Note: ZeRO-3 owner-compute] in _stage3.py), cut from the whole tensors by element. Only state with
one floating-point value per element, or a scalar, is cut; anything else raises naming the
parameter and the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockshard._errors import CheckpointError

from ._hook import LAYOUT_KEY
from ._stage3 import OWNER_PLAN_KEY

__all__ = [
    "ExportSummary",
    "describe_deepspeed_checkpoint",
    "export_dcp",
    "import_dcp",
    "read_deepspeed_checkpoint",
    "read_zero3_weights",
]

_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL_FILE = "mp_rank_00_model_states.pt"
_Z3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")  # ZeRO-3: one per rank


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_dcp` wrote (``path``: the DCP directory; :func:`read_deepspeed_checkpoint`:
    the DeepSpeed tag directory read)."""

    path: str
    world_size: int  # the data-parallel ranks that saved the checkpoint
    zero_stage: int
    hooked: bool  # saved with blockshard's hook
    parameters: int
    state_keys: tuple[str, ...]  # the optimizer's per-parameter state keys


def _error(where: Path, what: str, fix: str) -> CheckpointError:
    return CheckpointError(f"DeepSpeed checkpoint {where}: {what}. Fix: {fix}")


def _tag_dir(checkpoint_dir: Path, tag: str | None) -> Path:
    if tag is None:
        latest = checkpoint_dir / "latest"
        if not latest.is_file():
            raise _error(checkpoint_dir, "no tag given and no 'latest' file", "pass tag=<the tag save_checkpoint used>")
        tag = latest.read_text().strip()
    where = checkpoint_dir / tag
    if not (where / _MODEL_FILE).is_file() and not _is_zero3(where):
        raise _error(where, f"{_MODEL_FILE} is missing", "pass the directory and tag engine.save_checkpoint wrote")
    return where


def _is_zero3(where: Path) -> bool:
    return where.is_dir() and any(_Z3_MODEL_FILE.match(f) for f in os.listdir(where))


def read_zero3_weights(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO-3 checkpoint (stock or with blockshard's hook), whole, by
    parameter name: each rank's flat partition of a sub-group holds ``ceil(numel / W)`` elements of
    every parameter of the sub-group in order (``param_shapes``), the last ranks' ending in padding."""
    p = Path(checkpoint_dir)
    where = p if _is_zero3(p) else _tag_dir(p, tag)
    if not _is_zero3(where):
        raise _error(where, "not a ZeRO-3 checkpoint (no zero_pp_rank_*_model_states.pt)", "pass a ZeRO-3 save")
    model_states = _load(where / _z3_name(0, "model"))
    files = _rank_files(where)
    W = len(files)
    flats = [_load(f)["optimizer_state_dict"]["fp32_flat_groups"] for _, f in files]
    out: dict[str, torch.Tensor] = {}
    if len(model_states["param_shapes"]) != len(flats[0]):
        raise _error(where, "sub-groups that split a param_group (zero_optimization.sub_group_size)", "not done")
    for i, shapes in enumerate(model_states["param_shapes"]):
        off = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            P = -(-n // W) if n else 0
            whole = torch.cat([flats[r][i][off : off + P] for r in range(W)])[:n]
            out[name] = whole.reshape(shape).clone()
            off += P
        if off != flats[0][i].numel():
            raise _error(
                where, f"sub-group {i} holds {flats[0][i].numel()} elements per rank, its parameters {off}", "not done"
            )
    return out


def _z3_name(rank: int, kind: str) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"


def _rank_files(where: Path) -> list[tuple[int, Path]]:
    return sorted(
        ((int(m.group(1)), where / f) for f in os.listdir(where) if (m := _OPTIM_FILE.match(f))), key=lambda t: t[0]
    )


def _load(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)  # DeepSpeed pickles its enums
    return out


def read_deepspeed_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], ExportSummary]:
    """The model state (parameters by name, buffers) and the optimizer state of a ZeRO-1/2
    checkpoint in torch's ``get_state_dict`` layout ([Note: DeepSpeed to DCP]), and what it found."""
    where = _tag_dir(Path(checkpoint_dir), tag)
    zero3 = _is_zero3(where)
    model_states = _load(where / (_z3_name(0, "model") if zero3 else _MODEL_FILE))
    if model_states.get("mp_world_size", 1) != 1:
        raise _error(
            where,
            f"saved with tensor / pipeline parallelism (mp_world_size={model_states.get('mp_world_size')})",
            "export a checkpoint of data parallelism only (ZeRO-1/2 over every rank)",
        )
    files = sorted(
        ((int(m.group(1)), where / f) for f in os.listdir(where) if (m := _OPTIM_FILE.match(f))), key=lambda t: t[0]
    )
    if not files or [r for r, _ in files] != list(range(len(files))):
        raise _error(
            where,
            f"optimizer files of ranks {[r for r, _ in files]} (expected 0..W-1)",
            "copy every rank's zero_pp_rank_*_optim_states.pt",
        )
    ranks = [_load(f)["optimizer_state_dict"] for _, f in files]
    W = len(ranks)
    stage = int(getattr(ranks[0].get("zero_stage"), "value", ranks[0].get("zero_stage", 0)))
    if stage not in (1, 2, 3):
        raise _error(where, f"zero_stage {stage}", "export a ZeRO-1, ZeRO-2 or ZeRO-3 checkpoint")
    hooked = LAYOUT_KEY in ranks[0] or OWNER_PLAN_KEY in ranks[0]
    names_per_group: list[list[str]] = [list(g) for g in model_states["param_shapes"]]
    shapes = {n: torch.Size(s) for g in model_states["param_shapes"] for n, s in g.items()}
    if stage == 3:
        params, state, groups = _zero3(where, ranks, names_per_group, shapes)
    elif hooked:
        params, state, groups = _hooked(where, ranks, names_per_group, shapes)
    else:
        params, state, groups = _stock(where, ranks, names_per_group, shapes)
    model_sd: dict[str, torch.Tensor] = {}
    for name, value in model_states["module"].items():
        model_sd[name] = params.get(name, value)
    for alias, target in (model_states.get("shared_params") or {}).items():  # tied weights: one tensor
        if target in model_sd:
            model_sd[alias] = model_sd[target]
    optim_sd = {"state": state, "param_groups": groups}
    keys = tuple(sorted({k for s in state.values() for k in s}))
    summary = ExportSummary(str(where), W, stage, hooked, len(params), keys)
    return model_sd, optim_sd, summary


def _tensors(prefix: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(f"{prefix}.{k}" if prefix else str(k), v)
    elif isinstance(value, (list, tuple)):
        for k, v in enumerate(value):
            yield from _tensors(f"{prefix}.{k}", v)


def describe_deepspeed_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> dict[str, Any]:
    """What a ZeRO-1/2 checkpoint holds, as ``blockshard.runtime.describe_checkpoint`` says it of a
    DCP checkpoint (``blockshard inspect`` renders both): the module's tensors whole, and per rank
    its fp32 partitions and its inner optimizer's state tensors as saved (any optimizer)."""
    p = Path(path)
    where = _tag_dir(p.parent, p.name) if (p / _MODEL_FILE).is_file() or _is_zero3(p) else _tag_dir(p, tag)
    if _is_zero3(where):
        return _describe_zero3(where)
    model_states = _load(where / _MODEL_FILE)
    files = sorted(
        ((int(m.group(1)), where / f) for f in os.listdir(where) if (m := _OPTIM_FILE.match(f))), key=lambda t: t[0]
    )
    tensors = [("model." + n, t) for n, t in _tensors("", model_states["module"])]
    stage, hooked = 0, False
    for r, f in files:
        osd = _load(f)["optimizer_state_dict"]
        stage = int(getattr(osd.get("zero_stage"), "value", osd.get("zero_stage", 0)))
        hooked = LAYOUT_KEY in osd
        for i, part in enumerate(osd["single_partition_of_fp32_groups"]):
            tensors.append((f"rank{r}.fp32_partition.{i}", part))
        tensors += [(f"rank{r}.optim.{n}", t) for n, t in _tensors("", osd.get("base_optimizer_state", {}))]
    ranks = [r for r, _ in files]
    problems = [] if ranks == list(range(len(ranks))) and ranks else [f"optimizer files of ranks {ranks}"]
    saved_by = f"DeepSpeed ZeRO-{stage}" + (" with blockshard's hook" if hooked else "")
    return _description(where, tensors, len(files), saved_by, model_states.get("ds_version"), problems)


def _describe_zero3(where: Path) -> dict[str, Any]:
    """:func:`describe_deepspeed_checkpoint` of a ZeRO-3 save: the fp32 master weights whole
    (:func:`read_zero3_weights`), and per rank its fp32 partitions and its inner optimizer's state
    tensors (under blockshard's owner-compute: the state of the runs the rank owns)."""
    files = _rank_files(where)
    tensors = [("model." + n, t) for n, t in read_zero3_weights(where).items()]
    hooked, plan = False, None
    for r, f in files:
        osd = _load(f)["optimizer_state_dict"]
        plan = osd.get(OWNER_PLAN_KEY, plan)
        hooked = hooked or plan is not None
        for i, part in enumerate(osd["fp32_flat_groups"]):
            tensors.append((f"rank{r}.fp32_partition.{i}", part))
        tensors += [(f"rank{r}.optim.{n}", t) for n, t in _tensors("", osd.get("optimizer_state_dict", {}))]
    ranks = [r for r, _ in files]
    models = sorted(int(m.group(1)) for f in os.listdir(where) if (m := _Z3_MODEL_FILE.match(f)))
    problems = (
        []
        if ranks == list(range(len(ranks))) and ranks and models == ranks
        else [f"optimizer files of ranks {ranks}, model files of ranks {models}"]
    )
    if plan is not None and plan.get("world_size") != len(files):
        problems.append(f"owner plan of W = {plan.get('world_size')}, files of {len(files)} ranks")
    version = _load(where / _z3_name(0, "model")).get("ds_version")
    saved_by = "DeepSpeed ZeRO-3" + (" with blockshard's hook (owner-compute)" if hooked else "")
    return _description(where, tensors, len(files), saved_by, version, problems)


def _description(
    where: Path,
    tensors: list[tuple[str, torch.Tensor]],
    ranks: int,
    saved_by: str,
    ds_version: str | None,
    problems: list[str],
) -> dict[str, Any]:
    """What ``blockshard inspect`` renders of a DeepSpeed save (``describe_checkpoint``'s keys)."""
    return {
        "path": str(where),
        "tensors": [
            {
                "name": n,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "bytes": t.numel() * t.element_size(),
                "chunks": 1,
            }
            for n, t in tensors
        ],
        "tensor_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        "file_bytes": sum(f.stat().st_size for f in where.iterdir() if f.is_file()),
        "ranks_that_wrote": ranks,
        "saved_by": saved_by,
        "blockshard_version": f"(DeepSpeed {ds_version or 'of unknown version'})",
        "world_size": ranks,
        "complete": not problems,
        "problems": problems,
        "objects": [],
        "optimizers": [],
    }


def _state_of(where: Path, rank: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    base = rank["base_optimizer_state"]
    if not isinstance(base, dict) or "state" not in base or "param_groups" not in base:
        raise _error(
            where, "the inner optimizer's state is not a torch optimizer state_dict", "save with a torch optimizer"
        )
    return base["state"], base["param_groups"]


def _group_settings(group: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"} | {"params": list(names)}


def _elementwise(where: Path, name: str, key: str, value: object, numel: int) -> bool:
    """True for a tensor with one value per element of the run, False for a scalar; else raise."""
    if isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
        return False
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == numel:
        return True
    what = (
        f"is {value.dtype} with {value.numel()} values for a run of {numel} elements"
        if isinstance(value, torch.Tensor)
        else f"is a {type(value).__name__}"
    )
    raise _error(
        where,
        f"optimizer state {key!r} of parameter {name!r} {what} (not element-wise float state: 8-bit blocks, "
        "a whole-matrix optimizer's state on its owner)",
        "export only element-wise optimizer state (AdamW, SGD, Adam); for 8-bit or whole-matrix state, move "
        "with DeepSpeed's own checkpoints at the same world size",
    )


def _assemble(runs: list[tuple[int, torch.Tensor]], numel: int) -> torch.Tensor:
    """A parameter's flat values from its (offset, values) runs."""
    out = torch.empty(numel, dtype=runs[0][1].dtype)
    covered = 0
    for off, values in runs:
        out[off : off + values.numel()] = values.reshape(-1)
        covered += values.numel()
    if covered != numel:
        raise AssertionError(f"runs cover {covered} of {numel} elements")
    return out


def _collect(
    where: Path, pieces: Iterator[tuple[str, int, int, torch.Tensor, dict[str, Any]]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Parameters and element-wise state from ``(name, offset, numel, fp32 run, state of the run)``."""
    runs: dict[str, list[tuple[int, torch.Tensor]]] = {}
    state_runs: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, off, numel, values, st in pieces:
        runs.setdefault(name, []).append((off, values))
        for key, value in st.items():
            if _elementwise(where, name, key, value, numel):
                state_runs.setdefault(name, {}).setdefault(key, []).append((off, value))
            else:
                scalars.setdefault(name, {})[key] = value
    params = {n: _assemble(r, shapes[n].numel()).view(shapes[n]) for n, r in runs.items()}
    state: dict[str, dict[str, Any]] = {}
    for name in params:
        entry = dict(scalars.get(name, {}))
        for key, key_runs in state_runs.get(name, {}).items():
            entry[key] = _assemble(key_runs, shapes[name].numel()).view(shapes[name])
        if entry:
            state[name] = entry
    return params, state


def _stock(
    where: Path, ranks: list[dict[str, Any]], names: list[list[str]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Stock ZeRO-1/2: flat partitions cut by each rank's ``param_slice_mappings``."""

    def pieces() -> Iterator[tuple[str, int, int, torch.Tensor, dict[str, Any]]]:
        done: dict[str, int] = {}
        for rank in ranks:
            mappings = rank.get("param_slice_mappings")
            if mappings is None:
                raise _error(where, "no param_slice_mappings (DeepSpeed older than 0.9)", "save with DeepSpeed >= 0.9")
            state, _ = _state_of(where, rank)
            for i, (fp32, mapping) in enumerate(zip(rank["single_partition_of_fp32_groups"], mappings, strict=True)):
                group_state = state.get(i, {})
                for name, frag in mapping.items():  # rank order, partition order: a parameter's runs in order
                    lo, n = frag.start, frag.numel
                    st = {
                        k: (v.reshape(-1)[lo : lo + n] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                        for k, v in group_state.items()
                    }
                    yield name, done.get(name, 0), n, fp32[lo : lo + n], st
                    done[name] = done.get(name, 0) + n

    params, state = _collect(where, pieces(), shapes)
    _, groups = _state_of(where, ranks[0])
    return params, state, [_group_settings(g, names[i]) for i, g in enumerate(groups)]


def _hooked(
    where: Path, ranks: list[dict[str, Any]], names: list[list[str]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """blockshard's hook: per-piece views laid out by the checkpoint's ``blockshard_layout``."""
    layouts = ranks[0][LAYOUT_KEY]["layout"]

    def pieces() -> Iterator[tuple[str, int, int, torch.Tensor, dict[str, Any]]]:
        for r, rank in enumerate(ranks):
            if rank[LAYOUT_KEY]["layout"] != layouts:
                raise _error(where, f"rank {r} saved another layout than rank 0", "export one run's checkpoint")
            state, groups = _state_of(where, rank)
            for i, (fp32, layout) in enumerate(zip(rank["single_partition_of_fp32_groups"], layouts, strict=True)):
                seg = layout["segment"]
                keys = iter(groups[i]["params"])
                for name, start, numel in zip(layout["names"], layout["starts"], layout["numels"], strict=True):
                    lo, hi = max(start, r * seg), min(start + numel, (r + 1) * seg)
                    if hi <= lo:
                        continue
                    st = state.get(next(keys), {})  # the views are the pieces in layout order
                    yield name, lo - start, hi - lo, fp32[lo - r * seg : hi - r * seg], st

    params, state = _collect(where, pieces(), shapes)
    _, groups = _state_of(where, ranks[0])
    return params, state, [_group_settings(g, names[i]) for i, g in enumerate(groups)]


def _zero3(
    where: Path, ranks: list[dict[str, Any]], names: list[list[str]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """ZeRO-3: stock, each rank's flat fp32 partition of a sub-group (a ``param_group``) holds
    ``ceil(numel / W)`` elements of each parameter in order, its state keyed by the sub-group; with
    blockshard's owner-compute, the state of each run on its owner, in plan order
    ([Note: ZeRO-3 owner-compute])."""
    W = len(ranks)
    masters = read_zero3_weights(where)
    plan = ranks[0].get(OWNER_PLAN_KEY)

    def inner(rank: dict[str, Any]) -> dict[str, Any]:
        sd = rank["optimizer_state_dict"]
        if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
            raise _error(
                where, "the inner optimizer's state is not a torch optimizer state_dict", "save with a torch optimizer"
            )
        return sd

    def pieces() -> Iterator[tuple[str, int, int, torch.Tensor, dict[str, Any]]]:
        if plan is not None:
            for r, rank in enumerate(ranks):
                sd = inner(rank)
                order = iter(i for g in sd["param_groups"] for i in g["params"])
                for name, _, runs in plan["params"]:
                    for a, b, owner in runs:
                        if owner == r:
                            yield name, a, b - a, masters[name].reshape(-1)[a:b], sd["state"].get(next(order), {})
            return
        for r, rank in enumerate(ranks):
            sd = inner(rank)
            for i, group_names in enumerate(names):
                state, off = sd["state"].get(i, {}), 0
                for name in group_names:
                    n = shapes[name].numel()
                    P = -(-n // W) if n else 0
                    lo, hi = min(r * P, n), min((r + 1) * P, n)
                    st = {
                        k: (v.reshape(-1)[off : off + hi - lo] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                        for k, v in state.items()
                    }
                    if hi > lo:
                        yield name, lo, hi - lo, masters[name].reshape(-1)[lo:hi], st
                    off += P

    params, state = _collect(where, pieces(), shapes)
    groups = inner(ranks[0])["param_groups"]
    return params, state, [_group_settings(g, names[i]) for i, g in enumerate(groups)]


def export_dcp(
    checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, tag: str | None = None
) -> ExportSummary:
    """Write the ZeRO-1/2 checkpoint ``checkpoint_dir`` (``tag``, default: its ``latest``) as a DCP
    checkpoint at ``out`` holding ``{"model": ..., "optim": ...}`` in torch's ``get_state_dict``
    layout ([Note: DeepSpeed to DCP]); one process, no process group. Load it with
    ``dcp.load({"model": msd, "optim": osd}, checkpoint_id=out)`` then ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd, summary = read_deepspeed_checkpoint(checkpoint_dir, tag)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.fspath(out), no_dist=True)
    return dataclasses.replace(summary, path=os.fspath(out))


def _template(path: str, names: list[str]) -> dict[str, Any]:
    """Empty tensors for every ``model.*`` and ``optim.state.*`` entry of the checkpoint at ``path``
    (its metadata's sizes and dtypes), for ``dcp.load`` to fill."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(path).read_metadata().state_dict_metadata
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, meta in entries.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        empty = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        if key.startswith("model."):
            model[key.removeprefix("model.")] = empty
        elif key.startswith("optim.state."):
            rest = key.removeprefix("optim.state.")
            name = max((n for n in names if rest.startswith(n + ".")), key=len, default=None)
            if name is not None:
                state.setdefault(name, {})[rest.removeprefix(name + ".")] = empty
    return {"model": model, "optim": {"state": state}}


def import_dcp(engine: Any, checkpoint: str | os.PathLike[str], *, optimizer_state: bool = True) -> None:
    """Load a DCP checkpoint in torch's ``get_state_dict`` layout (``{"model": ..., "optim": ...}``,
    as :func:`export_dcp`, ``blockshard.fully_shard`` or stock FSDP2 write it) into the DeepSpeed
    ``engine`` ([Note: DCP into DeepSpeed]; ZeRO-1/2 or ZeRO-3, stock or with blockshard's hook, any
    world size): the module's parameters and buffers, the fp32 masters and, with
    ``optimizer_state``, the inner optimizer's element-wise state. Every rank calls it, between steps."""
    import torch.distributed.checkpoint as dcp
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    path, where = os.fspath(checkpoint), Path(checkpoint)
    opt = getattr(engine, "optimizer", None)
    if not isinstance(opt, DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3):
        raise _error(
            where,
            f"the engine's optimizer is a {type(opt).__name__}, not ZeRO's DeepSpeedZeroOptimizer (stage 1/2) "
            "or DeepSpeedZeroOptimizer_Stage3",
            "import into a ZeRO-1, ZeRO-2 or ZeRO-3 engine (BF16_Optimizer is not supported here)",
        )
    module = engine.module
    names = [n for n, _ in module.named_parameters()]
    sd = _template(path, names)
    wanted = dict(module.state_dict(keep_vars=True))
    missing = sorted(set(wanted) - set(sd["model"]))
    if missing:
        raise _error(where, f"no values for {missing[:4]}", "import a checkpoint of this model (model.* keys)")
    sd["model"] = {k: v for k, v in sd["model"].items() if k in wanted}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    full, state = sd["model"], sd["optim"]["state"]
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        _import_zero3(where, module, opt, full, state if optimizer_state else None)
        return
    with torch.no_grad():
        for name, value in wanted.items():
            value.copy_(full[name])  # the module's own tensors (DeepSpeed's bit16 views among them)
        inner = opt.optimizer
        for i, (params, offsets) in enumerate(
            zip(opt.round_robin_bit16_groups, opt.round_robin_bit16_offsets, strict=True)
        ):
            rank = torch.distributed.get_rank(group=opt.real_dp_process_group[i])  # this group's partition
            P, part = int(opt.partition_size[i]), opt.single_partition_of_fp32_groups[i]
            lo_rank, runs = rank * P, []
            for p, off in zip(params, offsets, strict=True):
                name = opt.param_names[p]
                lo, hi = max(off, lo_rank), min(off + p.numel(), lo_rank + P)
                if hi > lo:
                    runs.append((name, lo - off, lo - lo_rank, hi - lo))
                    part[lo - lo_rank : hi - lo_rank] = full[name].reshape(-1)[lo - off : hi - off]
            if optimizer_state:
                _set_state(where, opt, inner, i, runs, state, part)


def _import_zero3(
    where: Path,
    module: torch.nn.Module,
    opt: Any,
    full: dict[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]] | None,
) -> None:
    """ZeRO-3 ([Note: DCP into DeepSpeed]): each parameter's partition ``[r * P, (r + 1) * P)``,
    ``P = partition_numel()``, into its 16/32-bit ``ds_tensor`` (and its gathered tensor where
    DeepSpeed keeps one, as for persistent parameters) and into the sub-group's flat fp32 master
    partition; the state per sub-group's flat partition (stock) or per run this rank owns
    (blockshard's owner-compute, [Note: ZeRO-3 owner-compute])."""
    import torch.distributed as dist

    names = {id(p): n for n, p in module.named_parameters()}
    params: dict[str, Any] = dict(module.named_parameters())
    for name, p in params.items():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if tuple(full[name].shape) != shape:
            raise _error(
                where,
                f"parameter {name!r} has shape {tuple(full[name].shape)} in the checkpoint, {shape} in the engine",
                "import a checkpoint of this model",
            )

    def span(p: Any) -> tuple[int, int]:  # this rank's elements of the flattened parameter
        P, n = int(p.partition_numel()), int(p.ds_numel)
        r = dist.get_rank(group=p.ds_process_group)
        return min(r * P, n), min((r + 1) * P, n)

    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name not in params:  # buffers are whole on every rank
                tensor.copy_(full[name])
        for name, p in params.items():  # the 16/32-bit partitions, frozen parameters too
            lo, hi = span(p)
            p.ds_tensor.data.zero_()
            p.ds_tensor.data.narrow(0, 0, hi - lo).copy_(full[name].reshape(-1)[lo:hi])
            if p.data.numel() == p.ds_numel:  # gathered now (a persistent parameter): the same values
                p.data.copy_(full[name].reshape(p.data.shape))
        for i, group in enumerate(opt.fp16_groups):  # the fp32 masters: each partition in turn
            flat, off, pieces = opt.fp32_partitioned_groups_flat[i], 0, []
            for p in group:
                name, (lo, hi), P = names[id(p)], span(p), int(p.partition_numel())
                flat.data.narrow(0, off, P).zero_()
                flat.data.narrow(0, off, hi - lo).copy_(full[name].reshape(-1)[lo:hi])
                pieces.append((name, int(p.ds_numel), lo, off, hi - lo))
                off += P
            if state is None:
                continue
            if getattr(opt, "_bs_owner", False):  # the state of each run this rank owns
                for p, q in zip(group, opt._bs_subgroups[i].params, strict=True):
                    name = names[id(p)]
                    for k, t in q.tensors.items():
                        run = q.runs[k]
                        entry = _elementwise_slices(where, name, state.get(name, {}), q.numel, run.start, run.end)
                        if entry:
                            opt.optimizer.state[t] = {
                                key: v if v.dim() == 0 else v.view(run.shape) for key, v in entry.items()
                            }
                continue
            flat_state: dict[str, torch.Tensor] = {}  # stock: one state for the sub-group's flat partition
            for name, numel, p_off, part_off, n in pieces:
                for key, v in _elementwise_slices(where, name, state.get(name, {}), numel, p_off, p_off + n).items():
                    _merge(where, i, name, key, v, flat_state, flat, part_off)
            if flat_state:
                opt.optimizer.state[flat] = flat_state


def _elementwise_slices(
    where: Path, name: str, state: dict[str, torch.Tensor], numel: int, lo: int, hi: int
) -> dict[str, torch.Tensor]:
    """Elements ``[lo, hi)`` of each of parameter ``name``'s state tensors (scalars whole); refused for
    state that is not one floating-point value per element of the ``numel`` (8-bit blocks,
    preconditioners)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if value.dim() == 0:
            out[key] = value.clone()
            continue
        if not value.is_floating_point() or value.numel() != numel:
            raise _error(
                where,
                f"optimizer state {key!r} of parameter {name!r} is not element-wise (shape {tuple(value.shape)}, "
                f"{value.dtype}, for {numel} elements), so it cannot be cut into DeepSpeed's partitions",
                "import only element-wise optimizer state (AdamW's moments, Muon's momentum), or optimizer_state=False",
            )
        out[key] = value.reshape(-1)[lo:hi].clone()
    return out


def _merge(
    where: Path,
    i: int,
    name: str,
    key: str,
    value: torch.Tensor,
    entry: dict[str, torch.Tensor],
    part: torch.Tensor,
    part_off: int,
) -> None:
    """Parameter ``name``'s piece ``value`` of state ``key`` into the flat partition ``part``'s state
    ``entry`` (stock ZeRO: one state per ``param_group``'s flat partition) at ``part_off``."""
    if value.dim() == 0:
        if key in entry and not torch.equal(entry[key], value):
            raise _error(
                where,
                f"optimizer state {key!r} differs between parameters of param_group {i} "
                f"({name!r}: {value.item()}, another: {entry[key].item()}), and stock ZeRO keeps one per group",
                "import with blockshard's hook (state per parameter), or a checkpoint whose parameters stepped together",
            )
        entry[key] = value
        return
    flat = entry.setdefault(key, torch.zeros_like(part))
    flat[part_off : part_off + value.numel()] = value


def _set_state(
    where: Path,
    opt: Any,
    inner: torch.optim.Optimizer,
    i: int,
    runs: list[tuple[str, int, int, int]],
    state: dict[str, dict[str, torch.Tensor]],
    part: torch.Tensor,
) -> None:
    """The inner optimizer's state of ``param_group`` ``i`` from the whole tensors ``state``."""
    numels = {opt.param_names[p]: p.numel() for p in opt.round_robin_bit16_groups[i]}
    groups = getattr(opt, "_bs_groups", None)
    if groups is not None:  # the hook: one view per piece, in the layout's order
        views = groups[i].views
        if len(views) != len(runs):
            raise AssertionError(f"{len(views)} views for {len(runs)} pieces")
        for v, (name, p_off, _part_off, n) in zip(views, runs, strict=True):
            piece = _elementwise_slices(where, name, state.get(name, {}), numels[name], p_off, p_off + n)
            if piece:
                inner.state[v.tensor] = {k: t if t.dim() == 0 else t.view(v.tensor.shape) for k, t in piece.items()}
        return
    entry: dict[str, torch.Tensor] = {}  # stock: the one flat partition
    for name, p_off, part_off, n in runs:
        for key, value in _elementwise_slices(where, name, state.get(name, {}), numels[name], p_off, p_off + n).items():
            _merge(where, i, name, key, value, entry, part, part_off)
    if entry:
        inner.state[inner.param_groups[i]["params"][0]] = entry
