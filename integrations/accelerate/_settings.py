"""Where blockshard's Accelerate settings live, and their validation.

[Note: where the settings live] Accelerate rejects unknown top-level YAML keys and drops unknown
``fsdp_config`` keys without exporting them: ``accelerate launch`` passes the processes only
``ACCELERATE_*`` / ``FSDP_*`` variables of the keys it knows (measured with accelerate 1.15,
docs/accelerate.md), and no variable names the config file. So blockshard's settings are a
``blockshard:`` mapping inside ``fsdp_config`` (accelerate loads and ignores it), and each process
reads the YAML file itself: from ``BLOCKSHARD_ACCELERATE_CONFIG`` when set (any launcher), else from
the ``--config_file`` of the ``accelerate launch`` process that started it (its parent, read from
``/proc``; accelerate's default config file when none was passed). For the DeepSpeed engine the
settings are the ``"blockshard"`` section of the DeepSpeed JSON config (``deepspeed_config_file``),
which blockshard's DeepSpeed hook reads, as without Accelerate.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from pathlib import Path
from typing import Any

from blockshard._errors import BlockshardError
from blockshard._limits import MAX_WORLD_SIZE
from blockshard.planner._policy import check_policy
from blockshard.planner._units import check_alignment_bytes
from blockshard.semantics import SemanticsRules

from . import _config_file as cf
from ._config_file import AccelerateConfigError, layer_names

__all__ = [
    "CONFIG_ENV",
    "ENGINES",
    "AccelerateConfigError",
    "AccelerateSettings",
    "find_config_file",
    "layer_names",
    "load_settings",
]

CONFIG_ENV = "BLOCKSHARD_ACCELERATE_CONFIG"
ENGINES = ("ragged", "fsdp2", "deepspeed")
_KEYS = ("engine", "semantics", "policy", "alignment_bytes", "layers")


_BOOLS = ("reshard_after_forward", "sync_module_states", "cpu_ram_efficient_loading", "activation_checkpointing")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AccelerateSettings:
    """blockshard's settings for one Accelerate run (the ``fsdp_config.blockshard`` mapping and the
    standard keys it uses: ``fsdp_transformer_layer_cls_to_wrap``, ``fsdp_reshard_after_forward``,
    ``mixed_precision``, ``num_processes``). Every field is checked by type and range; a bad one
    raises :class:`AccelerateConfigError` naming it, the value and the fix."""

    engine: str = "ragged"
    semantics: Any = None  # a name, a preset or rules {glob: name}, as for blockshard.fully_shard
    policy: str = "auto"
    alignment_bytes: int = 16  # a power of two <= MAX_ALIGNMENT_BYTES (4096)
    layers: tuple[str, ...] = ()  # class names sharded bottom-up before the root (a list becomes a tuple)
    reshard_after_forward: bool = True
    mixed_precision: str = "no"
    sync_module_states: bool = False  # broadcast rank 0's weights before sharding ([Note: weights from rank 0])
    cpu_ram_efficient_loading: bool = False  # rank 0 holds the weights, the others may be on meta
    activation_checkpointing: bool = False  # checkpoint_wrapper on every layer module before sharding
    num_processes: int = 1  # the config's; more than 1 needs a launcher (Accelerator checks WORLD_SIZE)
    source: str = ""

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        self._check_types(where)
        if self.engine == "deepspeed":
            raise AccelerateConfigError(
                f"blockshard engine='deepspeed'{where}: the DeepSpeed engine takes its settings from the "
                '"blockshard" section of the DeepSpeed JSON config (deepspeed_config_file), not from fsdp_config; '
                "use distributed_type: DEEPSPEED with that file (blockshard accelerate-config --engine deepspeed writes it)"
            )
        if self.mixed_precision not in ("no", "bf16"):
            raise AccelerateConfigError(
                f"mixed_precision={self.mixed_precision!r}{where} is not supported by blockshard's {self.engine} engine "
                "(it runs 'no' or 'bf16': bf16 parameters, fp32 gradient reduction); set mixed_precision to one of them"
            )
        if self.engine == "fsdp2" and self.cpu_ram_efficient_loading:
            raise AccelerateConfigError(
                f"fsdp_cpu_ram_efficient_loading=True{where} needs the ragged engine (it fills the shards from rank 0 "
                "one group at a time); set engine: ragged, or fsdp_cpu_ram_efficient_loading: false (every rank then "
                "loads the weights; fsdp_sync_module_states: true makes them rank 0's)"
            )
        if self.activation_checkpointing and not self.layers:
            raise AccelerateConfigError(
                f"fsdp_activation_checkpointing=True{where} checkpoints the layer modules, but no layer class is named; "
                "set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap, "
                "or fsdp_activation_checkpointing: false"
            )

        try:
            check_policy(self.policy, "blockshard policy")
            SemanticsRules.coerce(self.semantics)
        except BlockshardError as exc:
            raise AccelerateConfigError(f"{exc}{where}") from exc
        if self.engine == "fsdp2" and self.policy != "auto":
            raise AccelerateConfigError(
                f"blockshard policy={self.policy!r}{where} needs the ragged engine (stock FSDP2 cuts parameters by "
                "torch.chunk); set engine: ragged, or policy: auto"
            )

    def _check_types(self, where: str) -> None:

        if self.engine not in ENGINES:
            raise AccelerateConfigError(
                f"blockshard engine={reprlib.repr(self.engine)}{where} is not one of {', '.join(ENGINES)}; set engine "
                "to one of them"
            )
        if isinstance(self.layers, str):
            raise AccelerateConfigError(
                f"AccelerateSettings(layers={self.layers!r}){where} is a str, not a tuple of class names; pass "
                f"layers=({self.layers!r},)"
            )
        object.__setattr__(self, "layers", layer_names(self.layers, "AccelerateSettings layers", where))
        for name in _BOOLS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise AccelerateConfigError(
                    f"AccelerateSettings {name}={reprlib.repr(value)}{where} must be True or False (a str such as "
                    f"'no' would read as true); pass a bool"
                )
        try:
            check_alignment_bytes(self.alignment_bytes, "blockshard alignment_bytes", AccelerateConfigError)
        except AccelerateConfigError as exc:
            raise AccelerateConfigError(f"{exc}{where}") from None
        n = self.num_processes
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WORLD_SIZE:
            raise AccelerateConfigError(
                f"num_processes={reprlib.repr(n)}{where} must be an integer from 1 to {MAX_WORLD_SIZE:,} (2**20, the "
                "most ranks blockshard plans); set the number of processes to launch, e.g. 2"
            )

    def fully_shard_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"semantics": self.semantics, "reshard_after_forward": self.reshard_after_forward}
        if self.engine == "ragged":
            kwargs.update(policy=self.policy, alignment_bytes=self.alignment_bytes)
        if self.mixed_precision == "bf16":
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return kwargs


def accelerate_launch_argv() -> list[str] | None:
    """The arguments after ``launch`` of the ``accelerate launch`` process that started this one
    (its parent, read from ``/proc``), or None when no such process started it."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    at = next((i for i, a in enumerate(argv) if a == "launch" and i > 0 and "accelerate" in argv[i - 1]), None)
    return None if at is None else argv[at + 1 :]


