"""``blockshard.integrations.deepspeed``: block-aligned DeepSpeed ZeRO-1/2 partitions.

Stock ZeRO-1/2 cuts each ``param_group``'s flat buffer into ``W`` equal element ranges: a partition
boundary can fall inside a bitsandbytes 256-element block or a Muon matrix, and the inner optimizer
sees one flat tensor per ``param_group`` (so bitsandbytes quantizes blocks that straddle parameters and never
keeps fp32 state for small ones). With the hook, partition boundaries fall only on allowed cuts of
each parameter's units (holes between parameters, partition size chosen to fit) and the inner
optimizer sees each parameter piece with its shape -- so bitsandbytes AdamW8bit, AdamW and
``torch.optim.Muon`` (with ``"matrix"`` semantics: whole matrices, momentum on their owner only)
compute what they compute on one process. See ``docs/deepspeed.md``.

Use it as a drop-in for ``deepspeed.initialize`` with a ``"blockshard"`` section in the config::

    from blockshard.integrations import deepspeed as bs_deepspeed

    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True,
              "blockshard": {"semantics": {"*weight": "bnb8bit"}}}
    engine, optimizer, _, _ = bs_deepspeed.initialize(model=model, optimizer=bnb_adamw8bit, config=config)

or, when another library calls ``deepspeed.initialize`` (Accelerate, the HF Trainer), patch it
process-wide; engines whose config has a ``"blockshard"`` section get the hook, others do not::

    bs_deepspeed.install()          # or: with bs_deepspeed.installed(): trainer.train()

ZeRO-3 keeps DeepSpeed's partitions; an optimizer that is not element-wise (8-bit, Muon, Shampoo)
steps runs of whole units on owner ranks ([Note: ZeRO-3 owner-compute] in _stage3.py). The hook
checks the DeepSpeed version (:data:`TESTED_DEEPSPEED_VERSIONS`); override with
``"allow_untested_deepspeed": true`` or ``BLOCKSHARD_ALLOW_UNTESTED_DEEPSPEED=1``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from blockshard.runtime._report._engaged import log_engaged
from blockshard.runtime.core._traffic import tag_traffic

from ._config import (
    ALLOW_UNTESTED_ENV,
    SECTION,
    TESTED_DEEPSPEED_VERSIONS,
    DeepSpeedHookError,
    HookConfig,
    check_deepspeed_version,
    find_config,
    load_config,
    parse_section,
)
from ._dcp import ExportSummary, export_dcp, import_dcp, read_deepspeed_checkpoint, read_zero3_weights
from ._hook import LAYOUT_KEY, hooked_classes
from ._stage3 import zero3_optimizer
from ._zero3_reshard import reshard_zero3_checkpoint

if TYPE_CHECKING:  # DeepSpeed ships no type information: its classes are Any to mypy
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch import nn


__all__ = [
    "ALLOW_UNTESTED_ENV",
    "LAYOUT_KEY",
    "SECTION",
    "TESTED_DEEPSPEED_VERSIONS",
    "DeepSpeedHookError",
    "ExportSummary",
    "HookConfig",
    "check_deepspeed_version",
    "export_dcp",
    "import_dcp",
    "initialize",
    "install",
    "installed",
    "is_hooked",
    "is_installed",
    "layout_report",
    "parse_section",
    "read_deepspeed_checkpoint",
    "read_zero3_weights",
    "reshard_zero3_checkpoint",
    "uninstall",
    "zero3_optimizer",
]

_log = logging.getLogger(__name__)
_LOCK = threading.RLock()
_ORIGINAL: Callable[..., Any] | None = None  # deepspeed.initialize before install()


def _original_initialize() -> Callable[..., Any]:
    import deepspeed

    original: Callable[..., Any] = _ORIGINAL if _ORIGINAL is not None else deepspeed.initialize
    return original


def _module_types(model: object) -> dict[int, str]:
    out: dict[int, str] = {}
    if model is not None and hasattr(model, "modules"):
        for mod in model.modules():
            for p in mod.parameters(recurse=False):
                out.setdefault(id(p), type(mod).__name__)
    return out


def initialize(
    args: object = None,
    model: nn.Module | None = None,
    optimizer: object = None,
    model_parameters: object = None,
    training_data: object = None,
    lr_scheduler: object = None,
    distributed_port: int | None = None,
    mpu: object = None,
    dist_init_required: bool | None = None,
    collate_fn: object = None,
    config: object = None,
    mesh_param: object = None,
    config_params: object = None,
) -> Any:  # deepspeed.initialize's (engine, optimizer, dataloader, lr_scheduler); DeepSpeed is untyped
    """``deepspeed.initialize`` with blockshard's ZeRO hook for this engine (same arguments, same returns).

    Reads the ``"blockshard"`` section of the config (``config``, ``config_params`` or
    ``args.deepspeed_config``; a dict or a path); a missing section means the defaults (element-wise
    semantics), ``"enabled": false`` means plain DeepSpeed. Raises :class:`DeepSpeedHookError` for a
    bad section (naming the key), an untested DeepSpeed version and the unsupported setups listed
    in ``docs/deepspeed.md``.
    """
    kwargs = dict(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
        mesh_param=mesh_param,
        config_params=config_params,
    )
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    return _initialize(kwargs, require_section=False)


def _initialize(kwargs: dict[str, Any], *, require_section: bool) -> Any:
    original = _original_initialize()
    which, value = find_config(kwargs.get("args"), kwargs.get("config"), kwargs.get("config_params"))
    if value is None:
        return original(**kwargs)
    cfg = load_config(value)
    if require_section and SECTION not in cfg:
        return original(**kwargs)
    hc = parse_section(cfg.get(SECTION))
    if not hc.enabled:
        return original(**kwargs)
    check_deepspeed_version(hc.allow_untested_deepspeed)
    if which in ("config", "config_params"):
        kwargs[which] = cfg  # a path was read once here; DeepSpeed gets the same dict
    import deepspeed.runtime.engine as ds_engine
    import deepspeed.runtime.zero.stage3 as ds_stage3

    from . import _pending

    classes = hooked_classes()
    with _LOCK:
        saved = (ds_engine.DeepSpeedZeroOptimizer, ds_stage3.DeepSpeedZeroOptimizer_Stage3, _pending.pending())
        ds_engine.DeepSpeedZeroOptimizer = classes["zero12"]
        ds_stage3.DeepSpeedZeroOptimizer_Stage3 = classes["zero3"]
        _pending.set_pending(_pending._Pending(hc, _module_types(kwargs.get("model"))))
        try:
            out = original(**kwargs)
        finally:
            ds_engine.DeepSpeedZeroOptimizer, ds_stage3.DeepSpeedZeroOptimizer_Stage3 = saved[:2]
            _pending.set_pending(saved[2])
    engine = out[0]
    stage = int(engine.zero_optimization_stage())
    if stage in (1, 2) and not isinstance(engine.optimizer, classes["zero12"]):
        raise DeepSpeedHookError(
            f"ZeRO stage {stage} built {type(engine.optimizer).__name__}, not DeepSpeedZeroOptimizer, so the "
            "blockshard hook is not active (e.g. bf16 ZeRO-1 with fp32 gradient accumulation uses BF16_Optimizer: "
            'use stage 2 or "data_types": {"grad_accum_dtype": "bf16"}); remove the blockshard section to '
            "run stock DeepSpeed"
        )
    if stage == 3:
        if not isinstance(engine.optimizer, classes["zero3"]):
            raise DeepSpeedHookError(
                f"ZeRO stage 3 built {type(engine.optimizer).__name__}, not DeepSpeedZeroOptimizer_Stage3 (MiCS?), so "
                "the blockshard hook is not active; remove mics_shard_size or the blockshard section"
            )
        owner = engine.optimizer.owner_traffic()["owner"]  # type: ignore[attr-defined]
        policy = "owner (runs of whole units)" if owner else "stock (an element-wise optimizer)"
        log_engaged(
            engine,
            "the DeepSpeed hook",
            engine="DeepSpeed ZeRO-3",
            semantics=hc.semantics,
            policy=policy,
            with_report=False,
        )
        return out
    if stage == 0:
        _log.info("blockshard: ZeRO stage 0 keeps whole parameters on every rank; nothing to align")
    else:  # [Note: engage line] in blockshard/runtime/_report/_engaged.py
        tag_traffic(engine, engine.optimizer.blockshard_engine(), engine.optimizer._bs_traffic.traffic)
        log_engaged(
            engine, "the DeepSpeed hook", engine=f"DeepSpeed ZeRO-{stage}", semantics=hc.semantics, policy="whole"
        )
    return out


def is_hooked(engine: object) -> bool:
    """Whether ``engine``'s ZeRO optimizer is blockshard's (ZeRO-1/2 or ZeRO-3)."""
    classes = hooked_classes()
    return isinstance(getattr(engine, "optimizer", None), (classes["zero12"], classes["zero3"]))


def layout_report(engine: DeepSpeedEngine) -> list[dict[str, Any]]:
    """Per ``param_group`` of a hooked engine: layout (segment, starts), names, semantics, padding."""
    if not isinstance(getattr(engine, "optimizer", None), hooked_classes()["zero12"]):
        raise DeepSpeedHookError(
            "layout_report needs an engine made by blockshard.integrations.deepspeed.initialize with ZeRO stage 1 or 2"
        )
    out: list[dict[str, Any]] = []
    for g in engine.optimizer.blockshard_layout():
        total = g["world_size"] * g["segment"]
        data = sum(g["numels"])
        out.append(
            {
                **g,
                "total_numel": total,
                "padding_numel": total - data,
                "padding_fraction": (total - data) / total if total else 0.0,
            }
        )
    return out


# -- process-wide patch ---------------------------------------------------------------------------
def _patched_initialize(*args: object, **kwargs: object) -> Any:
    if args:  # deepspeed.initialize's parameters in order
        names = [
            "args",
            "model",
            "optimizer",
            "model_parameters",
            "training_data",
            "lr_scheduler",
            "distributed_port",
            "mpu",
            "dist_init_required",
            "collate_fn",
            "config",
            "mesh_param",
            "config_params",
        ]
        if len(args) > len(names):
            raise TypeError(
                f"deepspeed.initialize() takes at most {len(names)} positional arguments ({len(args)} given)"
            )
        kwargs.update(zip(names[: len(args)], args, strict=True))
    return _initialize(kwargs, require_section=True)


def install(*, allow_untested_deepspeed: bool = False) -> None:
    """Patch ``deepspeed.initialize`` process-wide: engines whose config has a ``"blockshard"`` section get
    the hook (as :func:`initialize`), others are stock. Idempotent; undo with :func:`uninstall`.

    For libraries that call ``deepspeed.initialize`` themselves (Accelerate's ``prepare``, the HF
    Trainer): call this before they do and put the section in the DeepSpeed config they are given.
    The version check runs here too (``allow_untested_deepspeed`` overrides it).
    """
    global _ORIGINAL
    check_deepspeed_version(allow_untested_deepspeed)
    import deepspeed

    with _LOCK:
        if _ORIGINAL is None:
            _ORIGINAL = deepspeed.initialize
            deepspeed.initialize = _patched_initialize


def uninstall() -> None:
    """Restore the original ``deepspeed.initialize`` (no-op if not installed)."""
    global _ORIGINAL
    import deepspeed

    with _LOCK:
        if _ORIGINAL is not None:
            deepspeed.initialize = _ORIGINAL
            _ORIGINAL = None


def is_installed() -> bool:
    return _ORIGINAL is not None


@contextlib.contextmanager
def installed(*, allow_untested_deepspeed: bool = False) -> Iterator[None]:
    """Context manager: :func:`install` on entry, :func:`uninstall` on exit (if it installed)."""
    was = is_installed()
    install(allow_untested_deepspeed=allow_untested_deepspeed)
    try:
        yield
    finally:
        if not was:
            uninstall()
