"""The optimizer section of the report: what each optimizer steps, its state tensors, and who is left out.

This rank's figures only (``StateRow.bytes`` of length 1); ``_build.py`` joins the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from blockshard._errors import ReportError
from blockshard.runtime._report._external import ComputeTensors, PartitionSource
from blockshard.runtime._report._model import OptimizerRow, StateRow
from blockshard.runtime.core._inspect import global_shape, state_name
from blockshard.runtime.core._optim_facts import state_kind as facts_state_kind
from blockshard.runtime.core._param import managed_tag

__all__ = ["LocalOptimizers", "as_one_process", "joined_check", "optimizer_rows", "state_kind"]

_KINDS = {"uint8": "8-bit", "int8": "8-bit", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def state_kind(dtype: str) -> str:
    """A state tensor's kind by its dtype (``8-bit``, ``fp32``, ``bf16``, ...)."""
    return _KINDS.get(dtype, dtype)


_QUANTIZED_KEYS = ("state1", "state2", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # bitsandbytes', torchao's


def as_one_process(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, state: torch.Tensor) -> bool | None:
    """Whether ``state`` (``optimizer``'s state ``key`` of ``param``, a piece or a whole tensor) has
    the kind one process would keep for the whole parameter (8-bit vs fp32: [Note: state kind] in
    runtime/core/_optim_facts.py, bitsandbytes' ``min_8bit_size``, torchao's 4096 / ``block_size``);
    ``None``: not a quantizing optimizer's moment, or not a piece of the ragged engine (a whole
    tensor is as on one process; another engine's partition is not judged here)."""
    tag = managed_tag(param)
    if key not in _QUANTIZED_KEYS or tag is None or tag.original or tag.group is None or param.numel() == 0:
        return None
    for gi, group in enumerate(optimizer.param_groups):
        for pi, q in enumerate(group["params"]):
            if q is param:
                want = facts_state_kind(optimizer, gi, pi, math.prod(global_shape(param)))
                if want is None:
                    return None
                fp32 = type(state) is torch.Tensor and state.dtype == torch.float32  # torchao: a subclass
                return fp32 == (want == "fp32")
    return None


@dataclass
class LocalOptimizers:
    rows: list[OptimizerRow] = field(default_factory=list)
    stepped: set[str] = field(default_factory=set)
    trainable: list[str] = field(default_factory=list)


def optimizer_rows(model: nn.Module, optimizers: Sequence[object]) -> LocalOptimizers:
    names = {id(p): state_name(n) for n, p in model.named_parameters(remove_duplicate=False)}
    out = LocalOptimizers(trainable=[state_name(n) for n, p in model.named_parameters() if p.requires_grad])
    for i, opt in enumerate(optimizers):
        inner, tensor_names, stepped, note = _resolve(opt, names)
        steps: list[str] = []
        for p in stepped:
            n = tensor_names.get(id(p), f"<not a parameter of the model: shape {tuple(p.shape)}>")
            if n not in steps:
                steps.append(n)
        out.stepped |= set(steps)
        states: list[StateRow] = []
        for p, st in inner.state.items():
            if not isinstance(p, torch.Tensor):
                continue
            pname = tensor_names.get(id(p), f"<not a parameter of the model: shape {tuple(p.shape)}>")
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    states.append(_state_row(inner, pname, str(key), v, p))
        out.rows.append(
            OptimizerRow(index=i, name=type(opt).__name__, steps=tuple(steps), states=_summed(states), note=note)
        )
    return out


def _resolve(
    opt: object, names: dict[int, str]
) -> tuple[torch.optim.Optimizer, dict[int, str], list[torch.Tensor], str]:
    """The optimizer that holds the state, the names of the tensors it steps (by id) and those tensors."""
    if isinstance(opt, PartitionSource):
        inner = opt.blockshard_inner_optimizer()
        by_view: dict[int, str] = {}
        for g in opt.blockshard_partitions():
            for t, view in g.views:
                by_view[id(view)] = names.get(id(g.params[t]), g.names[t])
        note = f"{opt.blockshard_engine()}: its inner {type(inner).__name__} steps the partitions' views"
        return inner, by_view, _params_of(inner), note
    if isinstance(opt, ComputeTensors):
        inner, params, pairs = opt.blockshard_compute_tensors()
        by_tensor = {**names, **{id(t): names.get(id(p), "") for t, p in pairs if id(p) in names}}
        note = f"its inner {type(inner).__name__} steps compute tensors (pieces, whole units at owners)"
        return inner, by_tensor, params, note
    if not isinstance(opt, torch.optim.Optimizer):
        raise ReportError(
            f"optimizers=[..., {type(opt).__name__} ...]: each must be a torch.optim.Optimizer (or a DeepSpeed "
            "engine's optimizer made by blockshard.integrations.deepspeed); pass the optimizers you step"
        )
    return opt, names, _params_of(opt), ""


def _params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def joined_check(checks: Iterable[bool | None]) -> bool | None:
    """Several pieces' ``as_one_process``: False where any is not as on one process, else True
    where any was checked, else None."""
    seen = set(checks)
    return False if False in seen else True if True in seen else None


def _state_row(opt: torch.optim.Optimizer, name: str, key: str, v: torch.Tensor, param: torch.Tensor) -> StateRow:
    dtype = str(v.dtype).removeprefix("torch.")
    return StateRow(
        param=name,
        key=key,
        dtype=dtype,
        bytes=(v.numel() * v.element_size(),),
        kind=state_kind(dtype),
        as_one_process=as_one_process(opt, param, key, v),
    )


def _summed(rows: list[StateRow]) -> tuple[StateRow, ...]:
    """One row per (parameter, key): several tensors of one name (views of one parameter) added."""
    out: dict[tuple[str, str], StateRow] = {}
    for r in rows:
        k = (r.param, r.key)
        if k in out:
            prev = out[k]
            dtype = prev.dtype if prev.dtype == r.dtype else f"{prev.dtype}|{r.dtype}"
            out[k] = StateRow(
                param=r.param,
                key=r.key,
                dtype=dtype,
                bytes=(prev.bytes[0] + r.bytes[0],),
                kind="|".join(state_kind(d) for d in dtype.split("|")),
                as_one_process=joined_check((prev.as_one_process, r.as_one_process)),
            )
        else:
            out[k] = r
    return tuple(out.values())
