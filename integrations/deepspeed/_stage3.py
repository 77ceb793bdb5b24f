"""The ZeRO-3 hook: DeepSpeed keeps its partitions; the optimizer step computes on whole parameters.

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
  hook does not know): *owner-compute on whole parameters*. Each parameter has one owner rank
  (largest first, to the least-loaded rank, over all sub-groups: the same plan on every rank). One
  ``all_to_all_single`` on the data-parallel group moves every rank's real elements (padding left
  out) of each parameter's gradient and fp32 master value to its owner, which rebuilds the whole
  parameter (its own shape) in a tensor of its own, kept across steps (the optimizer's state is
  keyed by it), and runs the unmodified inner optimizer on those tensors; a second
  ``all_to_all_single`` sends each rank its slice of the new values, written into the flat master
  partition. So the optimizer computes on every parameter what it computes on one process: whole
  matrices for Muon (Newton-Schulz once per optimizer step), bitsandbytes' blocks from each
  parameter's start and its 32-bit state below 4096 elements. The optimizer state of a parameter
  lives on its owner only (about 1 / W of the total per rank).
* **Bytes moved per step** (:meth:`owner_traffic`): per rank, ``2 x 4`` bytes per real element it
  holds in (gradient and value), ``4`` bytes per element back: ``12 x numel / W`` bytes on average.

Refused with a :class:`DeepSpeedHookError` under owner-compute (checked at ``initialize``, nothing
silently wrong): optimizer offload and NVMe, parameter offload, ZenFlow, MoE, MiCS / hpZ (the
partition group is not the data-parallel group), 16-bit master weights, torch autocast's
GradScaler, parameters tagged ``use_muon`` (DeepSpeed's own Muon path).

Checkpoints (``engine.save_checkpoint`` / ``load_checkpoint``) under owner-compute: each rank's
optimizer file holds the state of the parameters it owns (DeepSpeed puts the owners' whole tensors
in the inner optimizer's ``param_groups`` around ``state_dict()``), with the owner plan
(:data:`OWNER_PLAN_KEY`). Loading checks the plan on every rank: a checkpoint saved at another world
size, over other parameters or with the other kind of optimizer raises a :class:`DeepSpeedHookError`
(DeepSpeed's universal checkpoints too): moving a ZeRO-3 run to another world size is not done yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from blockshard.optim import semantics_for_optimizer

from ._bnb_overrides import follow_overrides, resolve_module_overrides
from ._config import DeepSpeedHookError

__all__ = ["OWNER_PLAN_KEY", "is_elementwise", "make_stage3", "zero3_optimizer"]

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
        "parameters and optimizer kind (element-wise or not) it was saved with; moving a run to another world "
        "size is not done yet for ZeRO-3"
    )


def zero3_optimizer(factory: Callable[[Any], torch.optim.Optimizer], params: Any) -> torch.optim.Optimizer:
    """``factory(params)`` for parameters that ``deepspeed.zero.Init`` partitioned at construction.

    Their tensors are 1-D placeholders until DeepSpeed gathers them, so an optimizer whose
    constructor checks shapes refuses them (torch's ``Muon``: "Muon only supports 2D parameters").
    The constructor here sees meta tensors of each parameter's full shape (``ds_shape``); then every
    ``param_group`` holds the real parameters again, which is what ``deepspeed.initialize`` reads.
    Under the hook's ZeRO-3 owner-compute the optimizer steps whole parameters of those shapes.
    ``params``: parameters or ``param_groups`` (dicts with ``"params"``), as the optimizer takes.
    """
    real: dict[int, torch.Tensor] = {}

    def stand_in(p: torch.Tensor) -> torch.Tensor:
        shape = getattr(p, "ds_shape", None)
        if shape is None:
            return p
        t = torch.empty(tuple(shape), dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
        real[id(t)] = p
        return t

    if isinstance(params, torch.Tensor):
        params = [params]
    params = list(params)
    if params and isinstance(params[0], dict):
        args: list[Any] = [{**g, "params": [stand_in(p) for p in g["params"]]} for g in params]
    else:
        args = [stand_in(p) for p in params]
    opt = factory(args)
    for g in opt.param_groups:
        g["params"] = [real.get(id(t), t) for t in g["params"]]
    return opt


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` computes each element on its own (a flat partition is exact for it)."""
    try:
        return semantics_for_optimizer(optimizer) == "elementwise"
    except ValueError:  # an optimizer blockshard does not know: computed on whole parameters
        return False


@dataclass
class _Param:
    """One parameter of a sub-group: where its partition sits in the flat fp32 partition."""

    name: str
    shape: tuple[int, ...]
    numel: int
    partition: int  # P = ceil(numel / W): each rank's partition_numel()
    flat_offset: int  # of this rank's partition in fp32_partitioned_groups_flat[i]
    owner: int
    whole: torch.Tensor | None = None  # on the owner: the whole fp32 parameter, kept across steps

    def real(self, rank: int) -> int:
        """Real elements of ``rank``'s partition (the rest is padding)."""
        return max(0, min(self.partition, self.numel - rank * self.partition))


@dataclass
class _SubGroup:
    params: list[_Param] = field(default_factory=list)


def _refuse(kwargs: dict[str, Any], init_optimizer: torch.optim.Optimizer) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    where = "blockshard's ZeRO-3 owner-compute (an optimizer that is not element-wise: "
    where += f"{type(init_optimizer).__name__})"
    for key, what in (("offload_optimizer_config", "offload_optimizer"), ("offload_param_config", "offload_param")):
        off = kwargs.get(key)
        if off is not None and getattr(off, "device", OffloadDeviceEnum.none) != OffloadDeviceEnum.none:
            raise DeepSpeedHookError(f"zero_optimization.{what} is not supported by {where}; remove it")
    if kwargs.get("zenflow_config") is not None:
        raise DeepSpeedHookError(f"ZenFlow is not supported by {where}")
    if int(kwargs.get("zero_hpz_partition_size") or 1) > 1:
        raise DeepSpeedHookError(
            f"zero_optimization.zero_hpz_partition_size > 1 is not supported by {where}: set it to 1"
        )
    if kwargs.get("fp16_master_weights_and_gradients") or kwargs.get("bf16_master_weights_and_gradients"):
        raise DeepSpeedHookError(
            f"16-bit master weights are not supported by {where}: the owner computes on fp32 masters; remove "
            "fp16_master_weights_and_gradients / bf16_master_weights_and_gradients"
        )
    name = type(init_optimizer).__name__
    if name == "MuonWithAuxAdam":
        raise DeepSpeedHookError(
            "DeepSpeed's MuonWithAuxAdam steps its own flat partitions; with blockshard pass torch.optim.Muon"
        )
    for g in init_optimizer.param_groups:
        for p in g["params"]:
            if getattr(p, "use_muon", False):
                raise DeepSpeedHookError(
                    "parameters tagged use_muon select DeepSpeed's own flat-partition Muon path, which the "
                    "blockshard hook does not support; pass torch.optim.Muon as the optimizer instead"
                )


def make_stage3() -> type:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from ._hook import pending

    class BlockshardStage3(DeepSpeedZeroOptimizer_Stage3):
        """DeepSpeed's ZeRO-3 optimizer whose step computes on whole parameters ([Note: ZeRO-3 owner-compute])."""

        def __init__(self, module: torch.nn.Module, init_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
            p = pending()
            if p is None:
                raise DeepSpeedHookError(
                    "BlockshardStage3 is created by blockshard.integrations.deepspeed.initialize(); do not "
                    "construct it directly"
                )
            self._bs_config = p.config
            self._bs_owner = not is_elementwise(init_optimizer)
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
            if self._bs_owner:
                self._bs_plan()

        # -- plan ----------------------------------------------------------------------------------
        def _bs_plan(self) -> None:
            group = self.dp_process_group
            W, me = dist.get_world_size(group=group), dist.get_rank(group=group)
            load = [0] * W
            entries: list[tuple[int, int, int]] = []  # (numel, sub-group, index): the owner plan's order
            for i, params in enumerate(self.fp16_groups):
                sg, off = _SubGroup(), 0
                for j, q in enumerate(params):
                    if q.ds_process_group is not group and dist.get_world_size(group=q.ds_process_group) != W:
                        raise DeepSpeedHookError(
                            "a parameter is partitioned over another group than the data-parallel group (MiCS / "
                            "hpZ); not supported by blockshard's ZeRO-3 owner-compute"
                        )
                    P = int(q.partition_numel())
                    name = self._bs_names.get(id(q)) or f"param_group{self.sub_group_to_group_id[i]}.{j}"
                    sg.params.append(_Param(name, tuple(q.ds_shape), int(q.ds_numel), P, off, owner=-1))
                    entries.append((int(q.ds_numel), i, j))
                    off += P
                self._bs_subgroups.append(sg)
            for numel, i, j in sorted(entries, key=lambda e: (-e[0], e[1], e[2])):
                owner = min(range(W), key=lambda r: (load[r], r))
                load[owner] += numel
                prm = self._bs_subgroups[i].params[j]
                prm.owner = owner
                if owner == me:
                    flat = self.fp32_partitioned_groups_flat[i]
                    prm.whole = torch.zeros(prm.shape, dtype=flat.dtype, device=flat.device)

        # -- step ----------------------------------------------------------------------------------
        def _optimizer_step(self, sub_group_id: int) -> None:
            if not self._bs_owner:
                super()._optimizer_step(sub_group_id)
                return
            self._bs_owner_step(sub_group_id)

        def _bs_owner_step(self, i: int) -> None:
            group = self.dp_process_group
            W, me = dist.get_world_size(group=group), dist.get_rank(group=group)
            flat = self.fp32_partitioned_groups_flat[i]
            grad = flat.grad
            params = self._bs_subgroups[i].params
            mine = [q for q in params if q.owner == me]
            # in: to each owner, my real elements of its parameters' gradients and values
            chunks: list[torch.Tensor] = []
            send = [0] * W
            for dest in range(W):
                for q in params:
                    if q.owner != dest or not q.real(me):
                        continue
                    n = q.real(me)
                    lo = q.flat_offset
                    chunks.append(grad.detach().narrow(0, lo, n) if grad is not None else flat.new_zeros(n))
                    chunks.append(flat.detach().narrow(0, lo, n))
                    send[dest] += 2 * n
            recv = [2 * sum(q.real(src) for q in mine) for src in range(W)]
            inp = torch.cat(chunks) if chunks else flat.new_empty(0)
            out = flat.new_empty(sum(recv))
            dist.all_to_all_single(out, inp, recv, send, group=group)
            pos = 0
            grads: dict[int, torch.Tensor] = {}
            for src in range(W):
                for q in mine:
                    n = q.real(src)
                    if not n:
                        continue
                    whole = q.whole
                    assert whole is not None
                    g = grads.setdefault(id(q), torch.zeros_like(whole))
                    lo = src * q.partition
                    g.view(-1).narrow(0, lo, n).copy_(out.narrow(0, pos, n))
                    whole.view(-1).narrow(0, lo, n).copy_(out.narrow(0, pos + n, n))
                    pos += 2 * n
            # the unmodified inner optimizer on whole parameters
            gid = self.sub_group_to_group_id[i]
            tensors = []
            for q in mine:
                assert q.whole is not None
                q.whole.grad = grads[id(q)]
                tensors.append(q.whole)
            if not self._bs_overrides_resolved:  # bitsandbytes' check_overrides, first step
                resolve_module_overrides(self.optimizer, [q for g in self.fp16_groups for q in g])
                self._bs_overrides_resolved = True
            if tensors:
                self.optimizer.param_groups[gid]["params"] = tensors
                index = {id(q): j for j, q in enumerate(self.fp16_groups[i])}
                owned = [(t, index[id(q)]) for t, q in zip(tensors, self._bs_owned_params(i), strict=True)]
                try:
                    with follow_overrides(self.optimizer, self.fp16_groups[i], owned, gindex=gid):
                        self.optimizer.step()
                finally:
                    self.optimizer.param_groups[gid]["params"] = []
                    for t in tensors:
                        t.grad = None
            # out: each rank's slice of the new values
            back: list[torch.Tensor] = []
            send_back = [0] * W
            for dest in range(W):
                for q in mine:
                    n = q.real(dest)
                    if n:
                        assert q.whole is not None
                        back.append(q.whole.detach().view(-1).narrow(0, dest * q.partition, n))
                        send_back[dest] += n
            recv_back = [sum(q.real(me) for q in params if q.owner == src) for src in range(W)]
            inp2 = torch.cat(back) if back else flat.new_empty(0)
            out2 = flat.new_empty(sum(recv_back))
            dist.all_to_all_single(out2, inp2, recv_back, send_back, group=group)
            pos = 0
            for src in range(W):
                for q in params:
                    if q.owner != src or not q.real(me):
                        continue
                    n = q.real(me)
                    flat.data.narrow(0, q.flat_offset, n).copy_(out2.narrow(0, pos, n))
                    pos += n
            self._bs_moved.append((inp.numel() + inp2.numel()) * flat.element_size())

        def _bs_owned_params(self, i: int) -> list[torch.Tensor]:
            """The module parameters of sub-group ``i`` this rank owns, in plan order."""
            return [
                q
                for q, prm in zip(self.fp16_groups[i], self._bs_subgroups[i].params, strict=True)
                if prm.whole is not None
            ]

        # -- what the hook reports -----------------------------------------------------------------
        def owner_traffic(self) -> dict[str, Any]:
            """Owner-compute's plan and bytes: ``owner`` (whether on), ``owners`` (parameter name ->
            owner rank), ``bytes_per_step`` (this rank's bytes sent, per ``_optimizer_step`` call)."""
            return {
                "owner": self._bs_owner,
                "owners": {q.name: q.owner for sg in self._bs_subgroups for q in sg.params},
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
                self.optimizer.param_groups[gid]["params"].extend(q.whole for q in sg.params if q.whole is not None)

        def _bs_plan_record(self) -> dict[str, Any]:
            group = self.dp_process_group
            return {
                "world_size": dist.get_world_size(group=group),
                "params": [[q.name, list(q.shape), q.owner] for sg in self._bs_subgroups for q in sg.params],
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
