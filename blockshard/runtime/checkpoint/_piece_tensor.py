"""``PieceTensor``: what ``model.state_dict()`` holds for a sharded parameter.

[Note: state dict entries]
FSDP2's ``model.state_dict()`` returns DTensors: tensors of the *global* shape that hold only the
rank's shard and tell DCP (``torch.distributed.checkpoint``) where it lies. A DTensor cannot say
"elements [start, start + n) of the row-major flattening" (its ``Shard(0)`` cuts whole rows, evenly
up to the last rank), which is what a ragged piece is. So a sharded parameter's entry is a
:class:`PieceTensor`, a wrapper subclass of ``torch.Tensor`` in the same spirit: ``shape``, ``dtype``
and ``device`` are the parameter's global ones (so ``sd[name].shape`` is what an unsharded model
reports, and DCP's size checks pass), it holds this rank's piece (``to_local()``, a view of the
engine's local buffer, as FSDP2's entries view their parameters), and it speaks DCP's
checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``, torch 2.13 ``planner_helpers.py`` / ``utils.py``) by describing the
piece as n-D boxes of the global tensor (:func:`flat_run_boxes`; veScale-FSDP does the same).
DCP then reshards by itself: a checkpoint saved at W loads at any W' and into other semantics,
because every rank asks for the boxes of *its* piece and DCP reads the overlaps.

It is not a general tensor: arithmetic on it raises :class:`PieceTensorError` naming the ways to
get values (``to_local()``, ``blockshard.full_state_dict(model)``). Only what state-dict tools do
to entries works: ``detach``, ``clone`` / ``copy.deepcopy``, ``.to(device or dtype)`` /
``.cpu()`` (DCP's ``cpu_offload``), pickling (``torch.save`` keeps the piece and its place), the
in-place writes FSDP2 code does to DTensor entries (``fill_``, ``zero_``, ``copy_`` from the same
piece, a whole tensor of the global shape or a scalar: each writes this rank's piece, so on an
entry of ``model.state_dict()`` it writes the parameter, as on FSDP2's) and ``full_tensor()``
(collective: gathers the whole tensor, as ``DTensor.full_tensor()``).
Parameters outside any group stay plain tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, SupportsIndex

import torch

from blockshard._arith import run_boxes
from blockshard._errors import PieceTensorError, ShardingError
from blockshard.runtime.core._collectives import agree, all_gather_into
from blockshard.runtime.core._param import managed_tag

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["Box", "PieceTensor", "PieceTensorError", "entry_group", "flat_run_boxes", "param_entry"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Box:
    """An n-D box of a tensor: ``offsets`` and ``sizes`` per dim, and where its elements start
    within the flat run it was cut from (``run_offset``; the box is contiguous in row-major order)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    run_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes, strict=True))


def flat_run_boxes(shape: tuple[int, ...], start: int, numel: int) -> list[Box]:
    """The n-D boxes that make up elements ``[start, start + numel)`` of the row-major flattening
    of a tensor of ``shape``: at most ``2 * ndim - 1`` (three for a matrix: the end of a partial
    first row, the whole rows, the start of a partial last row), none for an empty run."""
    if start < 0 or numel < 0 or start + numel > math.prod(shape):
        raise AssertionError(f"run [{start}, {start + numel}) outside a tensor of shape {shape}")
    boxes, pos = [], 0
    for offsets, sizes in run_boxes(tuple(shape), start, start + numel):
        boxes.append(Box(offsets, sizes, pos))
        pos += math.prod(sizes)
    return boxes


def _rebuild(
    local: torch.Tensor, start: int, shape: tuple[int, ...], name: str, boxes: list[Any] | None = None
) -> PieceTensor:
    """Unpickling: the piece again (``torch.save`` of an entry)."""
    return PieceTensor(local, start, shape, name, boxes=boxes)


