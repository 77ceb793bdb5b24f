"""``TensorSpec``: what the pure layers know about a tensor (shape, dtype, where it lives).

The planner never needs a real tensor: a ``TensorSpec`` carries the shape and dtype plus the
facts that semantics rules match on (module type, tensor type, optimizer parameter group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from blockshard._errors import ShapesError

__all__ = ["DTYPE_ITEMSIZE", "TensorSpec", "itemsize_of", "normalize_dtype"]

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


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """A parameter as the pure layers see it.

    Args:
        name: fully qualified parameter name (``model.layers.0.mlp.up_proj.weight``).
        shape: the tensor's shape; the planner works on its row-major flattening.
        dtype: torch dtype name (``"bfloat16"``); a ``torch.dtype`` is accepted too.
        group: the group (one collective) the tensor belongs to; ``None`` lets the caller decide.
        module_type: class name of the owning module (``"Linear"``), for module-type rules.
        tensor_type: class name of the tensor (``"Params4bit"``), for tensor-type rules.
        param_group: index of the optimizer parameter group, for parameter-group rules.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    group: str | None = None
    module_type: str | None = None
    tensor_type: str | None = None
    param_group: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ShapesError(f"TensorSpec name={self.name!r} must be a non-empty string")
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError):
            raise ShapesError(f"tensor {self.name!r}: shape={self.shape!r} must be a sequence of integers") from None
        if any(d < 0 for d in shape):
            raise ShapesError(f"tensor {self.name!r}: shape={shape} has a negative dimension; dims must be >= 0")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]
