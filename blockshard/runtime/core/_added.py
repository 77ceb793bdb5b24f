"""Parameters added under a sharded module after ``fully_shard``: refused at the next forward.

[Note: parameters added after fully_shard]
``fully_shard`` takes the parameters its modules hold *then*; the engine reduces the gradients of
those only. A trainable parameter registered under a group's modules afterwards (peft's
``PeftModel.from_pretrained(sharded_base, dir, is_trainable=True)`` injects LoRA layers,
``resize_token_embeddings`` swaps in a new embedding, a head is attached) is an ordinary tensor:
every rank computes its gradient from its own batch and steps it alone, so the ranks' copies drift
apart, silently (stock FSDP2 does the same). So at W > 1 the root's forward refuses such a
parameter, naming it and the fix, on every rank (every rank runs the same code, so every rank finds
the same parameters).

Cheap: torch's global module- and parameter-registration hooks (``register_module_*_registration_hook``,
registered once by the first ``fully_shard``) count registrations in the process; the root's
forward walks its groups' parameters only when that count moved since its last look (the engine's
own swaps of pieces and gathered tensors write ``module._parameters`` directly and are not counted).
A frozen parameter (peft's default ``is_trainable=False``), a piece of a group (a tied weight
re-assigned) and ``ignored_params`` pass.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from blockshard._errors import ShardingError
from blockshard.runtime.core._param import managed_tag

__all__ = ["check_no_added_parameters", "install_registration_count", "registrations"]

_LOCK = threading.Lock()
_count = [0]  # registrations of modules and parameters in this process
_installed = [False]


def _counted(*_args: Any) -> None:
    _count[0] += 1  # a race between threads loses a count, never all of them: only "changed" matters


def install_registration_count() -> None:
    """Register the two counting hooks (idempotent; [Note: parameters added after fully_shard])."""
    with _LOCK:
        if not _installed[0]:
            register_module_module_registration_hook(_counted)
            register_module_parameter_registration_hook(_counted)
            _installed[0] = True


def registrations() -> int:
    return _count[0]


def check_no_added_parameters(states: Iterable[Any], world_size: int) -> None:
    """Raise :class:`ShardingError` naming the trainable parameters under ``states``' modules that no
    group holds (at ``world_size > 1``; at 1 there is nothing to average)."""
    if world_size <= 1:
        return
    added: list[str] = []
    for st in states:
        ignored: frozenset[int] = st.ignored_ids
        for top in st.modules:
            for name, p in top.named_parameters():
                if p.requires_grad and managed_tag(p) is None and id(p) not in ignored:
                    added.append(f"{name} {tuple(p.shape)}")
    if added:
        unique = list(dict.fromkeys(added))  # in the model's order, a tied parameter once
        shown = ", ".join(unique[:5]) + (f" and {len(unique) - 5} more" if len(unique) > 5 else "")
        raise ShardingError(
            f"blockshard: trainable parameters were added under a sharded module after fully_shard: {shown}. No "
            f"group holds them, so their gradients would not be averaged over the {world_size} ranks and each rank "
            "would train its own copy (silently different models). This happens with "
            "PeftModel.from_pretrained(sharded_base, ..., is_trainable=True), resize_token_embeddings or a module "
            "attached after sharding. Fix: add them before fully_shard (build the PeftModel first, shard it, then "
            "load the adapter into it with load_adapter / set_peft_model_state_dict), freeze them "
            "(requires_grad_(False)), or pass them in fully_shard's ignored_params and average them yourself"
        )
