"""Block semantics from the optimizer: what each parameter's optimizer needs kept whole.

Build the ``param_groups`` you would give your optimizers *before* sharding, name the optimizer
of each one, and pass :func:`optimizer_semantics` to ``fully_shard(..., semantics=...)``; after
sharding, :func:`muon_param_groups` gives the same split over the rank's pieces::

    param_groups = muon_param_groups(model)       # Muon on hidden matrices and experts, AdamW on the rest
    semantics = optimizer_semantics(param_groups) # matched by parameter identity, not by name
    for layer in model.model.layers:
        blockshard.fully_shard(layer, semantics=semantics)
    blockshard.fully_shard(model, semantics=semantics)
    muon_group, rest = muon_param_groups(model)   # by name and global shape: this rank's pieces
    muon = blockshard.optim.Muon([muon_group], lr=0.02)  # per matrix, per expert of a stack
    adamw = torch.optim.AdamW([rest], lr=1e-3)

Matching by identity works at every level of bottom-up sharding (names there are relative to the
module being sharded, and the parameters still to be sharded are the model's own objects).
The semantics carry a compute cost used for balancing owners: Muon's
``matrix`` costs the Newton-Schulz FLOPs ``20 m^2 n + 10 m^3`` of an ``m x n`` matrix (``m <= n``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from blockshard._errors import SemanticsError
from blockshard.runtime import global_shapes, owner_plan
from blockshard.semantics import (
    TensorSpec,
    blockwise_state_semantics,
    get_semantics,
    normalize_dtype,
    tile_state_semantics,
)
from blockshard.semantics._experts import is_stacked_experts
from blockshard.semantics._rule import is_embedding_or_head

__all__ = [
    "OPTIMIZER_SEMANTICS",
    "computes_on_whole_units",
    "muon_param_groups",
    "optimizer_semantics",
    "semantics_for_optimizer",
]

#: Optimizer name -> the block semantics it needs (read-only).
OPTIMIZER_SEMANTICS: Mapping[str, str] = MappingProxyType(
    {
        "adamw": "elementwise",
        "adam": "elementwise",
        "sgd": "elementwise",
        "muon": "matrix",  # Newton-Schulz orthogonalizes the whole matrix
        "bnb8bit": "bnb8bit",  # bitsandbytes Adam8bit / AdamW8bit / ...: 256-blocks, fp32 below 4096
        "ao8bit": "ao8bit",  # torchao AdamW8bit: 256-blocks, fp32 unless >= 4096 and a multiple
        "ao4bit": "ao4bit",  # torchao AdamW4bit: 128-blocks
        "shampoo": "shampoo:1024",  # D x D preconditioner tiles -> D-row stripes
    }
)


def semantics_for_optimizer(optimizer: object) -> str:
    """The semantics string for an optimizer given by name (``"muon"``, ``"shampoo:512"``), class
    or instance (``torch.optim.Muon``, ``bitsandbytes.optim.AdamW8bit``, ``torchao.optim.AdamW8bit``,
    ``blockshard.optim.BlockedShampoo``)."""
    if isinstance(optimizer, str):
        name, _, arg = optimizer.lower().partition(":")
        if name == "shampoo" and arg:
            return f"shampoo:{arg}"
        if name in OPTIMIZER_SEMANTICS:
            return OPTIMIZER_SEMANTICS[name]
        raise SemanticsError(
            f"optimizer={optimizer!r} is not one blockshard knows; known: {sorted(OPTIMIZER_SEMANTICS)}. "
            "Pass a block semantics directly (fully_shard(..., semantics=...)) for other optimizers"
        )
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    module, name = cls.__module__, cls.__name__
    dim = optimizer.defaults.get("max_preconditioner_dim") if isinstance(optimizer, torch.optim.Optimizer) else None
    tiles = tile_state_semantics(name, dim)
    if tiles is not None:
        return tiles
    if name == "Muon":
        return "matrix"
    blockwise = blockwise_state_semantics(module, name)  # bitsandbytes / torchao 8-bit (4-bit) optimizers
    if blockwise is not None:
        return blockwise
    if module.startswith("torch.optim") and name in (
        "AdamW",
        "Adam",
        "SGD",
        "Adagrad",
        "RMSprop",
        "Adamax",
        "NAdam",
        "RAdam",
    ):
        return "elementwise"
    raise SemanticsError(
        f"optimizer {module}.{name} is not one blockshard knows; pass its block semantics directly "
        f"(fully_shard(..., semantics=...)), or one of the names {sorted(OPTIMIZER_SEMANTICS)}"
    )


def computes_on_whole_units(optimizer: object) -> bool:
    """Whether ``optimizer`` computes on units larger than an element that a piece may cut
    (``torch.optim.Muon``'s matrices, BlockedShampoo's tiles); False for optimizers blockshard does
    not know (stepped as they are)."""
    try:
        semantics = semantics_for_optimizer(optimizer)
    except SemanticsError:
        return False
    return semantics == "matrix" or semantics.startswith("shampoo")


def optimizer_semantics(param_groups: Iterable[Mapping[str, Any]]) -> Callable[[str, torch.Tensor], str | None]:
    """``(name, param) -> semantics`` for ``fully_shard``, from ``{"params": [...], "optimizer": ...}`` dicts.

    A parameter in no ``param_group`` gets ``None`` (element-wise); one in two ``param_groups``
    with different needs raises :class:`~blockshard.SemanticsError` naming both.
    """
    by_id: dict[int, str] = {}
    example = "{'params': [...], 'optimizer': 'muon'}"
    if isinstance(param_groups, (Mapping, str, torch.Tensor)) or not isinstance(param_groups, Iterable):
        raise SemanticsError(
            f"param_groups is {type(param_groups).__name__}, not a list of param_groups. Fix: pass a list of dicts "
            f"{example}, e.g. muon_param_groups(model)"
        )
    for i, group in enumerate(param_groups):
        if not isinstance(group, Mapping) or "params" not in group or "optimizer" not in group:
            keys = sorted(group) if isinstance(group, Mapping) else type(group).__name__
            raise SemanticsError(
                f"param_groups[{i}] has keys {keys}; each param_group needs 'params' and 'optimizer' (e.g. {example})"
            )
        spec = semantics_for_optimizer(group["optimizer"])
        get_semantics(spec)  # fail now on a bad semantics string, not inside fully_shard
        params = group["params"]
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            raise SemanticsError(
                f"param_groups[{i}]['params'] is {type(params).__name__}, not a list of parameters. Fix: "
                "'params': [the group's parameters], e.g. muon_param_groups(model)"
            )
        for j, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise SemanticsError(
                    f"param_groups[{i}]['params'][{j}] is {type(p).__name__}, not a parameter. Fix: list the "
                    "model's parameters themselves (matched by identity), e.g. muon_param_groups(model)"
                )
            if id(p) in by_id and by_id[id(p)] != spec:
                raise SemanticsError(
                    f"a parameter of shape {tuple(p.shape)} is in two param_groups ({by_id[id(p)]!r} "
                    f"and {spec!r}); give every parameter to one optimizer"
                )
            by_id[id(p)] = spec

    def rule(_name: str, param: torch.Tensor) -> str | None:
        return by_id.get(id(param))

    return rule


def muon_param_groups(model: nn.Module, *, other: str = "adamw", experts: bool = True) -> list[dict[str, Any]]:
    """Muon on 2-D hidden weights and stacked experts; embeddings, the output head, norms and biases to ``other``.

    Returns ``[muon_group, other_group]``, each ``{"params": [...], "param_names": [...],
    "optimizer": name}``, holding the parameter objects current in ``model`` when called. Chosen
    by parameter name, global shape and owning module's class, never by a piece's shape, so the
    split is the same before and after ``fully_shard`` (ragged engine or FSDP2), on every rank and
    every layout:

    * before sharding: the model's parameters (for :func:`optimizer_semantics`);
    * after sharding: this rank's pieces, to build the optimizers over (a rank may hold none of
      Muon's matrices: ``torch.optim.Muon([muon_group])`` takes an empty ``param_group``)::

          muon_group, rest = muon_param_groups(model)
          muon = blockshard.optim.Muon([muon_group], lr=0.02)  # torch.optim.Muon on each matrix
          adamw = torch.optim.AdamW([rest], lr=1e-3)

    [Note: experts under Muon]
    ``experts=True`` (the default) puts every **stacked expert tensor** ``(E, m, n)`` in the Muon
    group, as [Note: stacked experts] (``semantics/_experts.py``) recognises one from the model:
    3-D, and its module's class name ends in ``Experts`` (``MixtralExperts``; ``BlockShard`` /
    ``FSDP`` class swaps keep the suffix) or the module is named ``experts``. Exactly those are the
    tensors ``optimizer_semantics`` then gives per-expert ``matrix`` grids (one compute unit per
    expert's ``(m, n)`` matrix), so the split and the semantics agree. Muon computes on each
    expert's matrix: :class:`blockshard.optim.Muon` and :class:`blockshard.optim.OwnerComputeOptimizer`
    step them so; ``torch.optim.Muon`` itself takes only 2-D tensors (pass ``experts=False`` to
    leave the experts with ``other``, the behaviour before). Any other 3-D weight (a convolution's
    ``(out, in, k)``) and every 2-D tensor named ``*bias`` (GPT-OSS stacks expert biases as
    ``(E, n)``) go to ``other``.

    Under DeepSpeed ZeRO-3 (and ``deepspeed.zero.Init``) each parameter is a 1-D placeholder that
    keeps its shape as ``ds_shape``: chosen by that shape, and every one of Muon's stays in its
    group (blockshard's ZeRO-3 hook steps each matrix whole at its owner;
    :class:`~blockshard.optim.MuonWithAdamW` is built over such placeholders as over the matrices).

    An empty piece ``(0,)`` of one of Muon's tensors is left out (there is nothing to update, and
    ``torch.optim.Muon`` takes only 2-D tensors); empty pieces of the rest stay with ``other``. A
    non-empty piece of Muon's that is not its whole matrix (or whole experts) raises
    :class:`~blockshard.SemanticsError` (the model was sharded without ``matrix`` semantics),
    unless the tensor is owner-computed (``fully_shard(..., policy="owner" | "auto")``): then its
    piece, empty or not, stays in the Muon group, for :class:`blockshard.optim.Muon` or
    :class:`blockshard.optim.OwnerComputeOptimizer` (which need every rank's pieces).
    """
    _check_args(model, other, experts)
    shapes = global_shapes(model)
    owner_computed = owner_plan(model)
    groups: dict[bool, tuple[list[nn.Parameter], list[str]]] = {True: ([], []), False: ([], [])}
    for name, p in model.named_parameters():
        shape = shapes[name]
        is_muon = _is_muon(model, name, shape, p, experts)
        partitioned = getattr(p, "ds_shape", None) is not None  # DeepSpeed ZeRO-3's placeholder
        if is_muon and name not in owner_computed and not partitioned:
            if p.numel() == 0:
                continue  # another rank holds this matrix (these experts)
            _check_whole(name, shape, tuple(p.shape))
        groups[is_muon][0].append(p)
        groups[is_muon][1].append(name)
    return [
        {"params": groups[True][0], "param_names": groups[True][1], "optimizer": "muon"},
        {"params": groups[False][0], "param_names": groups[False][1], "optimizer": other},
    ]


def _check_args(model: object, other: object, experts: object) -> None:
    if not isinstance(model, nn.Module):
        raise SemanticsError(
            f"muon_param_groups(model={type(model).__name__}): model must be a torch.nn.Module. Fix: pass the "
            "model itself (the one you shard), not its parameters"
        )
    if not isinstance(other, str):
        raise SemanticsError(
            f"muon_param_groups(other={other!r}): other must be the name of the second param_group's optimizer "
            f"(a str). Fix: pass e.g. other='adamw' (known: {sorted(OPTIMIZER_SEMANTICS)})"
        )
    if not isinstance(experts, bool):
        raise SemanticsError(
            f"muon_param_groups(experts={experts!r}): experts must be True or False. Fix: experts=True gives "
            "stacked (E, m, n) experts to Muon per expert, experts=False leaves them with other"
        )


def _is_muon(model: nn.Module, name: str, shape: tuple[int, ...], p: torch.Tensor, experts: bool) -> bool:
    """Whether Muon steps parameter ``name`` (by name, global shape and its module's class)."""
    owner = _owner(model, name)
    module_type = "Embedding" if isinstance(owner, nn.Embedding) else type(owner).__name__
    spec = TensorSpec(name=name, shape=shape, dtype=normalize_dtype(p.dtype), module_type=module_type)
    if is_embedding_or_head(spec) or name.endswith("bias"):
        return False
    if len(shape) == 2:
        return True
    return experts and len(shape) == 3 and is_stacked_experts(spec)


def _check_whole(name: str, shape: tuple[int, ...], piece: tuple[int, ...]) -> None:
    """A piece of one of Muon's tensors must be its whole matrix, or whole experts ``(k, m, n)``."""
    if piece == shape or (len(shape) == 3 and len(piece) == 3 and piece[1:] == shape[1:]):
        return
    what = "matrices" if len(shape) == 2 else f"each expert's {shape[1]} x {shape[2]} matrix whole"
    raise SemanticsError(
        f"parameter {name!r} of shape {shape} is one of Muon's matrices, but this rank holds a piece "
        f"of shape {piece}: Muon must see whole {what}. Fix: shard with "
        "semantics=optimizer_semantics(muon_param_groups(model)) computed before fully_shard "
        "(or semantics='muon')" + (", or pass experts=False to leave the experts to AdamW" if len(shape) == 3 else "")
    )


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0]) if "." in param_name else model
