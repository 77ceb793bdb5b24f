"""One parameter of a group: where it is registered, its local piece and its unsharded view."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from blockshard._errors import ShardingError

__all__ = ["ManagedTag", "ParamRef", "ShardedParam", "check_plain", "managed_tag", "tag_managed"]


@dataclass(frozen=True)
class ParamRef:
    """A place the parameter is registered: ``module._parameters[attr]`` (tied weights have several)."""

    module: nn.Module
    attr: str

    def set(self, param: nn.Parameter) -> None:
        # Plain dict assignment: nn.Module.__setattr__ would reject swapping in a non-registered view.
        self.module._parameters[self.attr] = param


@dataclass(frozen=True)
class ManagedTag:
    """Marks a parameter object the engine made (a piece or a full view) or replaced (an original).

    Kept on the parameter itself (``_blockshard_managed``), so no registry outlives the objects.
    """

    group_name: str  # the group that made or replaced it (its module's class name; "owner" is a rank)
    original: bool  # True: a parameter that sharding replaced by its local piece
    # for a local piece: the process group it is sharded over (None: a full view or an original)
    process_group: object = None
    # for a local piece: a weak reference to its ParamBuffers (weak: a tag never keeps a model alive)
    group: object = None


_TAG_ATTR = "_blockshard_managed"


def tag_managed(
    param: nn.Parameter, group_name: str, *, original: bool = False, process_group: object = None, group: object = None
) -> None:
    setattr(param, _TAG_ATTR, ManagedTag(group_name, original, process_group, group))


def managed_tag(param: torch.Tensor) -> ManagedTag | None:
    tag = getattr(param, _TAG_ATTR, None)
    return tag if isinstance(tag, ManagedTag) else None


@dataclass(eq=False)
class ShardedParam:
    """A parameter managed by a group.

    ``sharded`` is what ``module.parameters()`` yields between forwards: an ``nn.Parameter``
    viewing the rank's piece of the persistent local buffer with its block shape.
    ``unsharded`` is the full parameter during forward/backward: an ``nn.Parameter`` viewing the
    gathered buffer (its storage is freed while the group is sharded).
    """

    fqn: str  # name relative to the sharded module
    refs: list[ParamRef]
    shape: tuple[int, ...]
    requires_grad: bool
    index: int  # index in the group's layout
    local_start: int = 0  # first element of the tensor held here
    local_numel: int = 0
    local_offset: int = 0  # where the piece sits in the local buffer
    gathered_offset: int = 0  # where the tensor sits in the gathered buffer
    sharded: nn.Parameter = field(init=False, repr=False)  # set by the group (views of its buffers)
    unsharded: nn.Parameter = field(init=False, repr=False)
    # micro-batch gradients summed without sync in the reduce dtype (when it is not the param dtype)
    accumulated: torch.Tensor | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def set_module_params(self, param: nn.Parameter) -> None:
        for ref in self.refs:
            ref.set(param)


def check_plain(name: str, p: nn.Parameter) -> None:
    """The engine shards plain tensors: a tensor subclass (TwoTensor, a DTensor of tensor
    parallelism, a tensor with FSDP2's ``fsdp_pre_all_gather`` extension) would be flattened into
    the local buffer and lose what it holds besides its values. The quantized ones blockshard knows
    (bitsandbytes ``Params4bit``, torchao ``NF4Tensor``) were collected before and never get here."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    extension = hasattr(p, "fsdp_pre_all_gather")  # FSDP2's own test of the extension (_fsdp_param.py)
    subclass = is_traceable_wrapper_subclass(p)
    if not (subclass or extension):
        return
    what = (", a tensor subclass" if subclass else "") + (
        " with FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather)" if extension else ""
    )

    raise ShardingError(
        f"parameter {name!r} is a {type(p).__name__}{what}; blockshard's engine shards "
        "plain tensors (and the quantized weights of bitsandbytes Params4bit and torchao NF4Tensor) and would "
        "silently drop what the subclass holds besides its values. Fix: convert it to a plain tensor before "
        "fully_shard, or leave it out with ignored_params={...} (replicated); for low-precision all-gathers "
        "pass semantics='mx' or 'fp8_block:128' with quantized_gather=True; torch's fully_shard runs the "
        "extensions"
    )
