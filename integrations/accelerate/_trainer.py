"""``Trainer``: the Hugging Face ``Trainer`` with blockshard's ``Accelerator`` (tested with the ragged engine).

[Note: what the Trainer subclass changes] ``transformers.Trainer`` builds accelerate's
``Accelerator`` itself (``create_accelerator_and_postprocess``). This subclass builds blockshard's
instead (same arguments, plus ``blockshard_settings``); with no blockshard config it is the stock
Trainer. accelerate's FSDP path stays off (``Trainer.is_fsdp_enabled`` is False), so the Trainer
takes its plain data-parallel path, where everything it does to the model goes through the accelerator:

* the optimizer is built over the unsharded model, then ``accelerator.prepare(model, optimizer)``
  shards the model and points the optimizer at the pieces (by name, before any step);
* ``max_grad_norm``: ``accelerator.clip_grad_norm_``, the global norm over every rank's pieces;
* ``optim="adamw_bnb_8bit"``: the Trainer registers a 32-bit override for each ``nn.Embedding``
  with bitsandbytes' ``GlobalOptimManager`` (``register_module_override(module, "weight", ...)``),
  which bitsandbytes resolves at the first ``step()`` as ``getattr(module, "weight")`` by object
  identity: on the ragged engine that attribute is this rank's piece, the parameter the optimizer
  now holds, so the embedding keeps fp32 state on each rank as on one process. Overrides keyed on
  the parameter object (``override_config(param, ...)``, ``pid2config``) would be lost with the
  replaced parameter: :func:`follow_overrides` moves them onto the piece, found by name;
* ``save_model`` (and the model in each checkpoint): the full model, ``from_pretrained`` loads it
  (ragged engine: ``blockshard.save_pretrained``, streamed from rank 0; fsdp2: the full state dict).
  Collective: call it on every rank, as the Trainer does;
* checkpoints (``_save_checkpoint``): the model and optimizer state as one DCP checkpoint in
  ``<checkpoint>/blockshard`` (as ``accelerator.save_state``), the scheduler as the Trainer saves it;
  ``resume_from_checkpoint`` loads both (the full weights first, as the Trainer does, then the DCP state).

The optimizer keeps every piece, empty ones too (a tensor another rank holds whole), as the README's
recipe builds it: an empty piece holds no state in blockshard's checkpoints, so bitsandbytes' fp32
state of a 0-element piece beside the holder's 8-bit state saves and loads ([Note: empty pieces hold
no state] in ``blockshard/runtime/checkpoint/_optim_state.py``), and bitsandbytes' positional ``index2config``
keeps its positions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, cast

import torch
import transformers
import transformers.trainer as hf_trainer
from torch import nn

import blockshard

from ._accelerator import CHECKPOINT_DIR, Accelerator, _no_device
from ._settings import AccelerateConfigError, AccelerateSettings
from ._shard import load_model, save_model

__all__ = ["Trainer", "follow_overrides"]


def _names_of(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}


def follow_overrides(before: dict[int, str], model: nn.Module) -> int:
    """Move bitsandbytes ``GlobalOptimManager.pid2config`` entries (``override_config``, keyed on
    ``id(parameter)``) of the parameters named in ``before`` (``id -> name``, taken before sharding)
    onto the parameters ``model`` has now under those names (its pieces); returns how many moved.

    Module overrides (``register_module_override(module, "weight", ...)``, which the Trainer uses for
    ``nn.Embedding``) need no move: bitsandbytes resolves them at the first ``step()`` as
    ``getattr(module, "weight")``, which on a sharded module is this rank's piece."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except ImportError:
        return 0
    manager = GlobalOptimManager.get_instance()
    now = dict(model.named_parameters(remove_duplicate=False))
    moved = 0
    for pid, config in list(manager.pid2config.items()):
        name = before.get(pid)
        if name is not None and name in now and id(now[name]) != pid:
            del manager.pid2config[pid]  # the replaced parameter's id may be reused by a new object
            manager.pid2config[id(now[name])] = config
            moved += 1
    return moved


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` that trains with blockshard under ``accelerate launch --config_file
    <a config with fsdp_config.blockshard>`` (see [Note: what the Trainer subclass changes]).
    ``blockshard_settings=AccelerateSettings(...)`` replaces the config file."""

    def __init__(self, *args: Any, blockshard_settings: AccelerateSettings | None = None, **kwargs: Any) -> None:
        self._blockshard_settings_arg = blockshard_settings
        super().__init__(*args, **kwargs)

    # -- the accelerator ----------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        settings = self._blockshard_settings_arg

        def build(**kwargs: Any) -> Accelerator:
            acc = Accelerator(blockshard_settings=settings, **kwargs)
            acc.blockshard_source = "HF Trainer"  # [Note: engage line]
            return acc

        with _patched(hf_trainer, "Accelerator", build):
            super().create_accelerator_and_postprocess()
        acc = self.accelerator
        assert isinstance(acc, Accelerator)
        launched = int(os.environ.get("WORLD_SIZE", "1"))  # processes the launcher started
        if (
            acc.blockshard_settings is not None
            and acc.num_processes < launched
            and _no_device()
            and not self.args.use_cpu
        ):
            raise AccelerateConfigError(
                f"blockshard's {acc.blockshard_settings.engine} engine found {acc.num_processes} process of the {launched} "
                "the launcher started, on a machine without an accelerator: TrainingArguments set up accelerate before the Trainer could (as "
                "DistributedType.NO); pass TrainingArguments(use_cpu=True, ...) to train on CPU processes"
            )

    def _blockshard(self) -> Accelerator | None:
        acc = getattr(self, "accelerator", None)
        return acc if isinstance(acc, Accelerator) and acc._blockshard_models else None

    def _inner_optimizer(self) -> Any:
        """The optimizer accelerate's ``AcceleratedOptimizer`` wraps."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        target: Any = self.model if model is None else model
        self._names_before_sharding = _names_of(target)
        return optimizer

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | bool | None
    ) -> tuple[nn.Module, Any]:  # transformers': (model, train_dataloader)
        out: tuple[nn.Module, Any] = super()._prepare_for_training(  # type: ignore[no-untyped-call]  # unannotated there
            max_steps, train_dataloader, resume_from_checkpoint
        )
        if self._blockshard() is not None:
            self._after_sharding()
        return out

    def _after_sharding(self) -> None:
        """Before the first step (and before a resume loads state): overrides keyed on parameter
        objects follow the pieces (module overrides are resolved at the first step, by attribute)."""
        if getattr(self, "_sharding_followed", False):
            return
        self._sharding_followed = True
        before = getattr(self, "_names_before_sharding", None)
        model: Any = self.model
        if before is not None:
            follow_overrides(before, model)

    # -- saving -----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        acc = self._blockshard()
        if acc is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else str(self.args.output_dir)
        settings = acc.blockshard_settings
        assert settings is not None
        model = cast(nn.Module, self.model)  # Trainer.__init__ set it (from model or model_init)
        if settings.engine == "ragged":
            blockshard.save_pretrained(model, output_dir)  # collective; rank 0 writes
            self._save_extras(output_dir)
        else:
            self._save(output_dir, state_dict=acc.get_state_dict(model))  # collective gather, rank 0 writes
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_extras(self, output_dir: str) -> None:
        """What ``Trainer._save`` writes besides the weights (tokenizer, training arguments)."""
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, hf_trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        acc = self._blockshard()
        if acc is None:
            return super()._save_optimizer_and_scheduler(output_dir)

        model: Any = self.model
        save_model(model, os.path.join(output_dir, CHECKPOINT_DIR), [self._inner_optimizer()], acc.blockshard_settings)
        scheduler: Any = self.lr_scheduler
        if self.args.should_save:
            torch.save(scheduler.state_dict(), os.path.join(output_dir, hf_trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        acc = self._blockshard()
        if acc is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)

        self._after_sharding()
        model: Any = self.model
        load_model(model, os.path.join(checkpoint, CHECKPOINT_DIR), [self._inner_optimizer()], acc.blockshard_settings)
        scheduler: Any = self.lr_scheduler
        scheduler.load_state_dict(torch.load(os.path.join(checkpoint, hf_trainer.SCHEDULER_NAME), weights_only=True))


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)
