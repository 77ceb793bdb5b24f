"""Gradient views ([Note: gradient views] in blockshard/runtime/core/_grad_sync.py) in the engine's
training configurations, counted with the copy counter of ``benchmarks/engine_vs_fsdp2.py``.

Every case is ``case(rank, world) -> full parameters by name``: ``world > 0`` trains under blockshard
on the process group (every rank the whole batch), ``world == 0`` the same training on one process,
the reference. :func:`counted` runs one case with the views on or off
(``BLOCKSHARD_GRADIENT_VIEWS``) under the benchmark's ``OpCounter`` and returns the parameters with
the bytes its reduce-scatter path copied and cast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1]
for _d in (_TESTS / "optim", _TESTS / "quantized", _TESTS.parent / "benchmarks"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import _fast_scenarios as fs  # noqa: E402
import _hsdp_runs  # noqa: E402
import _loops  # noqa: E402
import _owner_runs  # noqa: E402
import _qgather_runs  # noqa: E402

Params = dict[str, torch.Tensor]


def _fs(kind: str, **kw) -> Callable[[int, int], Params]:
    def run(rank: int, world: int) -> Params:
        args = kw if world else {k: v for k, v in kw.items() if k not in ("shard_kwargs", "wrap")}
        return fs.train(rank, max(world, 1), kind, sharded=bool(world), **args)["params"]

    return run


def _loop(name: str, **kw) -> Callable[[int, int], Params]:
    return lambda rank, world: _loops.run(rank, world, name, kw, bool(world))["params"]


def _checkpointed(model: torch.nn.Module) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _offload() -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy()}


def _bf16() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}  # reduced in bf16: views too


def _hsdp(rank: int, world: int) -> Params:
    return _hsdp_runs.sharded(rank, world, "whole")["params"] if world else _hsdp_runs.reference(rank, world)


def _owner(rank: int, world: int) -> Params:
    if not world:
        return _owner_runs.references(rank, world, ("muon",))["muon"]
    return _owner_runs.sharded(rank, world, "muon", "owner", split=False)["params"]


def _qgather(rank: int, world: int) -> Params:
    return _qgather_runs.train(rank, world)["params"]  # trainable masters gathered quantized, by stripes


CASES: dict[str, Callable[[int, int], Params]] = {
    "llama": _fs("llama"),
    "no_sync_micro_batches": _fs("llama", micro=2),
    "bf16_reduced_in_bf16": lambda r, w: _fs("mlp", shard_kwargs=_bf16())(r, w) if w else _bf16_reference(),
    "bf16_micro_batches_in_fp32": _loop("bf16_accumulation"),
    "lora_partly_frozen": _loop("lora"),
    "frozen_after_sharding": _loop("freeze_after_sharding"),
    "frozen_under_no_grad": _loop("frozen_under_no_grad"),
    "requires_grad_changes": _loop("requires_grad_changes"),
    "activation_checkpointing": _fs("llama", wrap=_checkpointed),
    "cpu_offload": lambda r, w: _fs("mlp", micro=2, shard_kwargs=_offload())(r, w),
    "quantized_gather_masters": _qgather,
    "owner_compute_muon": _owner,
    "hsdp": _hsdp,  # a (2, 2) mesh: W = 4 only
}
CAST_CASES = frozenset({"bf16_micro_batches_in_fp32"})  # bf16 gradients summed into fp32 views


def _bf16_reference() -> Params:
    """``param_dtype=bf16`` reduced in bf16 on one process: bf16 compute on a copy (inputs cast),
    its bf16 gradient (what W identical ranks average to) cast to fp32 for the fp32 AdamW."""
    import copy

    with fs._inproc.serial():
        model = fs._model("mlp")
    low = copy.deepcopy(model).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=fs.LR)
    for x, y in fs.batches("mlp", 1):
        with torch.no_grad():
            for p16, p32 in zip(low.parameters(), model.parameters(), strict=True):
                p16.copy_(p32)
        ((low(x.bfloat16()) - y) ** 2).mean().backward()  # the root casts its inputs (FSDP2's cast_forward_inputs)
        for p16, p32 in zip(low.parameters(), model.parameters(), strict=True):
            p32.grad, p16.grad = p16.grad.float(), None
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def counted(rank: int, world: int, cases: tuple[str, ...], views: bool) -> dict[str, dict]:
    """Each case sharded with the views ``views``: its parameters and the bytes its reduce-scatter
    path copied (``rs_copy_bytes``, by op in ``rs_copy_ops``) and cast (``rs_cast_bytes``)."""
    from engine_vs_fsdp2 import OpCounter

    os.environ["BLOCKSHARD_GRADIENT_VIEWS"] = "1" if views else "0"
    out = {}
    for case in cases:
        counter = OpCounter()
        with counter:
            params = CASES[case](rank, world)
        seen = counter.summary()
        rs = seen["copies"]["reduce_scatter_path"]
        out[case] = {
            "params": params,
            "rs_copy_bytes": rs["bytes"],
            "rs_copy_ops": rs["ops"],
            "rs_cast_bytes": seen["cast_bytes"].get("reduce_scatter_path", 0),
        }
    return out


def references(_rank: int, _world: int, cases: tuple[str, ...]) -> dict[str, Params]:
    return {case: CASES[case](0, 0) for case in cases}
