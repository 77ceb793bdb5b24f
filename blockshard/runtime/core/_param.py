"""One parameter of a group: where it is registered, its local piece and its unsharded view."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime.core._tp import TPSpec

__all__ = ["ManagedTag", "ParamRef", "ShardedParam", "StoredOrder", "check_plain", "managed_tag", "tag_managed"]

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


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
    # for an original: what replaced it, in the optimizer guard's message (None: fully_shard)
    replaced_by: str | None = None


_TAG_ATTR = "_blockshard_managed"


def tag_managed(
    param: nn.Parameter,
    group_name: str,
    *,
    original: bool = False,
    process_group: object = None,
    group: object = None,
    replaced_by: str | None = None,
) -> None:
    setattr(param, _TAG_ATTR, ManagedTag(group_name, original, process_group, group, replaced_by))


def managed_tag(param: torch.Tensor) -> ManagedTag | None:
    tag = getattr(param, _TAG_ATTR, None)
    return tag if isinstance(tag, ManagedTag) else None


class StoredOrder(Protocol):
    """How a parameter stored in another order than row-major lays out its values in the layout
    (``quantized/_tile_major.PackedTileOrder``: a master in packed tile order). Its layout tensor
    has ``numel`` elements, cut only between units of ``unit_numel``; pieces are runs of units."""

    @property
    def numel(self) -> int: ...
    @property
    def unit_numel(self) -> int: ...
    @property
    def name(self) -> str: ...
    def boxes(self, first: int, stop: int) -> Boxes: ...
    def put(self, dst: torch.Tensor, run: torch.Tensor, first: int) -> None: ...
    def take(self, src: torch.Tensor, first: int, stop: int) -> torch.Tensor: ...
    def take_into(self, out: torch.Tensor, src: torch.Tensor, first: int) -> None: ...
    def to_boxes(self, run: torch.Tensor, first: int) -> torch.Tensor: ...
    def from_boxes(self, boxed: torch.Tensor, first: int, stop: int) -> torch.Tensor: ...


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
    # None: stored row-major (``local_start`` and ``local_numel`` are elements of the row-major
    # flattening); else the order its layout tensor holds (a master in packed tile order: they count
    # elements of that order, the sharded view is 1-D and the unsharded one the first ``numel``
    # elements of its gathered range, row-major)
    order: StoredOrder | None = None
    # a tensor-parallel parameter ([Note: tensor-parallel parameters] in _tp.py): its DTensor's mesh,
    # placements and global shape; ``shape`` and the pieces are its TP-local tensor's, ``unsharded``
    # the DTensor over the gathered local tensor
    tp: TPSpec | None = None
    # the unsharded parameter watched and its AccumulateGrad node (held: a node nobody holds is
    # made anew at the next forward, without the hook)
    _watched: tuple[nn.Parameter, object] | None = field(default=None, repr=False)

    def watch_grad(self, arrival: Callable[[ShardedParam], None]) -> None:
        """Call ``arrival(self)`` (a bound method) just before autograd accumulates a gradient into
        ``unsharded``: a pre-hook of its ``AccumulateGrad`` node, once per parameter object (a frozen
        one gets no gradient and no hook)."""
        if (self._watched is not None and self._watched[0] is self.unsharded) or not self.unsharded.requires_grad:
            return
        # weak references: the hook lives in autograd's C++ state, where a cycle back to this object
        # (which holds the parameter) would be invisible to the garbage collector
        me, call = weakref.ref(self), weakref.WeakMethod(arrival)

        def pre_accumulate_grad(_grads: tuple[torch.Tensor | None, ...]) -> None:
            sp, fn = me(), call()
            if sp is not None and fn is not None:
                fn(sp)

        node = torch.autograd.graph.get_gradient_edge(self.unsharded).node
        node.register_prehook(pre_accumulate_grad)
        self._watched = (self.unsharded, node)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_numel(self) -> int:
        """Elements of its layout tensor (``numel`` but for a parameter stored in another order)."""
        return self.numel if self.order is None else self.order.numel

    def units(self) -> tuple[int, int]:
        """The units ``[first, stop)`` of ``order`` this rank holds (only for a parameter with one)."""
        assert self.order is not None, self.fqn
        u = self.order.unit_numel
        return self.local_start // u, (self.local_start + self.local_numel) // u

    def piece_boxes(self) -> Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None:
        """The boxes of the parameter this rank's piece fills (None: a row-major run from ``local_start``)."""
        return None if self.order is None else self.order.boxes(*self.units())

    def to_boxed(self, piece: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as this rank's piece (its values, a gradient, element-wise optimizer
        state) as the values of :meth:`piece_boxes`, each box row-major (1-D); itself, row-major."""
        if self.order is None:
            return piece
        return self.order.to_boxes(piece.reshape(-1), self.units()[0])

    def from_boxed(self, boxed: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_boxed`, in the sharded parameter's shape."""
        if self.order is None:
            return boxed.reshape(self.sharded.shape)
        return self.order.from_boxes(boxed.reshape(-1), *self.units())

    @property
    def entry_shape(self) -> tuple[int, ...]:
        """The shape of its state-dict entries: the global one (a TP parameter's DTensor's shape)."""
        return self.tp.shape if self.tp is not None else self.shape

    def entry_boxes(self) -> Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None:
        """The boxes of the entry's global tensor this rank's piece fills (None: a row-major run from
        ``local_start``): a stored order's, or a TP piece's, shifted to its TP-local tensor's place."""
        if self.tp is None:
            return self.piece_boxes()
        assert self.order is None, self.fqn  # refused together at fully_shard (quantized_gather)
        return self.tp.boxes(self.shape, self.local_start, self.local_numel)

    def piece_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole parameter ``full`` (its entry shape), in the sharded shape."""
        if self.tp is not None and tuple(full.shape) == self.tp.shape:
            full = self.tp.local_of(full, self.shape)
        flat = full.reshape(-1)
        if self.order is None:
            return flat[self.local_start : self.local_start + self.local_numel].view(self.sharded.shape)
        return self.order.take(flat, *self.units())

    def full_of_stored(self, stored: torch.Tensor) -> torch.Tensor:
        """The whole parameter (its shape, new) from its whole layout tensor ``stored`` [stored_numel]."""
        if self.order is None:
            return stored.view(self.shape).clone()
        out = stored.new_zeros(self.shape)
        self.order.put(out.view(-1), stored, 0)
        return out

    def local_grad(self) -> torch.Tensor | None:
        """The unsharded gradient as a plain tensor of ``shape`` (a TP parameter's DTensor gradient: its
        local tensor, in the parameter's placements)."""
        grad = self.unsharded.grad
        return grad if grad is None or self.tp is None else self.tp.local_grad(grad)

    def set_module_params(self, param: nn.Parameter) -> None:
        for ref in self.refs:
            ref.set(param)


def check_plain(name: str, p: nn.Parameter) -> None:
    """The engine shards plain tensors: a tensor subclass (TwoTensor, a tensor with FSDP2's
    ``fsdp_pre_all_gather`` extension) would be flattened into the local buffer and lose what it
    holds besides its values. The quantized ones blockshard knows (bitsandbytes ``Params4bit``,
    torchao ``NF4Tensor``) were collected before and never get here; a tensor-parallel DTensor
    arrives as its local tensor ([Note: tensor-parallel parameters] in _tp.py)."""
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
