"""The ``"blockshard": {...}`` section of a DeepSpeed JSON config, and the DeepSpeed version guard.

Keys (all optional)::

    "blockshard": {
        "enabled": true,                     # false: plain DeepSpeed (the section is ignored)
        "semantics": {"*weight": "bnb8bit"}, # rules: a mapping glob -> spec, a spec string
                                             # ("bnb8bit", "matrix", "*.mlp.*=nf4,bnb8bit") or a list of them
        "alignment_bytes": 16,               # bytes: parameter starts and partition size are multiples
        "allow_untested_deepspeed": false,   # run on a DeepSpeed version the hook was not tested with
        "unused_parameters": "exact",        # "exact": a parameter no rank got a gradient for is skipped,
                                             # as on one process (refused where the hook cannot skip it);
                                             # "stock": DeepSpeed's own update of it ([Note: unused parameters])
        "owner_compute": "auto"              # ZeRO-3: "auto" steps optimizers that are not element-wise on
                                             # runs ([Note: ZeRO-3 owner-compute]), element-wise ones as stock;
                                             # "always": element-wise ones on runs too (each rank's partition of
                                             # each parameter its own tensor and state: no bytes move, and a
                                             # parameter no rank used is skipped exactly)
    }

DeepSpeed 0.19.8 ignores unknown top-level keys (``DeepSpeedConfig`` reads the keys it knows and
never checks for others; ``tests/integrations/test_deepspeed.py`` asserts this), so the section is
passed on to DeepSpeed unchanged. Every error is a :class:`DeepSpeedHookError` (a ``ValueError``)
whose message names the key, e.g. ``blockshard.alignment_bytes``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from blockshard._errors import BlockshardError
from blockshard.planner._units import check_alignment_bytes
from blockshard.semantics import SemanticsRules

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "SECTION",
    "TESTED_DEEPSPEED_VERSIONS",
    "DeepSpeedHookError",
    "HookConfig",
    "check_deepspeed_version",
    "find_config",
    "load_config",
    "parse_section",
]

SECTION = "blockshard"
#: DeepSpeed versions the hook was tested with (it patches private internals of ZeRO-1/2).
TESTED_DEEPSPEED_VERSIONS: tuple[str, ...] = ("0.19.8",)
#: Setting this environment variable to 1 has the effect of ``"allow_untested_deepspeed": true``.
ALLOW_UNTESTED_ENV = "BLOCKSHARD_ALLOW_UNTESTED_DEEPSPEED"
_KEYS = ("enabled", "semantics", "alignment_bytes", "allow_untested_deepspeed", "unused_parameters", "owner_compute")
_UNUSED = ("exact", "stock")
_OWNER = ("auto", "always")


class DeepSpeedHookError(BlockshardError):
    """Bad ``blockshard`` config, an unsupported DeepSpeed setup or version (the message says which)."""


@dataclass(frozen=True)
class HookConfig:
    """The parsed section. ``rules`` is what :meth:`SemanticsRules.coerce` made of ``semantics``."""

    enabled: bool = True
    semantics: object = None
    rules: SemanticsRules = field(default_factory=SemanticsRules)
    alignment_bytes: int = 16
    allow_untested_deepspeed: bool = False
    unused_parameters: str = "exact"
    owner_compute: str = "auto"


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedHookError(f"{SECTION}.{key}={value!r} must be true or false")
    return value


def parse_section(section: object) -> HookConfig:
    """Validate a ``"blockshard"`` section (a mapping; ``None`` means defaults)."""
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise DeepSpeedHookError(
            f'{SECTION}={section!r} must be a JSON object such as {{"semantics": {{"*weight": "bnb8bit"}}}}'
        )
    unknown = sorted(set(section) - set(_KEYS))
    if "alignment" in unknown:
        raise DeepSpeedHookError(
            f"{SECTION}.alignment is now {SECTION}.alignment_bytes (a number of bytes, as before); rename the key"
        )
    if unknown:
        raise DeepSpeedHookError(f"{SECTION}.{unknown[0]} is not a known key; known keys: {', '.join(_KEYS)}")
    enabled = _bool("enabled", section.get("enabled", True))
    allow = _bool("allow_untested_deepspeed", section.get("allow_untested_deepspeed", False))
    alignment = check_alignment_bytes(
        section.get("alignment_bytes", 16), f"{SECTION}.alignment_bytes", DeepSpeedHookError
    )
    unused = section.get("unused_parameters", "exact")
    if unused not in _UNUSED:
        raise DeepSpeedHookError(
            f"{SECTION}.unused_parameters={unused!r} must be 'exact' (a parameter no rank got a gradient for is "
            "skipped, as on one process) or 'stock' (DeepSpeed's own update of it)"
        )
    owner = section.get("owner_compute", "auto")
    if owner not in _OWNER:
        raise DeepSpeedHookError(
            f"{SECTION}.owner_compute={owner!r} must be 'auto' (ZeRO-3 steps element-wise optimizers as stock "
            "DeepSpeed, the others on runs at owners) or 'always' (element-wise optimizers on runs too)"
        )
    semantics = section.get("semantics")
    raw = semantics
    if isinstance(semantics, Sequence) and not isinstance(semantics, str):
        if not all(isinstance(x, str) for x in semantics):
            raise DeepSpeedHookError(
                f"{SECTION}.semantics={semantics!r}: a list must hold semantics strings such as '*.mlp.*=bnb8bit'"
            )
        semantics = ",".join(semantics) if semantics else None
    if semantics is not None and not isinstance(semantics, (str, Mapping)):
        raise DeepSpeedHookError(
            f"{SECTION}.semantics={semantics!r} must be a semantics string ('bnb8bit'), a "
            "mapping glob -> semantics ({'*weight': 'bnb8bit'}) or a list of semantics strings"
        )
    if isinstance(semantics, Mapping) and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in semantics.items()
    ):
        raise DeepSpeedHookError(f"{SECTION}.semantics={semantics!r}: globs and semantics must be strings")
    try:
        rules = SemanticsRules.coerce(semantics)
    except ValueError as e:
        raise DeepSpeedHookError(f"{SECTION}.semantics={raw!r} is invalid: {e}") from None
    return HookConfig(enabled, raw, rules, alignment, allow, unused, owner)


def load_config(config: object) -> dict[str, Any]:
    """A DeepSpeed config as a dict: a dict as is, a path (str or ``os.PathLike``) read by DeepSpeed's loader."""
    if isinstance(config, Mapping):
        return config if isinstance(config, dict) else dict(config)
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    loaded: dict[str, Any] = load_ds_config(config)
    return loaded


