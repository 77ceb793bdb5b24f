"""The route of peft's ``PeftModel.save_pretrained`` for sharded models ([Note: torch routes] in
_route.py, [Note: peft adapters] in checkpoint/_peft.py).

peft 0.21's ``PeftModel.save_pretrained(save_directory, safe_serialization, selected_adapters,
save_embedding_layers, is_main_process, path_initial_model_for_weight_conversion, **kwargs)``
(``peft/peft_model.py``) calls ``get_peft_model_state_dict(self, state_dict=kwargs.get("state_dict"),
...)`` on every rank and writes on ``is_main_process`` (default ``True``). peft has no hook for a
sharded state dict (its tensor-parallel path knows transformers' plans and DTensors only), so the
route wraps the method, in one place (the class attribute; no subclass overrides it, checked). For
a model that holds no blockshard group, and for a ``state_dict=`` of full tensors (the recipe that
gathers the whole model), it is peft's own call, unchanged. Otherwise (collective: every rank calls
it, checked):

* ``blockshard.peft_state_dict`` gathers the entries peft saves, and only those;
* peft's own method then writes them from ``state_dict=``, so the files are what peft writes for
  the unsharded model;
* only rank 0 (of the default group) writes unless ``is_main_process`` is passed (peft's default ``True`` would have every
  rank write the same files at once);
* ``path_initial_model_for_weight_conversion`` (PiSSA / OLoRA conversion, which loads the initial
  adapter into the model) is refused with the fix.

peft also writes the base model's class into ``adapter_config.json`` (``auto_mapping``, for a
config without ``task_type``) from ``PeftModel._get_base_model_class``, which would name the class
``fully_shard`` swapped in (``BlockShardLlamaForCausalLM``, no class of transformers): the route
wraps it to return the model's own class.

The check reads the two methods' and ``get_peft_model_state_dict``'s parameters, that the method's code
calls ``get_peft_model_state_dict`` and reads a ``"state_dict"`` keyword, and that no subclass in
``peft.peft_model`` overrides either. The route applies once ``peft.peft_model`` is imported.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from blockshard._errors import ShardingError
from blockshard.runtime.checkpoint._peft import peft_state_dict
from blockshard.runtime.checkpoint._piece_tensor import PieceTensor
from blockshard.runtime.core._inspect import states_under
from blockshard.runtime.core._module import unswapped_class
from blockshard.runtime.routes._route import Route, parameter_names, signature_problem

__all__ = ["PEFT_ROUTE", "TESTED_PEFT"]

TESTED_PEFT = ("0.21",)  # constraints.txt pins peft==0.21.2
_SAVE = (
    "self",
    "save_directory",
    "safe_serialization",
    "selected_adapters",
    "save_embedding_layers",
    "is_main_process",
    "path_initial_model_for_weight_conversion",
)
_GET = ("model", "state_dict", "adapter_name", "unwrap_compiled", "save_embedding_layers")
_CLASS = ("self", "is_prompt_tuning")


def _applies() -> bool:
    return "peft.peft_model" in sys.modules


def _peft_model() -> Any:
    from peft.peft_model import PeftModel

    return PeftModel


def _global_rank() -> int:
    """The writer is the default group's rank 0: every rank holds the gathered adapter, and with
    several replicas of a sharded group (HSDP) each group's rank 0 would write the same files."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _check() -> list[str]:
    from peft.utils import save_and_load

    cls = _peft_model()
    fn = cls.__dict__.get("save_pretrained")
    problems = signature_problem("PeftModel.save_pretrained", fn, _SAVE)
    problems += signature_problem("get_peft_model_state_dict", save_and_load.get_peft_model_state_dict, _GET)
    problems += signature_problem("PeftModel._get_base_model_class", cls.__dict__.get("_get_base_model_class"), _CLASS)
    if problems:
        return problems
    if not (parameter_names(fn) or ())[-1:] == ("kwargs",):
        problems.append("PeftModel.save_pretrained takes no **kwargs (where it reads state_dict)")
    code = fn.__code__
    if "get_peft_model_state_dict" not in code.co_names or "state_dict" not in code.co_consts:
        problems.append(
            "PeftModel.save_pretrained no longer takes its entries from get_peft_model_state_dict(state_dict=)"
        )
    todo, seen = list(cls.__subclasses__()), set()
    while todo:
        sub = todo.pop()
        if sub not in seen:
            seen.add(sub)
            todo += sub.__subclasses__()
            for name in ("save_pretrained", "_get_base_model_class"):
                if name in vars(sub) and sub.__module__.startswith("peft."):
                    problems.append(f"{sub.__name__} overrides {name}")
    return problems


def _save_sharded(
    original: Callable[..., None], model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """peft's ``save_pretrained`` on a sharded model: the adapter's entries gathered, rank 0 writing."""
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    explicit = set(bound.arguments)
    bound.apply_defaults()
    a = dict(bound.arguments)
    extra = dict(a.pop("kwargs"))
    given = extra.pop("state_dict", None)
    if a["path_initial_model_for_weight_conversion"] is not None:
        raise ShardingError(
            "PeftModel.save_pretrained(path_initial_model_for_weight_conversion="
            f"{a['path_initial_model_for_weight_conversion']!r}) on a sharded model: the conversion loads the "
            "initial adapter into the model, which is not supported on a sharded one. Fix: save the adapter with "
            "model.save_pretrained(path), then convert it on one process (the base model unsharded, "
            "PeftModel.from_pretrained(base, path), save_pretrained(..., path_initial_model_for_weight_conversion=...))"
        )
    if given is not None and not any(isinstance(v, PieceTensor) for v in given.values()):
        return original(model, *args, **kwargs)  # full tensors already (every rank or rank 0 only)
    state = peft_state_dict(
        model, a["selected_adapters"], save_embedding_layers=a["save_embedding_layers"], state_dict=given
    )
    main = a["is_main_process"] if "is_main_process" in explicit else _global_rank() == 0
    original(
        model,
        a["save_directory"],
        safe_serialization=a["safe_serialization"],
        selected_adapters=a["selected_adapters"],
        save_embedding_layers=a["save_embedding_layers"],
        is_main_process=main,
        state_dict=state,
        **extra,
    )


def _install() -> Callable[[], None]:
    cls = _peft_model()
    original = cls.__dict__["save_pretrained"]
    base_class = cls.__dict__["_get_base_model_class"]

    @functools.wraps(base_class)
    def _get_base_model_class(self: nn.Module, is_prompt_tuning: bool = False) -> type:
        return unswapped_class(base_class(self, is_prompt_tuning))

    @functools.wraps(original)
    def save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        if not states_under(self):
            return original(self, *args, **kwargs)  # type: ignore[no-any-return]
        return _save_sharded(original, self, args, kwargs)

    cls.save_pretrained = save_pretrained
    cls._get_base_model_class = _get_base_model_class

    def undo() -> None:
        cls.save_pretrained = original
        cls._get_base_model_class = base_class

    return undo


PEFT_ROUTE = Route(
    name="peft_save_pretrained",
    replaces="peft.PeftModel.save_pretrained and ._get_base_model_class",
    without="peft's save_pretrained on a sharded model raises PieceTensorError: call "
    "model.save_pretrained(path, state_dict=blockshard.peft_state_dict(model), is_main_process=rank == 0) on "
    "every rank instead",
    check=_check,
    install=_install,
    library="peft",
    tested=TESTED_PEFT,
    applies=_applies,
)
