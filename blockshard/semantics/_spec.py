"""``TensorSpec``: what the pure layers know about a tensor (shape, dtype, where it lives).

The planner never needs a real tensor: a ``TensorSpec`` carries the shape and dtype plus the
facts that semantics rules match on (module type, tensor type, the optimizer's ``param_group``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Union

from blockshard._errors import ShapesError
from blockshard._limits import MAX_TENSOR_NUMEL, big_number

if TYPE_CHECKING:  # the pure layers never import torch at run time
    import torch

__all__ = ["DTYPE_ITEMSIZE", "DTypeLike", "TensorSpec", "itemsize_of", "normalize_dtype"]

#: What ``TensorSpec(dtype=...)`` accepts: a torch dtype name or alias (``"bf16"``) or a ``torch.dtype``.
DTypeLike = Union[str, "torch.dtype"]

# Bytes per element of the dtypes the planner knows, by their torch names (read-only).
DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType(
    {
        "float64": 8,
        "float32": 4,
        "bfloat16": 2,
        "float16": 2,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "int64": 8,
        "int32": 4,
        "int16": 2,
        "int8": 1,
        "uint8": 1,
        "bool": 1,
    }
)
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "fp64": "float64",
        "double": "float64",
        "fp32": "float32",
        "float": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp8": "float8_e4m3fn",
    }
)


def normalize_dtype(dtype: object) -> str:
    """Return the torch name of ``dtype`` (a ``torch.dtype`` or a string such as ``"bf16"``)."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_ITEMSIZE:
        raise ShapesError(f"dtype={dtype!r} is not one the planner knows; use one of {sorted(DTYPE_ITEMSIZE)}")
    return name


def itemsize_of(dtype: object) -> int:
    return DTYPE_ITEMSIZE[normalize_dtype(dtype)]


@dataclass(frozen=True, init=False)
class TensorSpec:
    """A parameter as the pure layers see it (keyword arguments only).

    Args:
        name: fully qualified parameter name (``model.layers.0.mlp.up_proj.weight``).
        shape: the tensor's shape (any sequence of integers; stored as a tuple); the planner works on
            its row-major flattening.
        dtype: a torch dtype name or alias (``"bfloat16"``, ``"bf16"``) or a ``torch.dtype``; stored
            as the torch name (``spec.dtype`` is always a ``str`` such as ``"bfloat16"``).
        group: the ``fully_shard`` group (one layout) the tensor belongs to; ``None`` lets the caller decide.
        module_type: class name of the module holding the tensor (``"Linear"``), for module-type rules.
        tensor_type: class name of the tensor (``"Params4bit"``), for tensor-type rules.
        param_group: index of the optimizer's ``param_group``, for ``param_group`` rules.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: str | None
    module_type: str | None
    tensor_type: str | None
    param_group: int | None

    def __init__(
        self,
        *,
        name: str,
        shape: Iterable[int],
        dtype: DTypeLike = "bfloat16",
        group: str | None = None,
        module_type: str | None = None,
        tensor_type: str | None = None,
        param_group: int | None = None,
    ) -> None:
        # A hand-written __init__ because the accepted and the stored types differ (shape, dtype).
        if not isinstance(name, str) or not name:
            raise ShapesError(f"TensorSpec name={name!r} must be a non-empty string")
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            raise ShapesError(f"tensor {name!r}: shape={shape!r} must be a sequence of integers") from None
        if any(d < 0 for d in dims):
            raise ShapesError(f"tensor {name!r}: shape={dims} has a negative dimension; dims must be >= 0")
        count = math.prod(dims)
        if max(dims, default=0) > MAX_TENSOR_NUMEL or count > MAX_TENSOR_NUMEL:
            raise ShapesError(
                f"tensor {name!r}: shape={dims} has {big_number(count)} elements, more than the "
                f"{MAX_TENSOR_NUMEL:,} (2**48) one tensor may have (the largest real ones hold ~1e10); "
                "check the dims"
            )
        fields = dict(name=name, shape=dims, dtype=normalize_dtype(dtype), group=group, module_type=module_type,
                      tensor_type=tensor_type, param_group=param_group)  # fmt: skip
        for key, value in fields.items():
            object.__setattr__(self, key, value)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]
