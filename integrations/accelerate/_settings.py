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
from pathlib import Path
from typing import Any

from blockshard._errors import BlockshardError
from blockshard.planner._policy import check_policy
from blockshard.semantics import SemanticsRules

__all__ = ["CONFIG_ENV", "ENGINES", "AccelerateConfigError", "AccelerateSettings", "find_config_file", "load_settings"]

CONFIG_ENV = "BLOCKSHARD_ACCELERATE_CONFIG"
ENGINES = ("ragged", "fsdp2", "deepspeed")
_KEYS = ("engine", "semantics", "policy", "alignment_bytes", "layers")


class AccelerateConfigError(BlockshardError):
    """A blockshard setting in an Accelerate config that is unknown, ignored or conflicts with another one."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AccelerateSettings:
    """blockshard's settings for one Accelerate run (the ``fsdp_config.blockshard`` mapping and the
    standard keys it uses: ``fsdp_transformer_layer_cls_to_wrap``, ``fsdp_reshard_after_forward``,
    ``mixed_precision``)."""

    engine: str = "ragged"
    semantics: Any = None  # a name, a preset or rules {glob: name}, as for blockshard.fully_shard
    policy: str = "auto"
    alignment_bytes: int = 16
    layers: tuple[str, ...] = ()  # class names sharded bottom-up before the root
    reshard_after_forward: bool = True
    mixed_precision: str = "no"
    sync_module_states: bool = False  # broadcast rank 0's weights before sharding ([Note: weights from rank 0])
    cpu_ram_efficient_loading: bool = False  # rank 0 holds the weights, the others may be on meta
    activation_checkpointing: bool = False  # checkpoint_wrapper on every layer module before sharding
    source: str = ""

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        if self.engine not in ENGINES:
            raise AccelerateConfigError(
                f"blockshard engine={self.engine!r}{where} is not one of {', '.join(ENGINES)}; set engine to one of them"
            )
        if self.engine == "deepspeed":
            raise AccelerateConfigError(
                f"blockshard engine='deepspeed'{where}: the DeepSpeed engine takes its settings from the "
                '"blockshard" section of the DeepSpeed JSON config (deepspeed_config_file), not from fsdp_config; '
                "use distributed_type: DEEPSPEED with that file (blockshard accelerate-config --engine deepspeed writes it)"
            )
        if (
            isinstance(self.alignment_bytes, bool)
            or not isinstance(self.alignment_bytes, int)
            or self.alignment_bytes < 1
        ):
            raise AccelerateConfigError(
                f"blockshard alignment_bytes={self.alignment_bytes!r}{where} must be a positive integer (16 suits most kernels)"
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
        if self.engine == "fsdp2" and self.policy == "owner":
            raise AccelerateConfigError(
                f"blockshard policy='owner'{where} needs the ragged engine (stock FSDP2 cuts parameters by torch.chunk); "
                "set engine: ragged, or policy: auto"
            )

        try:
            check_policy(self.policy, "blockshard policy")
            SemanticsRules.coerce(self.semantics)
        except BlockshardError as exc:
            raise AccelerateConfigError(f"{exc}{where}") from exc

    def fully_shard_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"semantics": self.semantics, "reshard_after_forward": self.reshard_after_forward}
        if self.engine == "ragged":
            kwargs.update(policy=self.policy, alignment_bytes=self.alignment_bytes)
        if self.mixed_precision == "bf16":
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return kwargs


def _parent_config_file() -> str | None:
    """The ``--config_file`` of the ``accelerate launch`` process that started this one, if it is one."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    try:
        at = next(i for i, a in enumerate(argv) if a == "launch" and i > 0 and "accelerate" in argv[i - 1])
    except StopIteration:
        return None
    cwd = Path(f"/proc/{os.getppid()}/cwd")
    for i, arg in enumerate(argv[at + 1 :], start=at + 1):
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
    None when it has no ``fsdp_config.blockshard`` mapping (stock Accelerate then)."""
    import yaml  # type: ignore[import-untyped]

    path = path or find_config_file()
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    fsdp = config.get("fsdp_config") or {}
    section = fsdp.get("blockshard")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise AccelerateConfigError(f"fsdp_config.blockshard in {path} is {section!r}; it must be a mapping of {_KEYS}")
    unknown = sorted(set(section) - set(_KEYS))
    if unknown:
        raise AccelerateConfigError(
            f"fsdp_config.blockshard in {path} has unknown keys {unknown}; the known ones are {list(_KEYS)}"
        )
    _check_distributed(config, path)
    _check_unsupported(config, fsdp, path)
    return AccelerateSettings(
        **{k: section[k] for k in ("engine", "semantics", "policy", "alignment_bytes") if k in section},
        layers=_layers(section, fsdp, path),
        reshard_after_forward=_reshard(fsdp, path),
        mixed_precision=str(config.get("mixed_precision") or "no"),
        sync_module_states=_flag(fsdp, "fsdp_sync_module_states", path),
        cpu_ram_efficient_loading=_flag(fsdp, "fsdp_cpu_ram_efficient_loading", path),
        activation_checkpointing=_flag(fsdp, "fsdp_activation_checkpointing", path),
        source=path,
    )


def _check_distributed(config: dict, path: str) -> None:
    if config.get("distributed_type") != "FSDP":
        raise AccelerateConfigError(
            f"distributed_type={config.get('distributed_type')!r} in {path} ignores fsdp_config (accelerate launch "
            "then starts one process on CPU or exports no FSDP settings); set distributed_type: FSDP"
        )
    if int(config.get("num_processes", 1)) < 1:
        raise AccelerateConfigError(
            f"num_processes={config.get('num_processes')!r} in {path}: blockshard needs at least one process; set 1 "
            "or more"
        )


def _layers(section: dict, fsdp: dict, path: str) -> tuple[str, ...]:
    wrap = fsdp.get(
        "fsdp_auto_wrap_policy",
        "TRANSFORMER_BASED_WRAP" if fsdp.get("fsdp_transformer_layer_cls_to_wrap") else "NO_WRAP",
    )
    if wrap not in _WRAP_POLICIES:
        raise AccelerateConfigError(
            f"fsdp_auto_wrap_policy={wrap} in {path} is not supported by blockshard (groups follow the layer "
            "classes); set TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap, or NO_WRAP for one group"
        )
    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap") or ""
    if "layers" in section:
        raise AccelerateConfigError(
            f"fsdp_config.blockshard.layers in {path}: name the layer classes in fsdp_transformer_layer_cls_to_wrap "
            "(the Accelerate key blockshard reads), not in the blockshard mapping"
        )
    names = [c.strip() for c in (classes if isinstance(classes, str) else ",".join(classes)).split(",") if c.strip()]
    return tuple(names) if wrap == "TRANSFORMER_BASED_WRAP" else ()


def _flag(fsdp: dict, key: str, path: str) -> bool:
    value = fsdp.get(key, False)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value is None or isinstance(value, bool):
        return bool(value)
    raise AccelerateConfigError(f"{key}={value!r} in {path} must be true or false")


def _reshard(fsdp: dict, path: str) -> bool:
    value = fsdp.get("fsdp_reshard_after_forward", True)
    if isinstance(value, str):
        if value.upper() in ("FULL_SHARD", "TRUE"):
            return True
        if value.upper() in ("SHARD_GRAD_OP", "FALSE"):
            return False
        raise AccelerateConfigError(
            f"fsdp_reshard_after_forward={value!r} in {path} is not supported by blockshard; set true or false"
        )
    return bool(value)


# fsdp_config keys blockshard does not honour: the values under which ignoring them changes nothing
# (the first one is the one the message suggests), and what the key would have asked for.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "fsdp_offload_params": ((False,), "CPU offload of parameters"),
    "fsdp_activation_checkpointing_offload": ((False,), "offloaded activation checkpointing"),
    "fsdp_ignored_modules": ((None,), "modules left unsharded"),
    "fsdp_sharding_strategy": (("FULL_SHARD", 1), "FSDP1's strategy; use fsdp_reshard_after_forward"),
    "fsdp_state_dict_type": (
        ("SHARDED_STATE_DICT", None),
        "the save_state format: blockshard always writes one sharded DCP checkpoint "
        "(accelerator.get_state_dict gives full tensors)",
    ),
    "fsdp_float8_all_gather": ((False,), "float8 all-gathers"),
    "fsdp_forward_prefetch": ((False,), "FSDP1's forward prefetch"),
    "fsdp_backward_prefetch": ((None, "NO_PREFETCH"), "FSDP1's backward prefetch"),
    "fsdp_use_orig_params": ((True, None), "FSDP1's flat parameters (blockshard keeps the parameters' names)"),
    "fsdp_min_num_params": ((None, 0), "SIZE_BASED_WRAP's size"),
}
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "NO_WRAP")


def _check_unsupported(config: dict, fsdp: dict, path: str) -> None:
    for key, (neutral, what) in _UNSUPPORTED.items():
        if key in fsdp and fsdp[key] not in neutral:
            raise AccelerateConfigError(
                f"{key}={fsdp[key]!r} in {path} would be ignored by blockshard ({what}); remove it or set {neutral[0]!r}"
            )
    version = fsdp.get("fsdp_version", 2)
    if str(version) != "2":
        raise AccelerateConfigError(
            f"fsdp_version={version!r} in {path}: blockshard's settings follow FSDP2's keys (its groups are FSDP2-like); "
            "set fsdp_version: 2"
        )
    dynamo = (config.get("dynamo_config") or {}).get("dynamo_backend", "NO")
    if str(dynamo).upper() != "NO":
        raise AccelerateConfigError(
            f"dynamo_config.dynamo_backend={dynamo!r} in {path} would be ignored: blockshard's prepare() returns the "
            "sharded model uncompiled; remove dynamo_config (or set dynamo_backend: 'NO') and call torch.compile yourself"
        )