class PieceTensor(torch.Tensor):
    """A tensor of a parameter's global shape of which this rank holds one flat piece.

    See [Note: state dict entries]. ``to_local()`` is the piece (1-D, ``local_numel`` elements,
    a view of the engine's buffer when the entry comes from ``model.state_dict()``),
    ``local_start`` its first element in the row-major flattening, ``boxes`` the same piece as
    n-D boxes of the global tensor. Made with ``boxes`` (``(offsets, sizes)`` pairs), the piece is
    those boxes, each row-major, one after another in ``to_local()`` (a tile-placed weight's whole
    tiles, [Note: tile placement in the engine]); ``local_start`` is then -1.
    """

    _local: torch.Tensor
    _start: int
    _boxes: tuple[Box, ...]
    _name: str
    _process_group: Any

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        start: int,
        shape: tuple[int, ...],
        name: str = "",
        *,
        process_group: Any = None,
        boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ) -> PieceTensor:
        local = local.detach().reshape(-1)
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        self._local, self._start, self._name = local, int(start) if boxes is None else -1, name
        self._process_group = process_group  # over which the pieces are spread (None: the default group)
        if boxes is not None:
            at, made = 0, []
            for offsets, sizes in boxes:
                made.append(Box(tuple(offsets), tuple(sizes), at))
                at += math.prod(sizes)
            if at != local.numel():
                raise AssertionError(f"boxes of {at} elements for a piece of {local.numel()}")
            self._boxes = tuple(made)
        elif math.prod(shape) == 0:  # every rank names the empty tensor (DCP keeps one), so it is saved
            self._boxes = (Box(tuple(0 for _ in shape), tuple(shape), 0),)
        else:
            self._boxes = tuple(flat_run_boxes(tuple(shape), self._start, local.numel()))
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Callable[..., Any],
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        x = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return x._like(x._local)
        if func in (aten.clone.default, aten._to_copy.default):
            return x._like(func(x._local, *args[1:], **kwargs))
        if func in (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default):  # the piece's elements
            func(x._local, *args[1:], **kwargs)
            return x
        if func is aten.copy_.default:
            x._local.copy_(x._piece_of(args[1]))
            return x
        raise PieceTensorError(
            f"{func} on the state-dict entry {x._name or 'of a sharded parameter'} (global shape "
            f"{tuple(x.shape)}): it is a blockshard PieceTensor that holds only this rank's piece "
            f"{x._where}{' of the row-major flattening' if x.is_run else ''}. Save and load it with "
            "torch.distributed.checkpoint (dcp.save / dcp.load), take the piece with .to_local(), or get full "
            "tensors with blockshard.full_state_dict(model)"
        )

    def _piece_of(self, src: object) -> torch.Tensor:
        """What ``copy_(src)`` writes into this piece: the same piece of another entry, this
        piece's elements of a whole tensor of the global shape, or a scalar."""
        if isinstance(src, PieceTensor):
            if (src._start, src._local.numel(), tuple(src.shape), src._boxes) == (
                self._start,
                self._local.numel(),
                tuple(self.shape),
                self._boxes,
            ):
                return src._local
        elif isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(self.shape) and not self.is_run:
            return torch.cat([src.detach().reshape(-1)[:0], *(src.detach()[b.slices].reshape(-1) for b in self._boxes)])
        elif isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(self.shape):
            return src.detach().reshape(-1)[self._start : self._start + self._local.numel()]
        elif isinstance(src, torch.Tensor) and src.numel() == 1:
            return src.detach().reshape(())
        described = (
            repr(src) if isinstance(src, PieceTensor) else f"a tensor of shape {tuple(getattr(src, 'shape', ()))}"
        )
        raise PieceTensorError(
            f"copy_ into the state-dict entry {self._name or 'of a sharded parameter'} (global shape "
            f"{tuple(self.shape)}, piece {self._where}) from {described}: "
            "the source must be the same piece of the same tensor, a whole tensor of the global shape or a "
            "scalar. Fix: copy from an entry of the same model's state_dict(), or from full tensors "
            "(blockshard.full_state_dict(model)); load other layouts with torch.distributed.checkpoint"
        )

    def _like(self, local: torch.Tensor) -> PieceTensor:
        """The same piece of the same tensor holding ``local``."""
        boxes = None if self.is_run else [(b.offsets, b.sizes) for b in self._boxes]
        return PieceTensor(
            local, self._start, tuple(self.shape), self._name, process_group=self._process_group, boxes=boxes
        )

    @property
    def is_run(self) -> bool:
        """Whether the piece is one run of the row-major flattening (else boxes given at construction)."""
        return self._start >= 0

    @property
    def _where(self) -> str:
        if self.is_run:
            return f"[{self._start}, {self._start + self._local.numel()})"
        return f"of {len(self._boxes)} boxes {[(b.offsets, b.sizes) for b in self._boxes[:3]]}{'...' if len(self._boxes) > 3 else ''}"

    # -- what a ragged piece is ---------------------------------------------------------------
    def to_local(self) -> torch.Tensor:
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, gathered from every rank's piece (collective over the ranks the
        pieces are spread over, as ``DTensor.full_tensor()``): two all-gathers, the pieces'
        places and their values padded to the largest piece."""
        import torch.distributed as dist

        numel = math.prod(self.shape)
        if not dist.is_initialized():
            if self._local.numel() != numel:
                raise PieceTensorError(self._needs_whole("full_tensor() without a process group"))
            if self.is_run:
                return self._local.clone().view(self.shape)
            whole = torch.empty(tuple(self.shape), dtype=self.dtype, device=self.device)
            for box in self._boxes:
                whole[box.slices] = self._box_view(box)
            return whole
        pg: Any = self._process_group or dist.group.WORLD
        W = dist.get_world_size(pg)
        agree(pg, f"PieceTensor.full_tensor() of a {tuple(self.shape)} {str(self.dtype).removeprefix('torch.')} tensor")
        places = torch.empty(3 * W, dtype=torch.int64, device=self.device)
        mine = torch.tensor([self._start, self._local.numel(), len(self._boxes)], dtype=torch.int64, device=self.device)
        all_gather_into(places, mine, pg)
        starts, numels, n_boxes = places[0::3].tolist(), places[1::3].tolist(), places[2::3].tolist()
        boxes = self._gather_boxes(pg, W, max(n_boxes)) if min(starts) < 0 else None
        most = max(numels)
        wire = torch.uint8 if self.dtype.itemsize == 1 else self.dtype  # float8 as bytes (gloo has no float8)
        padded = torch.zeros(most, dtype=wire, device=self.device)
        padded[: self._local.numel()] = self._local.view(wire)
        values = torch.empty(W * most, dtype=wire, device=self.device)
        all_gather_into(values, padded, pg)
        values = values.view(self.dtype)
        if sum(numels) != numel:
            raise PieceTensorError(
                f"full_tensor() of {self._name or 'a PieceTensor'} (shape {tuple(self.shape)}): the ranks' pieces "
                f"hold {sum(numels)} of its {numel} elements (pieces {list(zip(starts, numels, strict=True))}). "
                "Fix: call it on the entries of one state dict on every rank of the model's process group"
            )
        full = torch.empty(numel, dtype=self.dtype, device=self.device)
        for r, (a, n) in enumerate(zip(starts, numels, strict=True)):
            if boxes is None:
                full[a : a + n] = values[r * most : r * most + n]
                continue
            for box in boxes[r][: n_boxes[r]]:
                at = r * most + box.run_offset
                full.view(self.shape)[box.slices] = values[at : at + box.numel].view(box.sizes)
        return full.view(self.shape)

    def _gather_boxes(self, pg: Any, W: int, most: int) -> list[list[Box]]:
        """Every rank's boxes (one all-gather of their offsets and sizes, padded to ``most`` boxes)."""
        d = len(self.shape)
        mine = torch.zeros(most * 2 * d, dtype=torch.int64, device=self.device)
        if self._boxes and d:
            mine[: len(self._boxes) * 2 * d] = torch.tensor([[*b.offsets, *b.sizes] for b in self._boxes]).reshape(-1)
        got = torch.empty(W * most * 2 * d, dtype=torch.int64, device=self.device)
        all_gather_into(got, mine, pg)
        out = []
        for row in got.view(W, most, 2 * d).tolist():
            at, boxes = 0, []
            for enc in row:
                box = Box(tuple(enc[:d]), tuple(enc[d:]), at)
                boxes.append(box)
                at += box.numel
            out.append(boxes)
        return out

    @property
    def local_start(self) -> int:
        return self._start

    @property
    def boxes(self) -> tuple[Box, ...]:
        return self._boxes

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        end = self._start + self._local.numel()
        piece = f"piece=[{self._start}, {end}), " if self.is_run else ""
        return (
            f"PieceTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {piece}"
            f"boxes={[(b.offsets, b.sizes) for b in self._boxes]})"
        )

    # Writers of whole tensors (safetensors, HF ``save_pretrained``) read storages: refuse by name.
    def untyped_storage(self) -> NoReturn:
        raise PieceTensorError(self._needs_whole("its storage"))

    def storage(self) -> NoReturn:
        raise PieceTensorError(self._needs_whole("its storage"))

    def data_ptr(self) -> int:
        raise PieceTensorError(self._needs_whole("its data pointer"))

    def _needs_whole(self, what: str) -> str:
        return (
            f"{what} was asked of the state-dict entry {self._name or 'of a sharded parameter'} (global shape "
            f"{tuple(self.shape)}), a blockshard PieceTensor that holds only this rank's piece "
            f"{self._where}: writing it would save one rank's piece as the "
            "whole tensor. Fix: export full tensors with blockshard.full_state_dict(model) (collective: every rank "
            "calls it), e.g. model.save_pretrained(path, state_dict=blockshard.full_state_dict(model), "
            "is_main_process=rank == 0), or stream it with blockshard.save_pretrained(model, path) (one group at a "
            "time); or checkpoint with torch.distributed.checkpoint (dcp.save(model.state_dict())); a peft "
            "adapter only: model.save_pretrained(path, state_dict=blockshard.peft_state_dict(model), "
            "is_main_process=rank == 0)"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> PieceTensor:
        if id(self) not in memo:
            memo[id(self)] = self._like(self._local.clone())
        copied: PieceTensor = memo[id(self)]
        return copied

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Callable[..., PieceTensor], tuple[Any, ...]]:
        boxes = None if self.is_run else [(b.offsets, b.sizes) for b in self._boxes]
        return (_rebuild, (self._local, self._start, tuple(self.shape), self._name, boxes))

    # -- DCP's checkpointable protocol ---------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for b in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in self._boxes]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        hint = index.index
        if hint is not None and hint < len(self._boxes) and self._boxes[hint].offsets == tuple(index.offset):
            return self._box_view(self._boxes[hint])
        for b in self._boxes:
            if b.offsets == tuple(index.offset or ()):
                return self._box_view(b)
        raise ValueError(f"{index.fqn!r}: this rank holds no box at offsets {index.offset} (boxes {self._boxes})")

    def _box_view(self, box: Box) -> torch.Tensor:
        return self._local[box.run_offset : box.run_offset + box.numel].view(box.sizes)


