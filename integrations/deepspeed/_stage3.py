"""The ZeRO-3 hook: DeepSpeed keeps its partitions; the optimizer step computes on whole units.

[Note: ZeRO-3 owner-compute]
What stock DeepSpeed 0.19.8 does (``deepspeed/runtime/zero/stage3.py``): every parameter is
partitioned on its own, rank ``r`` holding elements ``[r*P, (r+1)*P)`` of the flattened parameter
with ``P = ceil(numel / W)`` (the last ranks' partitions end in padding). Per sub-group, the fp32
master partitions of its parameters are concatenated, in order, into one flat tensor
(``fp32_partitioned_groups_flat[i]``, each parameter taking ``partition_numel()`` elements), and
``_optimizer_step(i)`` hands the inner optimizer that one flat tensor, its ``.grad`` the averaged
(clipped, unscaled) gradient partition. An element-wise optimizer (AdamW, SGD) computes there what
it computes on one process. One that computes on larger units does not: bitsandbytes' 8-bit state
is quantized in 256-blocks that start wherever the flat tensor starts (and 32-bit state for tensors
below 4096 elements is decided on the flat tensor), torch's ``Muon`` refuses a 1-D tensor.

The hook (:func:`make_stage3`) leaves DeepSpeed's partitions, all-gathers, reduce-scatters,
gradient accumulation, clipping and loss scaling as they are, and replaces only
``_optimizer_step(i)``:

* **Element-wise inner optimizers** (torch's AdamW, Adam, SGD, ... :func:`is_elementwise`): the
  stock step, nothing added.
* **Every other optimizer** (bitsandbytes / torchao 8-bit, ``Muon``, ``BlockedShampoo``, any the
  hook does not know): *owner-compute on runs*. :func:`plan_runs` cuts each parameter into runs the
  optimizer may compute on alone, given the optimizer's block semantics (its
  :class:`~blockshard.semantics.UnitGrid`): a parameter whose grid is whole (a Muon matrix, a tensor
  below 4096 elements for 8-bit state, an optimizer blockshard does not know) is one run, owned by
  the least-loaded rank (largest first); any other is cut at the allowed cuts nearest to DeepSpeed's
  partition boundaries, keeping every run at least ``min_cut`` long (bitsandbytes: multiples of 256,
  runs of at least 4096 elements, so each run gets 8-bit state in blocks that start where one
  process's do), and each run is owned by the rank whose partition holds most of it. One
  ``all_to_all_single`` on the data-parallel group moves every rank's real elements of each run
  (gradient and fp32 master value; padding left out) to the run's owner, which assembles the run in
  a tensor of its own (the parameter's shape, whole rows, or flat: :func:`blockshard._arith.block_shape`)
  kept across steps (the optimizer's state is keyed by it; its storage is freed between steps, so no
  second fp32 copy of the owned elements stays) and runs the unmodified inner optimizer
  on those tensors; a second ``all_to_all_single`` sends each rank its slice of the new values,
  written into the flat master partition. So the optimizer computes on every parameter what it
  computes on one process (Newton-Schulz once per optimizer step on whole matrices; bitsandbytes'
  blocks from each parameter's start; 32-bit state below 4096 elements), and the state of a run
  lives on its owner only.
* **Balance and bytes** (:func:`plan_runs`, :meth:`owner_traffic`): a cut run's owner already holds
  most of it, so only the few elements between a partition boundary and the nearest allowed cut
  move; whole runs move to one rank. The optimizer state per rank is about ``1 / W`` of the total
  where parameters can be cut (every 8-bit tensor of at least 4096 elements), and whole matrices are
  placed largest first.

[Note: ZeRO-3 unused parameters]
A parameter that gets no gradient in a step (a layer a step's forward skips): on one process its
``grad`` is None and torch's / bitsandbytes' optimizers skip it (no weight decay, no moment decay,
no step count). Stock DeepSpeed 0.19.8 ZeRO-3 (``ignore_unused_parameters`` is read by ZeRO-1/2
only) never hears of it: no reduce hook fires, its gradient partition (a slice of
``grad_partitions_flat_buffer``, never cleared between steps) keeps whatever the last step that used
it left (zeros if none did), and the optimizer steps that: the stale gradient again, or zeros (weight
and moment decay); under gradient accumulation a parameter first used in a later micro-batch adds
its gradient to the stale one, and global-norm clipping counts the stale partitions. Under
owner-compute the hook makes this exact ([Note: unused parameters] in _unused.py): per optimizer
step one ``all_reduce`` (MAX) of one flag per parameter tells every rank which parameters no rank
used (a z3 leaf module's zero-filled parameters count as unused), and their run tensors get ``grad =
None`` (the run's elements still travel: the traffic does not depend on the step); after every step
the gradient partitions are zeroed (one memset of this rank's ``numel / W`` elements), so
accumulation and clipping start from zero. With an element-wise optimizer (DeepSpeed's own step over
the flat partition) a parameter cannot be skipped alone: such a step raises on every rank, naming the
parameters, before anything is stepped. ``"unused_parameters": "stock"`` keeps DeepSpeed's update.

Refused with a :class:`DeepSpeedHookError` under owner-compute (checked at ``initialize``, nothing
silently wrong): optimizer offload and NVMe, parameter offload, ZenFlow, MoE, MiCS / hpZ (the
partition group is not the data-parallel group), 16-bit master weights, torch autocast's
GradScaler, parameters tagged ``use_muon`` (DeepSpeed's own Muon path).

Checkpoints (``engine.save_checkpoint`` / ``load_checkpoint``) under owner-compute: each rank's
optimizer file holds the state of the runs it owns (DeepSpeed puts the owners' run tensors
in the inner optimizer's ``param_groups`` around ``state_dict()``), with the owner plan
(:data:`OWNER_PLAN_KEY`). Loading checks the plan on every rank: a checkpoint saved at another world
size, over other parameters or with the other kind of optimizer raises a :class:`DeepSpeedHookError`
(DeepSpeed's universal checkpoints too). To another world size: ``blockshard deepspeed-reshard``
([Note: ZeRO-3 resharding] in _zero3_reshard.py), or DCP (``export_dcp`` / ``import_dcp``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from blockshard._arith import block_shape
from blockshard.optim import semantics_for_optimizer
from blockshard.optim._placeholders import construct_over_stand_ins
from blockshard.semantics import TensorSpec, UnitGrid, get_semantics
from blockshard.semantics._builtins import Parts

from ._bnb_overrides import follow_overrides, resolve_module_overrides
from ._config import DeepSpeedHookError
from ._pending import pending
from ._refusals import refuse_shared
from ._unused import UsedParameters

__all__ = ["OWNER_PLAN_KEY", "Run", "is_elementwise", "make_stage3", "moved_bytes", "plan_runs", "zero3_optimizer"]

#: Where a ZeRO-3 optimizer state under owner-compute records its owner plan.
OWNER_PLAN_KEY = "blockshard_owner_plan"


def _plan_mismatch(saved: dict[str, Any] | None, mine: dict[str, Any] | None) -> str:
    def said(plan: dict[str, Any] | None) -> str:
        if plan is None:
            return "DeepSpeed's flat layout (no owner-compute: an element-wise optimizer or stock DeepSpeed)"
        return f"owner-compute at W = {plan['world_size']} over {len(plan['params'])} parameters"

    return (
        f"this ZeRO-3 checkpoint's optimizer state was saved with {said(saved)}, and this engine steps with "
        f"{said(mine)}: its state would land on other parameters. Load it with the same world size, "
        "parameters and optimizer kind (element-wise or not) it was saved with; for another world size, rewrite "
        "it with `blockshard deepspeed-reshard CHECKPOINT OUT --world-size N`, or move it through DCP "
        "(`blockshard deepspeed-to-dcp`, then `import_dcp(engine, path)`)"
    )


def zero3_optimizer(factory: Callable[[Any], torch.optim.Optimizer], params: Any) -> torch.optim.Optimizer:
    """``factory(params)`` for parameters that ``deepspeed.zero.Init`` partitioned at construction.

    Their tensors are 1-D placeholders until DeepSpeed gathers them, so an optimizer whose
    constructor checks shapes refuses them (torch's ``Muon``: "Muon only supports 2D parameters").
    The constructor here sees meta tensors of each parameter's full shape (``ds_shape``); then every
    ``param_group`` holds the real parameters again, which is what ``deepspeed.initialize`` reads.
    Under the hook's ZeRO-3 owner-compute the optimizer steps runs of those shapes.
    ``params``: parameters or ``param_groups`` (dicts with ``"params"``), as the optimizer takes.
    """
    return construct_over_stand_ins(factory, params)


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` computes each element on its own (a flat partition is exact for it)."""
    try:
        return semantics_for_optimizer(optimizer) == "elementwise"
    except ValueError:  # an optimizer blockshard does not know: computed on whole parameters
        return False


@dataclass
class Run:
    """Elements ``[start, end)`` of a parameter's flattening, computed on ``owner`` as a tensor of ``shape``."""

    start: int
    end: int
    owner: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start


def _cuts(grid: UnitGrid, partition: int, world_size: int) -> list[int]:
    """The allowed cuts nearest DeepSpeed's partition boundaries, runs at least ``grid.min_cut`` long."""
    n, u, m = grid.numel, grid.unit_numel, grid.min_cut
    if grid.min_cut > grid.max_cut:
        return []  # whole
    out: list[int] = []
    last = 0
    for k in range(1, world_size):
        t = k * partition
        if t >= n:
            break
        c = min(max((t + u // 2) // u * u, grid.min_cut), grid.max_cut)
        if c - last >= m and n - c >= m and c > last:
            out.append(c)
            last = c
    return out


def plan_runs(
    shapes: list[tuple[int, ...]], grids: list[UnitGrid], world_size: int
) -> tuple[list[list[Run]], list[int]]:
    """Pure: the runs of every parameter (``shapes[j]``, its optimizer's ``grids[j]``) under ZeRO-3's
    partition ``ceil(numel / W)``, and each rank's owned elements. The same on every rank."""
    W = world_size
    load = [0] * W
    runs: list[list[Run]] = []
    whole: list[tuple[int, int]] = []  # (numel, parameter index)
    for j, (shape, grid) in enumerate(zip(shapes, grids, strict=True)):
        n = math.prod(shape)
        P = -(-n // W) if n else 0
        cuts = _cuts(grid, P, W) if n else []
        if grid.min_cut > grid.max_cut or (not cuts and n > P):
            runs.append([])
            whole.append((n, j))
            continue
        bounds = [0, *cuts, n]
        mine = []
        for a, b in itertools.pairwise(bounds):
            # the rank whose partition holds most of [a, b); ties: the lower rank
            near = range(a // P, min(W, (b - 1) // P + 1))  # the ranks whose partitions [r*P, (r+1)*P) meet it
            owner = max(near, key=lambda r: (min(b, (r + 1) * P) - max(a, r * P), -r))
            load[owner] += b - a
            mine.append(Run(a, b, owner, block_shape(shape, a, b - a)))
        runs.append(mine)
    for n, j in sorted(whole, key=lambda e: (-e[0], e[1])):
        owner = min(range(W), key=lambda r: (load[r], r))
        load[owner] += n
        runs[j] = [Run(0, n, owner, tuple(shapes[j]))]
    return runs, load


def _span(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The real elements ``[lo, hi)`` of ``rank``'s partition of a parameter."""
    P = -(-numel // world_size) if numel else 0
    lo = min(rank * P, numel)
    return lo, min(lo + P, numel)


def moved_bytes(runs: list[list[Run]], numels: list[int], world_size: int, rank: int, itemsize: int = 4) -> int:
    """Pure: the bytes ``rank`` sends per optimizer step under the plan (its real elements of every
    run owned elsewhere, gradient and value; the new values of the runs it owns, to the other ranks)."""
    sent = 0
    for param_runs, n in zip(runs, numels, strict=True):
        lo, hi = _span(n, world_size, rank)
        for run in param_runs:
            if run.owner != rank:
                sent += 2 * max(0, min(hi, run.end) - max(lo, run.start))
            else:
                P = -(-n // world_size)
                for r in range(run.start // P, min(world_size, (run.end - 1) // P + 1)):
                    if r != rank:
                        a, b = _span(n, world_size, r)
                        sent += max(0, min(b, run.end) - max(a, run.start))
    return sent * itemsize


@dataclass(eq=False)
class _Param:
    """One parameter of a sub-group: where this rank's partition sits in the flat fp32 partition."""

    name: str
    shape: tuple[int, ...]
    numel: int
    flat_offset: int  # of this rank's partition in fp32_partitioned_groups_flat[i]
    label: str  # the block semantics its runs follow
    ds_id: int  # DeepSpeed's id of the parameter (how a step finds whether it was used)
    runs: list[Run] = field(default_factory=list)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # run index -> the owner's run tensor


@dataclass
class _SubGroup:
    params: list[_Param] = field(default_factory=list)


def _refuse(kwargs: dict[str, Any], init_optimizer: torch.optim.Optimizer) -> None:
    where = "blockshard's ZeRO-3 owner-compute (an optimizer that is not element-wise: "
    where += f"{type(init_optimizer).__name__})"
    refuse_shared(init_optimizer, kwargs, where, ("offload_optimizer_config", "offload_param_config"))
    if int(kwargs.get("zero_hpz_partition_size") or 1) > 1:
        raise DeepSpeedHookError(
            f"zero_optimization.zero_hpz_partition_size > 1 is not supported by {where}: set it to 1"
        )
    if kwargs.get("fp16_master_weights_and_gradients") or kwargs.get("bf16_master_weights_and_gradients"):
        raise DeepSpeedHookError(
            f"16-bit master weights are not supported by {where}: the owner computes on fp32 masters; remove "
            "fp16_master_weights_and_gradients / bf16_master_weights_and_gradients"
        )


def make_stage3() -> type:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class BlockshardStage3(DeepSpeedZeroOptimizer_Stage3):
        """DeepSpeed's ZeRO-3 optimizer whose step computes on whole units ([Note: ZeRO-3 owner-compute])."""

        def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
            p = pending()
            if p is None:
                raise DeepSpeedHookError(
                    "BlockshardStage3 is created by blockshard.integrations.deepspeed.initialize(); do not "
                    "construct it directly"
                )
            self._bs_config = p.config
            # element-wise optimizers as stock DeepSpeed steps them, unless "owner_compute": "always"
            self._bs_owner = not is_elementwise(init_optimizer) or p.config.owner_compute == "always"
            if self._bs_owner:
                _refuse(kwargs, init_optimizer)
            super().__init__(module, init_optimizer, *args, **kwargs)
            if self.torch_autocast_gradscaler is not None and self._bs_owner:
                raise DeepSpeedHookError(
                    "torch autocast's GradScaler is not supported by blockshard's ZeRO-3 owner-compute"
                )
            self._bs_subgroups: list[_SubGroup] = []
            self._bs_moved: list[int] = []  # bytes this rank sent per optimizer step
            self._bs_names = {id(q): n for q, n in getattr(self, "param_names", {}).items()}
            self._bs_overrides_resolved = False
            # [Note: unused parameters]: which parameters autograd gave a gradient this step (the hooks
            # fire only where autograd accumulated one, not for a parameter DeepSpeed zero-fills: a z3
            # leaf module's unused parameters); DeepSpeed's destroy() removes them
            self._bs_params = [q for g in self.fp16_groups for q in g]
            exact = self._bs_config.unused_parameters == "exact"
            self._bs_used = UsedParameters(self._bs_params, self._grad_acc_hooks) if exact else None
            self._bs_found: Callable[[], set[int]] | None = None  # during a step: the unused parameters
            self._bs_unused: set[int] | None = None  # their ds_ids, once the step first needs them
            if self._bs_owner:
                self._bs_plan()

        # -- plan ----------------------------------------------------------------------------------
        def _bs_semantics(self, name: str, shape: tuple[int, ...], gid: int) -> tuple[str, UnitGrid]:
            """The block semantics a parameter's runs follow: the inner optimizer's where blockshard knows
            it, else the ``"blockshard"`` section's rules, else whole parameters."""
            n = math.prod(shape)
            spec = TensorSpec(name=name, shape=shape, dtype="float32", param_group=gid)
            rules = self._bs_config.rules if self._bs_config.semantics is not None else None
            fused = [s.spec for s in rules.matching(spec) if isinstance(s, Parts)] if rules is not None else []
            if fused:  # [Note: fused parts]
                raise DeepSpeedHookError(
                    f"parameter {name!r} of shape {shape} is declared a fused weight ({fused[0]!r}): Muon per part "
                    "runs in blockshard.fully_shard with blockshard.optim.Muon; the DeepSpeed hook steps each matrix "
                    "whole. Fix: drop the 'parts' rule from the \"blockshard\" section's semantics"
                )
            per_group = getattr(self.optimizer, "blockshard_group_semantics", None)
            try:  # [Note: Muon beside AdamW]: an optimizer that states its semantics per param_group
                label = per_group(gid) if callable(per_group) else semantics_for_optimizer(self.optimizer)
            except ValueError:
                if rules is None:
                    return "whole", UnitGrid.whole(n)
                res = rules.resolve(spec)
                return res.label, res.grid
            return label, get_semantics(label).grid(shape, "float32", tensor=name)

        def _bs_plan(self) -> None:
            group = self.dp_process_group
            W, me = dist.get_world_size(group=group), dist.get_rank(group=group)
            ranks = dist.get_process_group_ranks(group)
            flat_params: list[_Param] = []
            grids: list[UnitGrid] = []
            for i, params in enumerate(self.fp16_groups):
                sg, off = _SubGroup(), 0
                gid = self.sub_group_to_group_id[i]
                for j, q in enumerate(params):
                    if q.ds_process_group is not group and dist.get_process_group_ranks(q.ds_process_group) != ranks:
                        raise DeepSpeedHookError(
                            f"parameter {self._bs_names.get(id(q), j)!r} is partitioned over another group than the "
                            "data-parallel group (MoE experts, MiCS, hpZ); not supported by blockshard's ZeRO-3 "
                            "owner-compute: use an element-wise optimizer there, or ZeRO-1/2"
                        )
                    name = self._bs_names.get(id(q)) or f"param_group{gid}.{j}"
                    shape = tuple(int(d) for d in q.ds_shape)
                    label, grid = self._bs_semantics(name, shape, gid)
                    prm = _Param(name, shape, int(q.ds_numel), off, label, int(q.ds_id))
                    if int(q.partition_numel()) != -(-prm.numel // W):
                        raise DeepSpeedHookError(
                            f"parameter {name!r}: DeepSpeed partitioned it into {int(q.partition_numel())} elements "
                            f"per rank, not ceil({prm.numel} / {W}); this DeepSpeed's ZeRO-3 layout is not the one "
                            "blockshard's owner-compute reads"
                        )
                    sg.params.append(prm)
                    flat_params.append(prm)
                    grids.append(grid)
                    off += int(q.partition_numel())
                self._bs_subgroups.append(sg)
            runs = iter(plan_runs([q.shape for q in flat_params], grids, W)[0])
            for i, sg in enumerate(self._bs_subgroups):
                flat = self.fp32_partitioned_groups_flat[i]
                for prm in sg.params:
                    prm.runs = next(runs)
                    for k, run in enumerate(prm.runs):
                        if run.owner == me:
                            prm.tensors[k] = torch.zeros(run.shape, dtype=flat.dtype, device=flat.device)

        # -- step ----------------------------------------------------------------------------------
        def step(self, closure: Any = None) -> Any:
            if self._bs_used is None:
                return super().step(closure)
            device = self.fp32_partitioned_groups_flat[0].device
            found = self._bs_used.unused_everywhere(self.dp_process_group, device)
            if self._bs_owner:  # the answer is waited for where the first run steps (overlapping the norms)
                self._bs_found = found
                try:
                    return super().step(closure)
                finally:
                    # [Note: ZeRO-3 unused parameters]: the next step starts from zero gradient partitions
                    found()
                    self._bs_used.clear()
                    self._bs_found = None
                    self._bs_unused = None
                    self.grad_partitions_flat_buffer.zero_()
            unused = [self._bs_params[k] for k in sorted(found())]
            if unused:
                self._bs_used.clear()
                names = [self._bs_names.get(id(q), f"ds_id {q.ds_id}") for q in unused]
                raise DeepSpeedHookError(
                    f"parameter(s) {names[:4]}{' ...' if len(names) > 4 else ''} got no gradient on any rank in this "
                    f"step; DeepSpeed ZeRO-3 steps them anyway with the element-wise {type(self.optimizer).__name__} "
                    "over its flat partition (a stale or zero gradient: weight and moment decay), where one process "
                    'skips them, and one flat tensor cannot skip a parameter alone. Fix: set "blockshard": '
                    '{"owner_compute": "always"} (each partition of each parameter its own tensor and state, '
                    "skipped exactly; no bytes move), freeze what a step does not train (requires_grad_(False)), use "
                    'ZeRO-1/2 with blockshard\'s hook (per-parameter views), or set "blockshard": '
                    '{"unused_parameters": "stock"} to accept DeepSpeed\'s update'
                )
            try:
                return super().step(closure)
            finally:
                self._bs_used.clear()

        def _optimizer_step(self, sub_group_id: int) -> None:
            if not self._bs_owner:
                super()._optimizer_step(sub_group_id)
                return
            self._bs_owner_step(sub_group_id)

        def _bs_unused_ids(self) -> set[int]:
            """The ds_ids of the parameters no rank used in this step (waited for, and built, once per step)."""
            if self._bs_unused is None:
                found = self._bs_found() if self._bs_found is not None else set()
                self._bs_unused = {int(self._bs_params[k].ds_id) for k in found}
            return self._bs_unused

        def _bs_owner_step(self, i: int) -> None:
            """One sub-group's step ([Note: ZeRO-3 owner-compute]); this rank's own elements of the runs it
            owns are copied in place, only the other ranks' go through the all_to_alls."""
            group = self.dp_process_group
            W, me = dist.get_world_size(group=group), dist.get_rank(group=group)
            flat = self.fp32_partitioned_groups_flat[i]
            grad = flat.grad if flat.grad is not None else torch.zeros_like(flat)
            params = self._bs_subgroups[i].params
            used = [q.ds_id not in self._bs_unused_ids() for q in params]

            def overlap(q: _Param, run: Run, rank: int) -> tuple[int, int]:
                lo, hi = _span(q.numel, W, rank)
                return max(lo, run.start), min(hi, run.end)

            def base(q: _Param) -> int:  # flat index of element 0 of the parameter on this rank
                return q.flat_offset - _span(q.numel, W, me)[0]

            for q in params:  # the run tensors' storage lives only during the step (freed below)
                for t in q.tensors.values():
                    if t.untyped_storage().size() == 0:
                        t.untyped_storage().resize_(t.numel() * t.element_size())
            # in: to each other run owner, my real elements of the run (gradient, then value)
            chunks: list[torch.Tensor] = []
            send, recv = [0] * W, [0] * W
            for dest in range(W):
                for q in params:
                    for run in q.runs:
                        lo, hi = overlap(q, run, me)
                        if run.owner == dest and dest != me and hi > lo:
                            chunks.append(grad.detach().narrow(0, base(q) + lo, hi - lo))
                            chunks.append(flat.detach().narrow(0, base(q) + lo, hi - lo))
                            send[dest] += 2 * (hi - lo)
            for src in range(W):
                for q in params:
                    for run in q.runs:
                        if run.owner == me and src != me:
                            lo, hi = overlap(q, run, src)
                            recv[src] += 2 * max(0, hi - lo)
            inp = torch.cat(chunks) if chunks else flat.new_empty(0)
            out = flat.new_empty(sum(recv))
            dist.all_to_all_single(out, inp, recv, send, group=group)
            grads: dict[tuple[int, int], torch.Tensor] = {}
            pos = 0
            for src in range(W):
                for j, q in enumerate(params):
                    for k, run in enumerate(q.runs):
                        lo, hi = overlap(q, run, src)
                        if run.owner != me or hi <= lo:
                            continue
                        t = q.tensors[k]
                        g = grads.setdefault((j, k), torch.empty_like(t))
                        g_at, t_at = (
                            g.view(-1).narrow(0, lo - run.start, hi - lo),
                            t.view(-1).narrow(0, lo - run.start, hi - lo),
                        )
                        if src == me:  # in place, from DeepSpeed's partition
                            g_at.copy_(grad.detach().narrow(0, base(q) + lo, hi - lo))
                            t_at.copy_(flat.detach().narrow(0, base(q) + lo, hi - lo))
                            continue
                        g_at.copy_(out.narrow(0, pos, hi - lo))
                        t_at.copy_(out.narrow(0, pos + hi - lo, hi - lo))
                        pos += 2 * (hi - lo)
            del inp, out
            # the unmodified inner optimizer on the runs this rank owns
            gid = self.sub_group_to_group_id[i]
            owned = [(q.tensors[k], j) for j, q in enumerate(params) for k in sorted(q.tensors)]
            for (j, k), g in grads.items():
                if used[j]:  # no gradient on any rank: None, so the optimizer skips it as on one process
                    params[j].tensors[k].grad = g
            del grads
            if not self._bs_overrides_resolved:  # bitsandbytes' check_overrides, first step
                resolve_module_overrides(self.optimizer, [q for g in self.fp16_groups for q in g])
                self._bs_overrides_resolved = True
            if owned:
                self.optimizer.param_groups[gid]["params"] = [t for t, _ in owned]
                try:
                    with follow_overrides(self.optimizer, self.fp16_groups[i], owned, gindex=gid):
                        self.optimizer.step()
                finally:
                    self.optimizer.param_groups[gid]["params"] = []
                    for t, _ in owned:
                        t.grad = None
            # out: each other rank's slice of the new values of the runs this rank owns; mine in place
            back: list[torch.Tensor] = []
            send_back, recv_back = [0] * W, [0] * W
            for dest in range(W):
                for q in params:
                    for k, run in enumerate(q.runs):
                        lo, hi = overlap(q, run, dest)
                        if run.owner != me or hi <= lo:
                            continue
                        new = q.tensors[k].detach().view(-1).narrow(0, lo - run.start, hi - lo)
                        if dest == me:
                            flat.data.narrow(0, base(q) + lo, hi - lo).copy_(new)
                        else:
                            back.append(new)
                            send_back[dest] += hi - lo
            for src in range(W):
                for q in params:
                    for run in q.runs:
                        lo, hi = overlap(q, run, me)
                        if run.owner == src and src != me:
                            recv_back[src] += max(0, hi - lo)
            inp2 = torch.cat(back) if back else flat.new_empty(0)
            out2 = flat.new_empty(sum(recv_back))
            dist.all_to_all_single(out2, inp2, recv_back, send_back, group=group)
            pos = 0
            for src in range(W):
                for q in params:
                    for run in q.runs:
                        lo, hi = overlap(q, run, me)
                        if run.owner != src or src == me or hi <= lo:
                            continue
                        flat.data.narrow(0, base(q) + lo, hi - lo).copy_(out2.narrow(0, pos, hi - lo))
                        pos += hi - lo
            self._bs_moved.append((sum(send) + sum(send_back)) * flat.element_size())
            # between steps the run tensors hold nothing (their values are in DeepSpeed's partitions; the
            # optimizer's state stays keyed by them): no second fp32 copy of the owned elements
            for q in params:
                for t in q.tensors.values():
                    t.untyped_storage().resize_(0)

        # -- what the hook reports -----------------------------------------------------------------
        def owner_traffic(self) -> dict[str, Any]:
            """Owner-compute's plan and bytes: ``owner`` (whether on), ``runs`` (parameter name -> its
            runs ``(start, end, owner)``), ``semantics`` (parameter name -> the semantics its runs
            follow), ``bytes_per_step`` (the bytes this rank sent to other ranks, per
            ``_optimizer_step`` call: what :func:`moved_bytes` predicts)."""
            return {
                "owner": self._bs_owner,
                "runs": {
                    q.name: [(r.start, r.end, r.owner) for r in q.runs] for sg in self._bs_subgroups for q in sg.params
                },
                "semantics": {q.name: q.label for sg in self._bs_subgroups for q in sg.params},
                "bytes_per_step": list(self._bs_moved),
            }

        # -- checkpoints ---------------------------------------------------------------------------
        # DeepSpeed's _rigid_state_dict / _rigid_load_state_dict put the fp32 partitions in the
        # inner optimizer's param_groups around its state_dict() / load_state_dict(); under
        # owner-compute the state is keyed by the owners' whole tensors, so those go there instead
        # (each rank's file holds the state of the parameters it owns), with the plan beside it.
        def _set_fp32_optimizer_param_groups(self) -> None:
            if not self._bs_owner:
                super()._set_fp32_optimizer_param_groups()
                return
            for i, sg in enumerate(self._bs_subgroups):
                gid = self.sub_group_to_group_id[i]
                self.optimizer.param_groups[gid]["params"].extend(
                    q.tensors[k] for q in sg.params for k in sorted(q.tensors)
                )

        def _bs_plan_record(self) -> dict[str, Any]:
            group = self.dp_process_group
            return {
                "world_size": dist.get_world_size(group=group),
                "params": [
                    [q.name, list(q.shape), [[r.start, r.end, r.owner] for r in q.runs]]
                    for sg in self._bs_subgroups
                    for q in sg.params
                ],
                "semantics": [q.label for sg in self._bs_subgroups for q in sg.params],
            }

        def state_dict(self) -> Any:
            out = super().state_dict()
            if self._bs_owner:
                out[OWNER_PLAN_KEY] = self._bs_plan_record()
            return out

        def _rigid_load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
            saved = state_dict.get(OWNER_PLAN_KEY)
            mine = self._bs_plan_record() if self._bs_owner else None
            if load_optimizer_states and saved != mine:
                raise DeepSpeedHookError(_plan_mismatch(saved, mine))
            super()._rigid_load_state_dict(state_dict, load_optimizer_states=load_optimizer_states)

        def _load_universal_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            if self._bs_owner:
                raise DeepSpeedHookError(
                    "universal checkpoints are not supported by blockshard's ZeRO-3 owner-compute (the state is "
                    "per whole parameter on its owner, not DeepSpeed's flat fp32 partitions); load the checkpoint "
                    "at the world size it was saved at"
                )
            super()._load_universal_checkpoint(*args, **kwargs)

    return BlockshardStage3
