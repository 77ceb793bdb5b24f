"""State dicts of sharded quantized weights, checked against the unsharded quantized model's own.

Every function takes ``(rank, world, kind, ...)`` and builds the model itself (the same on every
rank and in the reference): ``kind`` is ``"bnb"`` (a tiny Llama with bitsandbytes 4-bit decoder
linears; ``quant`` picks nf4/fp4, nested, storage), ``"ao_nf4"``, ``"mx"``, ``"fp8"`` or
``"fp8_tiles"`` (the same FP8 model sharded with ``tile_placement=True``), ``"fp8_experts"`` or
``"fp8_experts_tiles"`` (stacked FP8 experts, ``_fp8_runs.FP8ExpertStack``, by stripes or tiles).
Comparisons run inside the ranks (torchao subclasses do not cross processes), results are plain.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def build(kind: str, **quant) -> nn.Module:
    from _qlora import _serial, qlora_llama

    with _serial():
        if kind == "bnb":
            return qlora_llama(lora=False, **quant)
        if kind == "ao_nf4":
            from _ao_runs import NF4Stack

            return NF4Stack()
        if kind == "mx":
            from _mx_runs import MXStack

            return MXStack("float8_e4m3fn")
        from _fp8_runs import FP8ExpertStack, FP8Stack

        return FP8ExpertStack() if kind.startswith("fp8_experts") else FP8Stack()


def shard(model: nn.Module, kind: str) -> nn.Module:
    import blockshard

    layers = model.model.layers if kind == "bnb" else model.layers
    options = {"tile_placement": True} if kind.endswith("_tiles") else {}
    for layer in layers:
        blockshard.fully_shard(layer, **options)
    blockshard.fully_shard(model, **options)
    return model


def _parts(v: object) -> list[torch.Tensor]:
    """A tensor as the plain tensors that hold its bytes (a tensor subclass: its inner tensors)."""
    if type(v) in (torch.Tensor, nn.Parameter) or not hasattr(v, "__tensor_flatten__"):
        return [v]  # type: ignore[list-item]
    names, _ = v.__tensor_flatten__()  # type: ignore[attr-defined]
    return [getattr(v, n) for n in names] + [getattr(v, a) for a in ("scaler_mean", "nf4") if hasattr(v, a)]


def same(a: object, b: object) -> bool:
    """Bitwise equal: type family, dtype, shape and bytes of every part."""
    from blockshard.runtime.quantized._tensor import byte_view

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if (a.dtype, tuple(a.shape), len(_parts(a))) != (b.dtype, tuple(b.shape), len(_parts(b))):
        return False
    return all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(byte_view(x.detach().contiguous()), byte_view(y.detach().contiguous()))
        for x, y in zip(_parts(a), _parts(b), strict=True)
    )


def differences(got: dict, want: dict) -> list[str]:
    """Names whose entries differ, and names only one side has."""
    out = [f"only sharded: {k}" for k in got if k not in want] + [f"only unsharded: {k}" for k in want if k not in got]
    return out + [k for k in want if k in got and not same(got[k], want[k])]


def reference(kind: str, **quant) -> dict[str, torch.Tensor]:
    return {k: copy.deepcopy(v.detach()) for k, v in build(kind, **quant).state_dict().items()}


def _quantized_groups(model: nn.Module) -> list:
    from blockshard.runtime.core._state import state_of
    from blockshard.runtime.quantized._frozen import frozen_buffers

    return [frozen_buffers(st) for m in model.modules() if (st := state_of(m)) and frozen_buffers(st)]


def corrupt(model: nn.Module) -> None:
    """Overwrite every quantized segment (payload and scales) with other bytes."""
    with torch.no_grad():
        for q in _quantized_groups(model):
            q.local.copy_(
                torch.randint(0, 256, q.local.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
            )


def entries(rank: int, world: int, kind: str, **quant) -> dict:
    """``model.state_dict()`` and ``full_state_dict`` of the sharded model against the unsharded one,
    and ``load_state_dict`` of full entries and of pieces after the segments were overwritten."""
    import blockshard
    from blockshard.runtime import PieceTensor

    want = reference(kind, **quant)
    model = shard(build(kind, **quant), kind)
    local = {n: tuple(p.shape) for n, p in model.named_parameters()}  # what state_dict() held before: pieces
    sd = model.state_dict()
    pieces = {k: v for k, v in sd.items() if isinstance(v, PieceTensor)}
    saved_pieces = copy.deepcopy(sd)
    full = blockshard.full_state_dict(model)
    out: dict = {
        "full_differs": differences(full, want),
        "full_keys_in_order": list(full) == list(want),
        "piece_shapes": {k: tuple(v.shape) for k, v in pieces.items()},
        "local_shapes": local,
        # plain tensors (torchao's subclass is one entry unsharded, its inner tensors sharded)
        "want_shapes": {k: tuple(v.shape) for k, v in want.items() if type(v) is torch.Tensor},
        "full_tensor_equal": all(
            same(v.full_tensor(), full[k]) for k, v in pieces.items() if k in full and type(full[k]) is torch.Tensor
        ),
    }
    corrupt(model)
    out["corrupted_differs"] = bool(differences(blockshard.full_state_dict(model), want))  # the control
    model.load_state_dict(full)
    out["after_full_load"] = differences(blockshard.full_state_dict(model), want)
    corrupt(model)
    model.load_state_dict(saved_pieces)
    out["after_piece_load"] = differences(blockshard.full_state_dict(model), want)
    return out


def dcp_save(rank: int, world: int, kind: str, path: str, checkpoint: bool = False, **quant) -> dict:
    import torch.distributed.checkpoint as dcp

    import blockshard

    model = shard(build(kind, **quant), kind)
    if checkpoint:
        blockshard.save_checkpoint(model, path)
    else:
        dcp.save(model.state_dict(), checkpoint_id=path)
    return {}


def dcp_load(rank: int, world: int, kind: str, path: str, checkpoint: bool = False, **quant) -> dict:
    """Load a checkpoint into a model whose quantized bytes were overwritten: the unsharded model's
    state dict again (and the forward's output)."""
    import torch.distributed.checkpoint as dcp

    import blockshard

    want = reference(kind, **quant)
    model = shard(build(kind, **quant), kind)
    corrupt(model)
    corrupted = bool(differences(blockshard.full_state_dict(model), want))
    if checkpoint:
        blockshard.load_checkpoint(model, path)
    else:
        state = model.state_dict()
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state)
    return {"corrupted_differs": corrupted, "after_load": differences(blockshard.full_state_dict(model), want)}


