"""``Accelerator``: accelerate's, with blockshard sharding at ``prepare()`` when the config asks for it.

[Note: what the subclass changes] Only what the config's ``fsdp_config.blockshard`` mapping turns on
(without it every method is accelerate's own):

* ``__init__``: on a machine without an accelerator, ``accelerate launch`` of an FSDP config starts
  the processes but accelerate reports ``DistributedType.NO`` and one process on each (it sets up
  CPU training only with ``ACCELERATE_USE_CPU``, which the multi-process launcher does not export).
  So accelerate is started with ``cpu=True`` there (``MULTI_CPU`` over gloo), and with its own FSDP
  off for both engines (``ACCELERATE_USE_FSDP`` hidden during ``__init__``): blockshard shards.
  What accelerate would then apply in ``prepare_model`` and blockshard skips is refused there
  (:func:`check_accelerator`: a mixed precision other than the config's, a dynamo backend), as are
  ``fsdp_plugin`` / ``deepspeed_plugin`` arguments.
* ``prepare``: shards the model (each ``fsdp_transformer_layer_cls_to_wrap`` module bottom-up, then
  the root) with ``blockshard.fully_shard`` or ``blockshard.integrations.fsdp2.fully_shard``, and
  points the optimizers passed with it at the sharded parameters (by name; they must not have stepped;
  ``blockshard.optim.rebind_optimizer``: one that computes on whole matrices, such as torch's Muon,
  is returned inside an ``OwnerComputeOptimizer`` that reuses it, so cut matrices are computed at
  their owners; an ``OwnerComputeOptimizer`` built before is rebuilt over the pieces). An optimizer
  prepared after the model gets the same treatment.
  Before sharding it wraps the layers for ``fsdp_activation_checkpointing`` and broadcasts rank 0's
  weights for ``fsdp_sync_module_states``; with ``fsdp_cpu_ram_efficient_loading`` it fills the shards
  from rank 0 after sharding ([Note: weights from rank 0] in ``_weights.py``). One process
  (``num_processes: 1``): accelerate starts no process group, so blockshard starts one of one rank.
* ``prepare_model``: returns a model sharded by blockshard as it is (accelerate would wrap it in
  DDP, which fails on ragged pieces).
* ``clip_grad_norm_``: the global norm over every rank's pieces (``blockshard.clip_grad_norm_``).
* ``save_state`` / ``load_state``: the model and optimizer states as one atomic DCP checkpoint
  (``blockshard.save_checkpoint``, in ``<output_dir>/blockshard``; the rest as accelerate saves it);
  DCP reshards it, so it loads at another world size.
* ``get_state_dict``: full tensors (``blockshard.full_state_dict``; collective, call on every rank).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import accelerate
import torch
from torch import nn

import blockshard
from blockshard.optim import rebind_optimizer
from blockshard.runtime._report._engaged import log_engaged

from .. import deepspeed as bs_deepspeed
from ._settings import (
    AccelerateConfigError,
    AccelerateSettings,
    accelerate_launch_argv,
    load_settings,
)
from ._shard import checkpoint_layers, load_model, save_model, shard_model
from ._weights import on_meta

__all__ = ["CHECKPOINT_DIR", "Accelerator"]

CHECKPOINT_DIR = "blockshard"  # the DCP checkpoint inside accelerate's save_state directory


def _no_device() -> bool:
    return not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available())


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def deepspeed_section() -> float | None:
    """When accelerate runs DeepSpeed with a JSON config that has a ``"blockshard"`` section: install
    blockshard's DeepSpeed hook and return the config's ``gradient_clipping`` (None otherwise)."""
    import json

    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true" or not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AccelerateConfigError(
            f"the DeepSpeed config {path!r} (deepspeed_config_file) cannot be read as JSON ({exc}); fix the file "
            "(blockshard accelerate-config --engine deepspeed writes one)"
        ) from None
    if not isinstance(config, dict) or "blockshard" not in config:
        return None
    clipping = config.get("gradient_clipping", 1.0)
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)):
        raise AccelerateConfigError(
            f"gradient_clipping={clipping!r} in the DeepSpeed config {path!r} must be a number (0: no clipping)"
        )

    bs_deepspeed.install()
    return float(clipping)


def _deepspeed_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """On a machine without an accelerator accelerate starts DeepSpeed without a backend and then
    reports one process per rank; gloo makes it a real world (DS_ACCELERATOR=cpu)."""
    if not _no_device() or "LOCAL_RANK" not in os.environ:
        return kwargs
    from accelerate.utils import InitProcessGroupKwargs

    handlers = list(kwargs.get("kwargs_handlers") or [])
    if any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
        return kwargs
    return {**kwargs, "kwargs_handlers": [*handlers, InitProcessGroupKwargs(backend="gloo")]}


def check_accelerator(settings: AccelerateSettings, mixed_precision: str, dynamo_backend: str) -> None:
    """What accelerate set up beside the config (``Accelerator(...)`` arguments, ``TrainingArguments``)
    that blockshard's ``prepare()`` would ignore: its autocast and ``torch.compile`` (prepare_model)."""
    if mixed_precision != settings.mixed_precision:
        raise AccelerateConfigError(
            f"accelerate runs mixed_precision={mixed_precision!r} (an Accelerator or TrainingArguments argument) but "
            f"blockshard's settings from {settings.source or 'blockshard_settings'} say {settings.mixed_precision!r}: "
            "blockshard's mixed precision is its own (bf16 parameters, fp32 gradient reduction) and accelerate's "
            "autocast would be ignored; make them agree (the Trainer: TrainingArguments(bf16=True) with "
            "mixed_precision: bf16 in the config, bf16=False with 'no')"
        )
    if dynamo_backend.upper() != "NO":
        raise AccelerateConfigError(
            f"accelerate's dynamo_backend={dynamo_backend!r} would be ignored: blockshard's prepare() returns the "
            "sharded model uncompiled; drop dynamo_backend (or torch_compile) and call torch.compile yourself"
        )


