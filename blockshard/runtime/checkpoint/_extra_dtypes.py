"""State dicts of the extra dtypes' buffer sets ([Note: mixed dtypes] in core/_dtypes.py): each
is a group of its own under the module's prefix, as the primary buffer set is in _state_dict.py."""

from __future__ import annotations

from typing import Any

from torch import nn

from blockshard.runtime.checkpoint._piece_tensor import PieceTensor, param_entry
from blockshard.runtime.checkpoint._state_dict import _names, load_pieces
from blockshard.runtime.core._buffers import ParamBuffers
from blockshard.runtime.core._common import ShardedState
from blockshard.runtime.core._state import state_of

__all__ = ["install_extra_state_dict_hooks"]


def install_extra_state_dict_hooks(module: nn.Module) -> None:
    """``module.state_dict()`` / ``load_state_dict()`` for the parameters of the extra dtypes, as
    _state_dict.py's hooks do for the primary group's."""
    module.register_state_dict_post_hook(_post_hook)
    module.register_load_state_dict_pre_hook(_pre_hook)


def _extra_buffers(module: nn.Module) -> list[ParamBuffers]:
    st = state_of(module)
    return [] if st is None else [g for g in st.extra_param_buffers if g.layout is not None]


def _post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, _local_metadata: dict[str, Any]) -> None:
    for g in _extra_buffers(module):
        made: dict[int, PieceTensor] = {}
        for name, sp in _names(module, g.params):
            key = prefix + name
            if key in state_dict:
                if id(sp) not in made:
                    made[id(sp)] = param_entry(sp, sp.sharded.detach(), key, g.process_group)
                state_dict[key] = made[id(sp)]


def _pre_hook(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *_args: object
) -> None:
    for g in _extra_buffers(module):
        if g.sharded_state is not ShardedState.SHARDED:
            g.reshard()
        load_pieces(module, g, state_dict, prefix, assign=bool(local_metadata.get("assign_to_params_buffers")))