def export(rank: int, world: int, kind: str, path: str, **quant) -> dict:
    """``blockshard.save_pretrained`` of the sharded model: on rank 0 what the files hold against
    the unsharded model's state dict (bitsandbytes' serialization keys), or the error."""
    import json
    import os

    from safetensors.torch import load_file

    import blockshard

    want = reference(kind, **quant)
    model = shard(build(kind, **quant), kind)
    try:
        blockshard.save_pretrained(model, path)
    except ValueError as e:
        return {"error": str(e), "files": sorted(os.listdir(path)) if os.path.isdir(path) else []}
    if rank != 0:
        return {}
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    got: dict = {}
    for file in sorted(files):
        got |= load_file(os.path.join(path, file))
    return {
        "differs": [k for k in got if k not in want or not same(got[k], want[k])],
        "not_written": sorted(k for k in want if k not in got),
        "quantized_keys": sorted(k for k in got if ".weight." in k or k.endswith("weight_scale_inv")),
    }


def spawned(rank: int, world: int, what: str, kind: str, path: str, checkpoint: bool, quant: tuple) -> dict:
    """Spawned ranks (positional arguments only): :func:`dcp_save` or :func:`dcp_load` with ``quant``
    given as ``(name, value)`` pairs, dtypes by name."""
    kwargs = {k: getattr(torch, v) if k == "quant_storage" else v for k, v in quant}
    return (dcp_save if what == "save" else dcp_load)(rank, world, kind, path, checkpoint, **kwargs)