def find_config(
    args: object = None, config: object = None, config_params: object = None
) -> tuple[str, object] | tuple[None, None]:
    """The config ``deepspeed.initialize`` will use: ``config``, ``config_params`` or ``args.deepspeed_config``.

    Returns ``(which, value)`` with ``which`` one of ``"config"``, ``"config_params"``, ``"args"`` or
    ``(None, None)`` when there is none (DeepSpeed then raises its own error).
    """
    if config is not None:
        return "config", config
    if config_params is not None:
        return "config_params", config_params
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, attr, None) if args is not None else None
        if value is not None:
            return "args", value
    return None, None


def check_deepspeed_version(allow_untested: bool = False) -> str:
    """Return ``deepspeed.__version__``; raise unless it is tested or ``allow_untested`` (or the env var)."""
    import deepspeed

    version = str(deepspeed.__version__)
    base = version.split("+")[0]
    if base in TESTED_DEEPSPEED_VERSIONS or allow_untested or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return version
    raise DeepSpeedHookError(
        f"blockshard's DeepSpeed hook patches ZeRO-1/2 internals (DeepSpeedZeroOptimizer's flat layout) and "
        f"was tested with DeepSpeed {', '.join(TESTED_DEEPSPEED_VERSIONS)}; this is DeepSpeed {version}. "
        f'Install deepspeed=={TESTED_DEEPSPEED_VERSIONS[-1]}, or set "{SECTION}": '
        '{"allow_untested_deepspeed": true} in the DeepSpeed config (or '
        f"{ALLOW_UNTESTED_ENV}=1) to run anyway and check the results yourself"
    )