def check_launched(settings: AccelerateSettings) -> None:
    """A config of ``num_processes > 1`` in a process that no launcher started (``WORLD_SIZE`` unset and
    no ``accelerate launch`` parent: plain ``python train.py``) would train alone as a world of one
    without a word: refuse it. (``accelerate launch --num_processes 1`` sets no ``WORLD_SIZE``; its
    command line overrides the config, as accelerate intends.)"""

    if settings.num_processes > 1 and "WORLD_SIZE" not in os.environ and accelerate_launch_argv() is None:
        raise AccelerateConfigError(
            f"num_processes={settings.num_processes} in {settings.source or 'blockshard_settings'}, but this process "
            "was started without a launcher (WORLD_SIZE is unset), so it would train alone as a world of one; run it "
            f"with accelerate launch --config_file {settings.source or 'CONFIG.yaml'} your_script.py (or torchrun), "
            "or set num_processes: 1"
        )


def check_parallelism(settings: AccelerateSettings, kwargs: dict[str, Any]) -> None:
    """accelerate's ``ParallelismConfig`` (an ``Accelerator`` argument, or the config file's
    ``parallelism_config`` section, which ``accelerate launch`` passes on as environment variables)
    with more than sharded data parallelism: accelerate's ``prepare`` would turn blockshard's pieces
    into tensor-parallel DTensors (tp) or leave the layout unapplied (the others), so it is refused
    before accelerate starts. ``dp_shard_size``
    alone is what blockshard does (it shards over every process)."""
    pc = kwargs.get("parallelism_config")
    if pc is None and kwargs.get("torch_tp_plugin") is not None:
        pc = accelerate.parallelism_config.ParallelismConfig(tp_size=kwargs["torch_tp_plugin"].tp_size)
    if pc is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        pc = accelerate.parallelism_config.ParallelismConfig()  # its sizes from PARALLELISM_CONFIG_*
    if pc is None:
        return
    sizes = {f"{k}_size": getattr(pc, f"{k}_size", 1) for k in ("tp", "cp", "sp", "dp_replicate")}
    extra = {k: v for k, v in sizes.items() if isinstance(v, int) and v > 1}
    if extra:
        given = ", ".join(f"{k}={v}" for k, v in extra.items())
        raise AccelerateConfigError(
            f"accelerate's ParallelismConfig({given}) with blockshard's {settings.engine} engine from "
            f"{settings.source or 'blockshard_settings'}: blockshard's accelerate plugin shards over every process "
            "as one data-parallel group (no tensor, context or sequence parallel or replicate dims: accelerate's "
            "prepare() would make blockshard's pieces tensor-parallel DTensors, or ignore the layout). Fix: drop "
            "those sizes (dp_shard_size alone is what blockshard does), or build the mesh yourself and call "
            "blockshard.fully_shard(model, mesh=mesh['dp']) after torch's parallelize_module on mesh['tp'] (HSDP: "
            "mesh=mesh['replicate', 'shard']) without Accelerate's prepare (docs/engine.md, 'Tensor parallelism')"
        )