def torch_helpers(rank: int, world: int, kind: str) -> dict:
    """torch's ``get_model_state_dict`` (sharded and ``full_state_dict=True``) and
    ``set_model_state_dict`` of the full one into overwritten segments."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    import blockshard

    want = reference(kind)
    model = shard(build(kind), kind)
    sharded = get_model_state_dict(model)
    full_options = StateDictOptions(full_state_dict=True)
    full = get_model_state_dict(model, options=full_options)
    corrupt(model)
    set_model_state_dict(model, full, options=full_options)
    return {
        "sharded_keys": list(sharded) == list(model.state_dict()),
        "full_differs": differences(full, want),
        "after_set": differences(blockshard.full_state_dict(model), want),
    }


def after_forward(rank: int, world: int) -> dict:
    """``model.state_dict()`` before and after a forward with ``reshard_after_forward=False`` (the
    layers stay gathered): the same entries; ``full_state_dict`` still the unsharded model's."""
    import blockshard
    from blockshard.runtime import PieceTensor

    want = reference("bnb")
    model = build("bnb")
    for layer in model.model.layers:
        blockshard.fully_shard(layer, reshard_after_forward=False)
    blockshard.fully_shard(model)

    def described() -> dict:
        return {
            k: (type(v).__name__, tuple(v.shape), v.dtype, (v.to_local() if isinstance(v, PieceTensor) else v).clone())
            for k, v in model.state_dict().items()
        }

    before = described()
    model(input_ids=torch.ones(1, 8, dtype=torch.long))  # float parameters train: a backward may follow
    gathered = type(model.model.layers[0].self_attn.q_proj.weight).__name__
    after = described()
    return {
        "gathered": gathered,
        "changed": [k for k in before if before[k][:3] != after[k][:3] or not same(before[k][3], after[k][3])],
        "keys_equal": list(before) == list(after),
        "full_differs": differences(blockshard.full_state_dict(model), want),
    }


def blockshard_state_dicts(rank: int, world: int, kind: str, **quant) -> dict:
    """``blockshard.sharded_state_dict`` holds the quantized entries ``model.state_dict()`` has (this
    rank's piece of every stream); ``load_sharded_state_dict`` of it and ``load_full_state_dict`` of the
    unsharded model's state dict (what ``full_state_dict`` gives at any world size) restore overwritten
    segments bitwise. Loading a whole stream as this rank's piece, or a state without an entry, raises."""
    import blockshard
    from blockshard.runtime import PieceTensor
    from blockshard.runtime.checkpoint._state_dict import LocalShard

    want = reference(kind, **quant)
    model = shard(build(kind, **quant), kind)
    pieces = {k: v for k, v in model.state_dict().items() if isinstance(v, PieceTensor)}
    sharded = copy.deepcopy(blockshard.sharded_state_dict(model))
    out: dict = {
        "missing": sorted(k for k in pieces if k not in sharded),
        "same_pieces": all(
            (sharded[k].start, sharded[k].global_shape) == (v.local_start, tuple(v.shape))
            and same(sharded[k].tensor.reshape(-1), v.to_local().reshape(-1))  # floats: their block shape
            for k, v in pieces.items()
            if k in sharded and v.is_run
        ),
        "orders": {sharded[k].order for k, v in pieces.items() if k in sharded and not v.is_run},
    }
    corrupt(model)
    out["corrupted_differs"] = bool(differences(blockshard.full_state_dict(model), want))  # the control
    blockshard.runtime.load_sharded_state_dict(model, sharded)
    out["after_sharded_load"] = differences(blockshard.full_state_dict(model), want)
    corrupt(model)
    blockshard.runtime.load_full_state_dict(model, want)
    out["after_full_load"] = differences(blockshard.full_state_dict(model), want)
    payload = "model.layers.0.self_attn.q_proj.weight" if kind == "bnb" else "layers.0.weight"  # a quantized one
    whole = dict(sharded) | {payload: LocalShard(pieces[payload].full_tensor(), 0, sharded[payload].global_shape)}
    partial = {k: v for k, v in want.items() if k != payload}
    errors = []
    for call, state in (
        (blockshard.runtime.load_sharded_state_dict, whole),
        (blockshard.runtime.load_full_state_dict, partial),
    ):
        try:
            call(model, state)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return out | {"payload": payload, "errors": errors}


def record(rank: int, world: int, kind: str, path: str) -> dict:
    """``blockshard.save_checkpoint``'s record of the quantized groups against the groups' layouts."""
    import blockshard

    model = shard(build(kind), kind)
    blockshard.save_checkpoint(model, path)
    return {
        "layouts": [
            (
                q.layout.layout_hash(),
                q.layout.segment_bytes,
                [[(p.unit_start, p.unit_stop) for p in ps] for ps in q.layout.pieces],
            )
            for q in _quantized_groups(model)
        ],
        "pieces": {
            k: (v.local_start, v.to_local().numel()) for k, v in model.state_dict().items() if hasattr(v, "local_start")
        },
    }
