"""Shapes files (a JSON list of tensors) and the one entry point that loads any model description.

A shapes file describes any model without code::

    {"tensors": [
        {"name": "model.layers.0.mlp.up_proj.weight", "shape": [14336, 4096],
         "dtype": "bfloat16", "group": "model.layers.0"},
        ...
    ]}

``dtype`` is optional (default ``"bfloat16"``); a missing or ``null`` ``group`` means
:func:`~blockshard.planner._catalog.default_group` of the name. ``module_type``,
``tensor_type`` and ``param_group`` may be given too (for semantics rules); any other key is an
error, so a misspelt key does not pass silently. Other top-level keys are ignored.
"""

from __future__ import annotations

import os
from typing import Any

from blockshard._errors import ShapesError
from blockshard.planner._catalog import default_group, model_tensors, tensors_from_hf_config
from blockshard.planner._json_file import read_json_file
from blockshard.planner._units import check_model_tensors
from blockshard.semantics._spec import TensorSpec

__all__ = ["load_model_tensors", "tensors_from_shapes_file"]

_ENTRY_KEYS = ("name", "shape", "dtype", "group", "module_type", "tensor_type", "param_group")


def _entry(path: str, index: int, entry: Any) -> TensorSpec:
    where = f"shapes file {path!r}: tensors[{index}]"
    if not isinstance(entry, dict):
        raise ShapesError(
            f"{where} is a JSON {type(entry).__name__} ({entry!r}); each entry must be an object "
            'like {"name": "...", "shape": [rows, cols]}'
        )
    unknown = sorted(set(entry) - set(_ENTRY_KEYS))
    if unknown:
        raise ShapesError(f"{where} has unknown key(s) {unknown}; allowed keys: {list(_ENTRY_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ShapesError(
            f'{where}: name={name!r}; every entry needs a non-empty string "name" '
            "(the parameter's fully qualified name)"
        )
    where = f"{where} (name {name!r})"
    if "shape" not in entry:
        raise ShapesError(f'{where} has no "shape"; add it as a list of integers, e.g. [4096, 4096]')
    shape = entry["shape"]
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) for d in shape):
        raise ShapesError(f"{where}: shape={shape!r} must be a list of non-negative integers, e.g. [4096, 4096]")
    if any(d < 0 for d in shape):
        raise ShapesError(f"{where}: shape={shape!r} has a negative dimension; every dim must be >= 0")
    group = entry.get("group")
    if group is None:
        group = default_group(name)
    elif not isinstance(group, str):
        raise ShapesError(
            f'{where}: group={group!r} must be a string ("" is the root group) or be left out '
            "for the default (one group per layer)"
        )
    param_group = entry.get("param_group")
    if param_group is not None and (isinstance(param_group, bool) or not isinstance(param_group, int)):
        raise ShapesError(f"{where}: param_group={param_group!r} must be an integer or be left out")
    for key in ("module_type", "tensor_type"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise ShapesError(f"{where}: {key}={entry[key]!r} must be a string or be left out")
    try:
        return TensorSpec(
            name=name,
            shape=tuple(shape),
            dtype=entry.get("dtype") or "bfloat16",
            group=group,
            module_type=entry.get("module_type"),
            tensor_type=entry.get("tensor_type"),
            param_group=param_group,
        )
    except ShapesError as e:  # e.g. an unknown dtype: add where it came from
        raise ShapesError(f"{where}: {e}") from None


def tensors_from_shapes_file(path: str | os.PathLike[str]) -> list[TensorSpec]:
    """Read a shapes file (``{"tensors": [{"name", "shape", "dtype", "group"}, ...]}``)."""
    p = os.fspath(path)
    data = read_json_file(
        p,
        "shapes file",
        missing_fix="check the path",
        format_fix='it must hold {"tensors": [{"name": ..., "shape": [...]}, ...]}',
    )
    entries = data.get("tensors") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        got = (
            f"tensors={entries!r}"
            if isinstance(data, dict) and "tensors" in data
            else f'a JSON {type(data).__name__} without a "tensors" key'
        )
        raise ShapesError(
            f'shapes file {p!r} holds {got}; it must hold an object with a "tensors" list: '
            '{"tensors": [{"name": ..., "shape": [...]}, ...]}'
        )
    check_model_tensors(len(entries), f"shapes file {p!r}")
    if not entries:
        raise ShapesError(
            f'shapes file {p!r}: "tensors" is empty, so the model has no tensors; list at least one tensor'
        )
    tensors: list[TensorSpec] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        spec = _entry(p, i, entry)
        if spec.name in seen:
            raise ShapesError(
                f"shapes file {p!r}: tensors[{i}] repeats name {spec.name!r} of "
                f"tensors[{seen[spec.name]}]; tensor names must be unique"
            )
        seen[spec.name] = i
        tensors.append(spec)
    return tensors


def load_model_tensors(
    *,
    model: str | None = None,
    config: str | os.PathLike[str] | dict[str, Any] | None = None,
    shapes: str | os.PathLike[str] | None = None,
) -> list[TensorSpec]:
    """The parameter list from exactly one of: a catalog ``model`` name, an HF ``config``
    (``config.json`` path or dict), or a ``shapes`` file path."""
    given = {k: v for k, v in (("model", model), ("config", config), ("shapes", shapes)) if v is not None}
    if len(given) != 1:
        which = ", ".join(f"{k}={v!r}" for k, v in given.items()) or "none"
        raise ShapesError(
            f"load_model_tensors needs exactly one of model=, config=, shapes=; got {which}. "
            "Pass a catalog name (model=), a config.json path (config=) or a shapes file (shapes=)"
        )
    if model is not None:
        return model_tensors(model)
    if config is not None:
        return tensors_from_hf_config(config)
    assert shapes is not None
    return tensors_from_shapes_file(shapes)