def _init_world1(num_processes: int, settings: AccelerateSettings) -> None:
    """A gloo process group of one rank for a run of one process (accelerate starts none for
    ``DistributedType.NO``): blockshard's engines issue their collectives on it (a world of 1:
    each rank's shard is the whole model, checkpoints reshard to and from it)."""
    if num_processes != 1:
        raise AccelerateConfigError(
            f"blockshard's {settings.engine} engine from {settings.source} found {num_processes} processes but no "
            "torch.distributed process group; launch with accelerate launch (or torchrun)"
        )
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # end_training destroys it


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that shards with blockshard when the launch config has an
    ``fsdp_config.blockshard`` mapping (see the module docstring); ``blockshard_settings`` overrides it."""

    _models: list[Any]  # accelerate's prepared models and optimizers
    _optimizers: list[Any]

    def __init__(self, *args: Any, blockshard_settings: AccelerateSettings | None = None, **kwargs: Any) -> None:
        settings = blockshard_settings if blockshard_settings is not None else load_settings()
        self.blockshard_settings = settings
        self.blockshard_source = "accelerate"  # what the engage line names ([Note: engage line]); the Trainer's says so
        self._blockshard_models: list[nn.Module] = []
        self._deepspeed_clipping: float | None = None
        if settings is None:
            section = deepspeed_section()
            if section is not None:
                self._deepspeed_clipping = section
                kwargs = _deepspeed_kwargs(kwargs)
            super().__init__(*args, **kwargs)
            return
        check_launched(settings)
        check_parallelism(settings, kwargs)
        for plugin in ("fsdp_plugin", "deepspeed_plugin"):
            if kwargs.get(plugin) is not None:
                raise AccelerateConfigError(
                    f"Accelerator({plugin}=...) conflicts with blockshard's {settings.engine} engine from "
                    f"{settings.source}; drop the {plugin} argument (blockshard shards at prepare())"
                )
        if _no_device() and "LOCAL_RANK" in os.environ:
            kwargs["cpu"] = True
        with _env(ACCELERATE_USE_FSDP="false"):  # blockshard shards; accelerate's FSDP path stays off
            super().__init__(*args, **kwargs)
        check_accelerator(settings, str(self.mixed_precision), str(self.state.dynamo_plugin.backend))

    # -- prepare ----------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        if self.blockshard_settings is not None:
            models = [a for a in args if isinstance(a, nn.Module) and not self._is_blockshard(a)]
            if len(models) > 1:
                raise AccelerateConfigError(
                    f"prepare() got {len(models)} models; blockshard's accelerate plugin shards one model per "
                    "Accelerator: prepare the others with another Accelerator, or combine them in one nn.Module"
                )
            names = self._shard(models[0], [a for a in args if isinstance(a, torch.optim.Optimizer)]) if models else {}
            if self._blockshard_models:  # [Note: a reused optimizer] in blockshard/optim/_rebind.py
                model = self._blockshard_models[0]
                args = tuple(
                    rebind_optimizer(a, model, names=names) if isinstance(a, torch.optim.Optimizer) else a for a in args
                )
            prepared = super().prepare(*args, device_placement=device_placement)
            if models:  # the prepare that sharded: [Note: engage line]
                s = self.blockshard_settings
                optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
                log_engaged(
                    models[0],
                    self.blockshard_source,
                    engine=s.engine,
                    semantics=s.semantics,
                    policy=s.policy,
                    optimizers=optimizers,
                )
            return prepared
        return super().prepare(*args, device_placement=device_placement)

    def _is_blockshard(self, model: nn.Module) -> bool:
        return any(model is m for m in self._blockshard_models)

    def _shard(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[int, str]:
        """Shard ``model``; return its parameters' names before sharding (``id -> name``), by which
        the optimizers passed with it follow the pieces."""
        settings = self.blockshard_settings
        assert settings is not None
        names = {id(p): n for n, p in model.named_parameters()}
        for opt in optimizers:
            if opt.state:
                raise AccelerateConfigError(
                    "an optimizer passed to prepare() has already stepped; blockshard moves its parameters onto the "
                    "sharded pieces and cannot move state: build and prepare it before the first step"
                )
            unknown = [p for g in opt.param_groups for p in g["params"] if id(p) not in names]
            if unknown:
                raise AccelerateConfigError(
                    f"an optimizer passed to prepare() holds {len(unknown)} tensors that are not parameters of the "
                    "prepared model; build it over model.parameters() (or named subsets of them)"
                )
        if not torch.distributed.is_initialized():  # one process: accelerate starts no process group
            _init_world1(self.num_processes, settings)

        checkpoint_layers(model, settings)  # the same parameter objects under longer names
        names = {id(p): n for n, p in model.named_parameters()}
        if self.device_placement and not on_meta(model):
            model.to(self.device)  # shard where it trains (a no-op on CPU); meta ranks materialize their shards there
        shard_model(model, settings, self.device)
        self._blockshard_models.append(model)
        return names

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if not self._is_blockshard(model):
            prepared: nn.Module = super().prepare_model(
                model, device_placement=device_placement, evaluation_mode=evaluation_mode
            )
            return prepared
        if not any(model is m for m in self._models):
            self._models.append(model)
        return model

    # -- training -----------------------------------------------------------------------------------
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor | float | None:  # accelerate's: None or a float where DeepSpeed clips
        if self._deepspeed_clipping is not None and float(max_norm) != self._deepspeed_clipping:
            raise AccelerateConfigError(
                f"accelerator.clip_grad_norm_(max_norm={max_norm}) would be ignored: DeepSpeed clips at its config's "
                f'"gradient_clipping" ({self._deepspeed_clipping}); set that value in the DeepSpeed JSON or pass it here'
            )
        norm: torch.Tensor | float | None
        if not self._blockshard_models or self.blockshard_settings is None:
            norm = super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
            return norm
        if self.blockshard_settings.engine == "fsdp2":  # DTensor gradients: accelerate reduces the norm
            norm = super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
            return norm

        self.unscale_gradients()
        return blockshard.clip_grad_norm_(list(parameters), max_norm, norm_type)

    # -- state ----------------------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        if not self._is_blockshard(model):
            state: dict[str, Any] = super().get_state_dict(model, unwrap=unwrap)
            return state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    @contextlib.contextmanager
    def _without_blockshard(self) -> Iterator[tuple[list[nn.Module], list[torch.optim.Optimizer]]]:
        """accelerate's save/load of everything but the sharded model and its optimizers."""
        models: list[Any] = self._models
        optimizers: list[Any] = self._optimizers
        self._models = [m for m in models if not self._is_blockshard(m)]
        self._optimizers = [] if self._blockshard_models else optimizers
        try:
            yield [m for m in models if self._is_blockshard(m)], [o.optimizer for o in optimizers]
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        location: str
        if not self._blockshard_models:
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
            return location

        with self._without_blockshard() as (models, optimizers):
            location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        save_model(models[0], os.path.join(location, CHECKPOINT_DIR), optimizers, self.blockshard_settings)
        return location

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not self._blockshard_models:
            super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)  # accelerate's returns None
            return

        found: list[str] = []
        handle = self.register_load_state_pre_hook(lambda _models, where: found.append(where))
        try:
            with self._without_blockshard() as (models, optimizers):
                super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        finally:
            handle.remove()
        load_model(models[0], os.path.join(found[0], CHECKPOINT_DIR), optimizers, self.blockshard_settings)

    def end_training(self) -> None:
        """accelerate's, after a barrier when blockshard shards: the ranks tear their gloo groups
        down together (a rank that destroyed its group while a peer was still saving aborted at
        exit on a loaded CI: "terminate called without an active exception")."""
        import torch.distributed as dist

        if self.blockshard_settings is not None and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        super().end_training()