def entry_group(sp: Any, process_group: Any) -> Any:
    """The process group a parameter's entries are spread over: the one it is sharded over, or for a
    tensor-parallel parameter every rank (dp x tp must be all of them; [Note: tensor-parallel
    parameters])."""
    if sp.tp is None:
        return process_group
    import torch.distributed as dist

    tag = managed_tag(sp.sharded)
    buffers = tag.group() if tag is not None and callable(tag.group) else None
    replicas = buffers.replicate_group if buffers is not None else None  # HSDP: replicas hold the same pieces
    dp, tp, world = dist.get_world_size(process_group), sp.tp.mesh.size(), dist.get_world_size()
    rep = dist.get_world_size(replicas) if replicas is not None else 1
    if rep * dp * tp != world:
        raise ShardingError(
            f"parameter {sp.fqn!r} is tensor-parallel over {tp} ranks and sharded over {rep} x {dp}, but the world "
            f"has {world} ranks: blockshard's state-dict entries of TP parameters are spread over every rank, so "
            "the (dp, tp) mesh must span the world. Fix: checkpoint a model whose mesh is the whole world"
        )
    return None


def param_entry(sp: Any, values: torch.Tensor, name: str, process_group: Any) -> PieceTensor:
    """The state-dict entry of parameter ``sp`` (a ``ShardedParam``) holding ``values`` (a tensor of
    its piece's shape: the piece, or its element-wise optimizer state): the entry's global shape,
    and this rank's piece as a run of it or as boxes (a stored order's tiles, a TP piece's place)."""
    return PieceTensor(
        sp.to_boxed(values),
        sp.local_start,
        sp.entry_shape,
        name=name,
        process_group=entry_group(sp, process_group),
        boxes=sp.entry_boxes(),
    )