def _parent_config_file() -> str | None:
    """The ``--config_file`` of the ``accelerate launch`` process that started this one, if it is one."""
    argv = accelerate_launch_argv()
    if argv is None:
        return None
    cwd = Path(f"/proc/{os.getppid()}/cwd")
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--config_file" and i + 1 < len(argv) else None
        if arg.startswith("--config_file="):
            value = arg.split("=", 1)[1]
        if value is not None:
            return str(value if os.path.isabs(value) else cwd.resolve() / value)
    from accelerate.commands.config import default_config_file

    return default_config_file if os.path.isfile(default_config_file) else None


def find_config_file() -> str | None:
    """The Accelerate YAML file this process was launched with (see [Note: where the settings live])."""
    path = os.environ.get(CONFIG_ENV)
    if path:
        if not os.path.isfile(path):
            raise AccelerateConfigError(
                f"{CONFIG_ENV}={path!r} is not a file; point it to the Accelerate YAML config that holds "
                "fsdp_config.blockshard (blockshard accelerate-config writes one)"
            )
        return path
    return _parent_config_file()


def load_settings(path: str | None = None) -> AccelerateSettings | None:
    """blockshard's settings from an Accelerate YAML config (default: :func:`find_config_file`), or
    None when it has no ``fsdp_config.blockshard`` mapping (stock Accelerate then). Every key it
    reads is checked by type and range ([Note: strict config files] in ``_config_file.py``)."""
    path = path or find_config_file()
    if path is None:
        return None
    config = cf.read_config(path)
    fsdp = cf.mapping(config, "fsdp_config", path)
    section = fsdp.get("blockshard")
    if section is None:
        return None
    cf.check_section(section, _KEYS, path)
    cf.check_distributed(config, path)
    cf.check_unsupported(config, fsdp, path)
    return AccelerateSettings(
        **{k: section[k] for k in ("engine", "semantics", "policy", "alignment_bytes") if k in section},
        layers=cf.layers(section, fsdp, path),
        reshard_after_forward=cf.reshard(fsdp, path),
        mixed_precision=cf.mixed_precision(config, path),
        sync_module_states=cf.flag(fsdp, "fsdp_sync_module_states", path),
        cpu_ram_efficient_loading=cf.flag(fsdp, "fsdp_cpu_ram_efficient_loading", path),
        activation_checkpointing=cf.flag(fsdp, "fsdp_activation_checkpointing", path),
        num_processes=cf.num_processes(config, path),
        source=path,
    )
