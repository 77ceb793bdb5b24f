"""``blockshard.integrations.accelerate``: ``accelerate launch --config_file ...`` trains with blockshard.

The script stays an ordinary Accelerate script; the one added line takes blockshard's
``Accelerator`` (a subclass of accelerate's, identical without a blockshard config)::

    from accelerate import Accelerator
    from blockshard.integrations.accelerate import Accelerator  # the one added line

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)   # shards with blockshard here
    ...
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)      # the global norm over all ranks
    accelerator.save_state("ckpt")                            # sharded, atomic (DCP); reshards on load
    accelerator.load_state("ckpt")
    full = accelerator.get_state_dict(model)                  # full tensors (collective)

Everything else comes from the config file (``blockshard accelerate-config`` writes one)::

    distributed_type: FSDP           # starts num_processes processes, on CPU too (with use_cpu: true)
    fsdp_config:
      fsdp_version: 2
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer   # one blockshard group per layer, then the root
      fsdp_reshard_after_forward: true
      blockshard:                    # read by blockshard, ignored by accelerate
        engine: ragged               # ragged (blockshard.fully_shard) | fsdp2 (stock FSDP2, block-aware)
        semantics: {"*proj.weight": bnb8bit}   # a name, a preset (muon, adamw) or rules {glob: name}
        policy: auto                 # auto | whole | owner (ragged engine)
        alignment_bytes: 16
    mixed_precision: "no"            # or bf16 (bf16 parameters, fp32 gradient reduction)
    num_processes: 2
    use_cpu: true

Of accelerate's own FSDP keys blockshard also honours ``fsdp_sync_module_states`` (rank 0's weights
broadcast before sharding), ``fsdp_cpu_ram_efficient_loading`` (ragged engine: the shards filled from
rank 0, the other ranks may build on meta) and ``fsdp_activation_checkpointing`` (``checkpoint_wrapper``
around each layer module); ``num_processes: 1`` runs as a world of one rank.

The processes find the file through ``BLOCKSHARD_ACCELERATE_CONFIG`` or, by default, the
``--config_file`` of the ``accelerate launch`` that started them ([Note: where the settings live] in
``_settings.py``). Every setting is checked by type and range ([Note: strict config files] in
``_config_file.py``), and settings blockshard would ignore or that conflict raise
:class:`AccelerateConfigError` naming the key, the value and the fix. The DeepSpeed engine:
``distributed_type: DEEPSPEED`` with a ``deepspeed_config_file`` whose JSON has a ``"blockshard"``
section; this ``Accelerator`` then installs blockshard's DeepSpeed hook (block-aligned ZeRO-1/2).

The Hugging Face ``Trainer`` builds its ``Accelerator`` itself: ``from
blockshard.integrations.accelerate import Trainer`` (a ``transformers.Trainer`` that builds this one;
``_trainer.py``). Other code that builds accelerate's ``Accelerator`` passes this class where it is built; ``AccelerateSettings(...)`` as ``Accelerator(blockshard_settings=...)`` replaces
the config file (a test or a notebook).
See docs/accelerate.md for what each method does (and [Note: what the subclass changes]).
"""

from typing import TYPE_CHECKING

from ._settings import (
    CONFIG_ENV,
    ENGINES,
    AccelerateConfigError,
    AccelerateSettings,
    find_config_file,
    load_settings,
)

__all__ = [
    "CHECKPOINT_DIR",
    "CONFIG_ENV",
    "ENGINES",
    "AccelerateConfigError",
    "AccelerateSettings",
    "Accelerator",
    "Trainer",
    "find_config_file",
    "follow_overrides",
    "load_settings",
]

if TYPE_CHECKING:  # what __getattr__ loads, as mypy sees it (`X as X`: exported)
    from ._accelerator import CHECKPOINT_DIR as CHECKPOINT_DIR
    from ._accelerator import Accelerator as Accelerator
    from ._trainer import Trainer as Trainer
    from ._trainer import follow_overrides as follow_overrides


def __getattr__(name: str) -> object:
    if name in ("Accelerator", "CHECKPOINT_DIR"):  # imports accelerate and torch: only when used
        from . import _accelerator

        return getattr(_accelerator, name)
    if name in ("Trainer", "follow_overrides"):  # imports transformers: only when used
        from . import _trainer

        return getattr(_trainer, name)
    raise AttributeError(f"module 'blockshard.integrations.accelerate' has no attribute {name!r}")
