"""Reading an Accelerate YAML config file strictly: every way a file can be unreadable, not YAML or
ambiguous is one :class:`AccelerateConfigError` naming the file, the place and the fix.

[Note: strict config files] ``yaml.safe_load`` of a broken file raises the parser's multi-line
``ParserError`` / ``ScannerError``, of non-UTF-8 bytes a ``UnicodeDecodeError``, and it keeps the
*last* of two equal keys without a word (so does accelerate, which loads the same file): a config
that says ``num_processes: 2`` and later ``num_processes: 4`` would run with 4 while the reader of
the file sees 2. Here a duplicate key (in any mapping; YAML merge keys ``<<`` excepted), a file
that is not a YAML mapping at the top, and any read or parse failure raise before any setting is
read, and a section that must be a mapping is checked before it is read (:func:`mapping`).
"""

from __future__ import annotations

import reprlib
from typing import Any

from blockshard._errors import BlockshardError
from blockshard._limits import MAX_WORLD_SIZE

__all__ = ["AccelerateConfigError", "layer_names", "mapping", "read_config", "shown"]


class AccelerateConfigError(BlockshardError):
    """A blockshard setting in an Accelerate config that is unknown, ignored or conflicts with another one."""


def layer_names(value: object, key: str, where: str = "") -> tuple[str, ...]:
    """Layer class names from a comma-separated string or a list of strings (as
    ``fsdp_transformer_layer_cls_to_wrap`` holds them), each a Python class name, else
    :class:`AccelerateConfigError` naming ``key``."""
    if value is None:
        return ()
    if not isinstance(value, (str, list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AccelerateConfigError(
            f"{key}={reprlib.repr(value)}{where} must name layer classes: a comma-separated string or a list of "
            "strings, e.g. LlamaDecoderLayer"
        )
    names = [c.strip() for c in (value if isinstance(value, str) else ",".join(value)).split(",") if c.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise AccelerateConfigError(
            f"{key}={reprlib.repr(value)}{where}: {reprlib.repr(bad[0])} is not a class name; name the layer "
            "classes, comma-separated (e.g. LlamaDecoderLayer, or Block, Head)"
        )
    return tuple(names)


def shown(value: object) -> str:
    """``repr(value)``, shortened for a message (a long list or string from a file)."""
    return reprlib.repr(value)


class _DuplicateKey(Exception):
    def __init__(self, key: object, first: int, second: int) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _loader() -> type:
    import yaml  # type: ignore[import-untyped]

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[str, Any]:
            seen: dict[object, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader reports it below
                    continue
                line = key_node.start_mark.line + 1
                if first is not None:
                    raise _DuplicateKey(key, first, line)
                seen[key] = line
            mapping: dict[str, Any] = super().construct_mapping(node, deep)
            return mapping

    return StrictLoader


def read_config(path: str) -> dict[str, Any]:
    """The YAML mapping in ``path``, or :class:`AccelerateConfigError` (see [Note: strict config files])."""
    import yaml

    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as exc:
        raise AccelerateConfigError(
            f"the Accelerate config {path!r} cannot be read ({exc.strerror or exc}); pass the YAML file that holds "
            "fsdp_config.blockshard (blockshard accelerate-config writes one)"
        ) from None
    except UnicodeDecodeError as exc:
        raise AccelerateConfigError(
            f"the Accelerate config {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8 YAML"
        ) from None
    try:
        config = yaml.load(text, Loader=_loader())  # a SafeLoader subclass: no arbitrary objects
    except _DuplicateKey as exc:
        raise AccelerateConfigError(
            f"the Accelerate config {path!r} has the key {exc.key!r} twice (lines {exc.first} and {exc.second}); "
            "YAML would keep the last one silently: remove one of them"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise AccelerateConfigError(
            f"the Accelerate config {path!r} is not valid YAML ({problem}{at}); fix the file there "
            "(blockshard accelerate-config writes a valid one)"
        ) from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise AccelerateConfigError(
            f"the Accelerate config {path!r} holds a {type(config).__name__}, not a mapping of keys "
            "(distributed_type: FSDP, fsdp_config: ...); write it as accelerate config does"
        )
    return config


def mapping(parent: dict[str, Any], key: str, path: str, prefix: str = "") -> dict[str, Any]:
    """``parent[key]`` when it is a mapping (``{}`` when absent or empty), else :class:`AccelerateConfigError`
    (``prefix`` names the mapping ``parent`` is, e.g. ``"fsdp_config."``)."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AccelerateConfigError(
            f"{prefix}{key}={shown(value)} in {path} must be a mapping of keys ({key}: on its own line, its keys "
            "indented below it); write it as one"
        )
    return value


def check_section(section: object, keys: tuple[str, ...], path: str) -> None:
    """The ``fsdp_config.blockshard`` mapping: known keys, semantics as a file can hold them, and no
    key the chosen engine would ignore."""
    if not isinstance(section, dict):
        raise AccelerateConfigError(
            f"fsdp_config.blockshard in {path} is {shown(section)}; it must be a mapping of {keys}"
        )
    unknown = sorted((k for k in section if k not in keys), key=str)
    if unknown:
        raise AccelerateConfigError(
            f"fsdp_config.blockshard in {path} has unknown keys {unknown}; the known ones are {list(keys)}"
        )
    if "layers" in section:
        raise AccelerateConfigError(
            f"fsdp_config.blockshard.layers in {path}: name the layer classes in fsdp_transformer_layer_cls_to_wrap "
            "(the Accelerate key blockshard reads), not in the blockshard mapping"
        )
    semantics = section.get("semantics")
    rules = isinstance(semantics, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in semantics.items())
    if not (semantics is None or isinstance(semantics, str) or rules):
        raise AccelerateConfigError(
            f"fsdp_config.blockshard.semantics={shown(semantics)} in {path} must be a semantics name (bnb8bit), a "
            "preset (muon), rules '[GLOB=]NAME,...' or a mapping of globs to names ({'*weight': bnb8bit})"
        )
    if section.get("engine") == "fsdp2" and "alignment_bytes" in section:
        raise AccelerateConfigError(
            f"fsdp_config.blockshard.alignment_bytes in {path} would be ignored by the fsdp2 engine (stock FSDP2 "
            "pads each parameter as torch.chunk does); remove it, or set engine: ragged"
        )


def num_processes(config: dict[str, Any], path: str) -> int:
    """``num_processes``: an integer from 1 to ``MAX_WORLD_SIZE`` (1 when absent)."""
    value = config.get("num_processes", 1)
    if isinstance(value, bool) or not isinstance(value, int):
        raise AccelerateConfigError(
            f"num_processes={shown(value)} in {path} must be a whole number of processes; set e.g. num_processes: 2"
        )
    if value < 1:
        raise AccelerateConfigError(
            f"num_processes={value!r} in {path}: blockshard needs at least one process; set 1 or more"
        )
    if value > MAX_WORLD_SIZE:
        raise AccelerateConfigError(
            f"num_processes={value!r} in {path} is more than {MAX_WORLD_SIZE:,} (2**20), the most ranks blockshard "
            "plans; set the number of processes to launch"
        )
    return value


def check_distributed(config: dict[str, Any], path: str) -> None:
    if config.get("distributed_type") != "FSDP":
        raise AccelerateConfigError(
            f"distributed_type={shown(config.get('distributed_type'))} in {path} ignores fsdp_config (accelerate "
            "launch then starts one process on CPU or exports no FSDP settings); set distributed_type: FSDP"
        )


_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "NO_WRAP")


def layers(section: dict[str, Any], fsdp: dict[str, Any], path: str) -> tuple[str, ...]:
    """The layer classes of ``fsdp_transformer_layer_cls_to_wrap`` under ``TRANSFORMER_BASED_WRAP``."""
    classes = layer_names(
        fsdp.get("fsdp_transformer_layer_cls_to_wrap"), "fsdp_transformer_layer_cls_to_wrap", f" in {path}"
    )
    wrap = fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP" if classes else "NO_WRAP")
    if wrap not in _WRAP_POLICIES:
        raise AccelerateConfigError(
            f"fsdp_auto_wrap_policy={wrap} in {path} is not supported by blockshard (groups follow the layer "
            "classes); set TRANSFORMER_BASED_WRAP with fsdp_transformer_layer_cls_to_wrap, or NO_WRAP for one group"
        )
    return classes if wrap == "TRANSFORMER_BASED_WRAP" else ()


def flag(fsdp: dict[str, Any], key: str, path: str) -> bool:
    """A true/false key of ``fsdp_config`` (false when absent or empty; ``'true'`` / ``'false'`` as accelerate writes them)."""
    value = fsdp.get(key, False)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value is None or isinstance(value, bool):
        return bool(value)
    raise AccelerateConfigError(f"{key}={shown(value)} in {path} must be true or false")


def reshard(fsdp: dict[str, Any], path: str) -> bool:
    """``fsdp_reshard_after_forward``: true / false (or FSDP1's FULL_SHARD / SHARD_GRAD_OP); true when absent."""
    value = fsdp.get("fsdp_reshard_after_forward", True)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.upper() in ("FULL_SHARD", "TRUE"):
        return True
    if isinstance(value, str) and value.upper() in ("SHARD_GRAD_OP", "FALSE"):
        return False
    raise AccelerateConfigError(
        f"fsdp_reshard_after_forward={shown(value)} in {path} is not supported by blockshard (a number or a list "
        "would read as true); set true (free the gathered parameters after forward) or false (keep them)"
    )


def mixed_precision(config: dict[str, Any], path: str) -> str:
    """``mixed_precision``: a string; absent, empty or YAML's unquoted ``no`` (false) is ``"no"``."""
    value = config.get("mixed_precision")
    if value is None or value is False:
        return "no"
    if not isinstance(value, str):
        raise AccelerateConfigError(
            f'mixed_precision={shown(value)} in {path} is not supported by blockshard; set mixed_precision: "no" '
            "or bf16 (bf16 parameters, fp32 gradient reduction)"
        )
    return value


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


def check_unsupported(config: dict[str, Any], fsdp: dict[str, Any], path: str) -> None:
    for key, (neutral, what) in _UNSUPPORTED.items():
        if key in fsdp and not any(type(fsdp[key]) is type(n) and fsdp[key] == n for n in neutral):
            raise AccelerateConfigError(
                f"{key}={shown(fsdp[key])} in {path} would be ignored by blockshard ({what}); remove it or set "
                f"{neutral[0]!r}"
            )
    version = fsdp.get("fsdp_version", 2)
    if str(version) != "2":
        raise AccelerateConfigError(
            f"fsdp_version={shown(version)} in {path}: blockshard's settings follow FSDP2's keys (its groups are "
            "FSDP2-like); set fsdp_version: 2"
        )
    dynamo = mapping(config, "dynamo_config", path).get("dynamo_backend", "NO")
    if str(dynamo).upper() != "NO":
        raise AccelerateConfigError(
            f"dynamo_config.dynamo_backend={shown(dynamo)} in {path} would be ignored: blockshard's prepare() returns "
            "the sharded model uncompiled; remove dynamo_config (or set dynamo_backend: 'NO') and call torch.compile "
            "yourself"
        )
