"""peft adapters of sharded models: the entries peft saves, as full tensors, and only those.

[Note: peft adapters]
peft's ``PeftModel.save_pretrained(dir)`` (peft 0.21, ``peft_model.py``) takes what it writes from
``get_peft_model_state_dict(model, state_dict=kwargs.get("state_dict"))``, which reads
``model.state_dict()`` when no ``state_dict`` is given. On a sharded model that state dict's
entries are PieceTensors ([Note: state dict entries]), so writing them raised
:class:`~blockshard.PieceTensorError` (safetensors asks for storages); ``torch.save``
(``safe_serialization=False``) would have pickled one rank's pieces.

:func:`peft_state_dict` selects with peft's own ``get_peft_model_state_dict`` on the piece state
dict (no communication: peft selects entries by name, and the selected values are the state dict's
own objects), then gathers only the selected PieceTensors (``gather_pieces``: checked across ranks
first, then one tensor at a time), so no rank holds more than the adapters gathered, never a base
weight. Its result, keyed as ``model.state_dict()`` is, is a valid ``state_dict=`` for
``save_pretrained``: peft selects the same entries from it again by name and writes exactly what it
writes for the unsharded model (same names, dtypes and bits). A selected value that is not one of
the state dict's entries (a value peft derived from a piece) or a quantized base weight's entry
raises before anything is gathered or written. The peft route (routes/_peft.py) calls it from
``PeftModel.save_pretrained``, so ``model.save_pretrained(dir)`` works unchanged.

Loading needs no route: ``set_peft_model_state_dict`` and ``load_adapter`` (and so
``PeftModel.from_pretrained``) call ``model.load_state_dict(adapter, strict=False)`` with full
tensors, which each group's load pre-hook cuts into this rank's pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from blockshard._errors import PieceTensorError, ShardingError
from blockshard.runtime.checkpoint._export import _quantized_entries
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor
from blockshard.runtime.checkpoint._state_dict import gather_pieces
from blockshard.runtime.core._inspect import agree_on_call, checkpoint_states

__all__ = ["peft_state_dict"]


def _adapter_names(model: nn.Module, adapter_names: Sequence[str] | None, call: str) -> list[str]:
    """The adapters to select (all of ``model.peft_config``'s when ``None``), checked."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ShardingError(
            f"{call}: the model is a {type(model).__name__}, not a peft PeftModel. Fix: pass the PeftModel "
            "(what get_peft_model(...) or PeftModel.from_pretrained(...) returned), not its base model"
        )
    known = list(model.peft_config)
    names = known if adapter_names is None else list(adapter_names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ShardingError(
            f"{call}: adapters {unknown} are not adapters of this model; its adapters are {known}. "
            "Fix: pass names of model.peft_config"
        )
    return names


def _selected_keys(
    model: nn.Module, state: Mapping[str, Any], names: list[str], embeddings: bool | Literal["auto"]
) -> tuple[list[str], dict[str, set[str]]]:
    """The keys of ``state`` whose values peft saves for the adapters ``names`` (by identity: peft
    selects the state dict's own values), in ``state``'s order, and the names peft saves them
    under per adapter; raises if peft derived a piece."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    chosen = {
        name: get_peft_model_state_dict(
            model, state_dict=dict(state), adapter_name=name, save_embedding_layers=embeddings
        )
        for name in names
    }
    ids = {id(v) for entries in chosen.values() for v in entries.values()}
    keys = [k for k, v in state.items() if id(v) in ids]
    owned = {id(state[k]) for k in keys}
    for name, entries in chosen.items():  # nothing derived from a piece may reach a writer
        derived = [k for k, v in entries.items() if isinstance(v, PieceTensor) and id(v) not in owned]
        if derived:
            raise PieceTensorError(
                f"blockshard.peft_state_dict: peft's entry {derived[0]!r} of adapter {name!r} is a piece peft made "
                "from a sharded entry, not an entry of model.state_dict(), so it cannot be gathered by name. Fix: "
                "save the adapter from full tensors: model.save_pretrained(path, state_dict=blockshard.full_state_dict"
                "(model), is_main_process=rank == 0) (gathers the whole model)"
            )
    return keys, {name: set(entries) for name, entries in chosen.items()}


def _check_reselected(
    model: nn.Module, full: dict[str, Any], saved: dict[str, set[str]], embeddings: bool | Literal["auto"]
) -> None:
    """Raise unless peft, selecting from ``full`` again (as ``save_pretrained(state_dict=full)``
    does), finds full tensors under the names it found in the whole state dict."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    for name, want in saved.items():
        entries = get_peft_model_state_dict(
            model, state_dict=dict(full), adapter_name=name, save_embedding_layers=embeddings
        )
        bad = [k for k, v in entries.items() if isinstance(v, PieceTensor)]
        missing = sorted(want - set(entries))
        if bad or missing:
            raise PieceTensorError(
                f"blockshard.peft_state_dict: adapter {name!r} would be saved "
                f"{'with the piece ' + repr(bad[0]) if bad else 'without ' + repr(missing[:4])} from the gathered "
                "entries: peft builds it from other entries than it selects. Fix: save the adapter "
                "from full tensors: model.save_pretrained(path, state_dict=blockshard.full_state_dict(model), "
                "is_main_process=rank == 0) (gathers the whole model)"
            )


@torch.no_grad()
def peft_state_dict(
    model: nn.Module,
    adapter_names: Sequence[str] | None = None,
    *,
    save_embedding_layers: bool | Literal["auto"] = "auto",
    state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The entries of ``model.state_dict()`` (or of ``state_dict``) that peft's ``save_pretrained``
    saves for ``adapter_names`` (default: every adapter), each sharded one gathered to its full
    tensor on every rank (collective: every rank calls it; only those entries are gathered, never
    the base model). ``model.save_pretrained(path, state_dict=blockshard.peft_state_dict(model),
    is_main_process=rank == 0)`` writes what peft writes for the unsharded model; see
    [Note: peft adapters]."""
    call = "blockshard.peft_state_dict"
    names = _adapter_names(model, adapter_names, call)
    agree_on_call(model, call)  # [Note: collective headers]
    state = model.state_dict() if state_dict is None else state_dict
    keys, saved = _selected_keys(model, state, names, save_embedding_layers)
    quantized = {name for name, *_ in _quantized_entries(model, checkpoint_states(model, "peft state dict"))}
    hit = next((k for k in keys if k in quantized), None)
    if hit is not None:
        raise ShardingError(
            f"{call}: peft saves {hit!r} with the adapter, a sharded quantized base weight's entry; gathering it "
            "here is not supported. Fix: leave quantized layers out of modules_to_save, or export the whole model "
            "with blockshard.save_pretrained(model.get_base_model(), path)"
        )
    gathered: dict[str, Any] = gather_pieces({k: state[k] for k in keys})  # collective, checked
    _check_reselected(model, gathered, saved, save_embedding_layers)
    return gathered
