"""The config files ``blockshard accelerate-config`` writes: an Accelerate YAML (and, for the
DeepSpeed engine, the DeepSpeed JSON it points to), with comments."""

from __future__ import annotations

import json
from pathlib import Path

from blockshard._limits import MAX_LOCAL_PROCESSES
from blockshard.planner._policy import check_policy
from blockshard.semantics import SemanticsRules

from ._settings import ENGINES, AccelerateConfigError, layer_names

__all__ = ["write_configs"]

_FSDP = """\
# Written by: blockshard accelerate-config {argv}
# Launch:     accelerate launch --config_file {yaml} your_script.py
# The script: an ordinary Accelerate script with one added line,
#             from blockshard.integrations.accelerate import Accelerator
compute_environment: LOCAL_MACHINE
distributed_type: FSDP          # makes accelerate launch start num_processes processes (MULTI_CPU starts one)
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: {layers}   # your layer classes: one group each, then the root
  fsdp_reshard_after_forward: true
  blockshard:                   # read by blockshard from this file, ignored by accelerate
    engine: {engine}            # ragged: blockshard.fully_shard; fsdp2: stock FSDP2, block-aligned
    semantics: {semantics}      # a name (bnb8bit, nf4, shampoo:1024), a preset (muon, adamw) or '[GLOB=]NAME,...'
{ragged_only}mixed_precision: "no"            # or bf16 (bf16 parameters, fp32 gradient reduction)
num_machines: 1
num_processes: {num_processes}
use_cpu: {cpu}                  # true: gloo on CPU
main_process_port: 0            # a free port
"""

_RAGGED_ONLY = """\
    policy: {policy}            # auto (by bytes moved) | whole (each compute unit on one rank) | owner
    alignment_bytes: 16         # segment alignment
"""

_DEEPSPEED = """\
# Written by: blockshard accelerate-config {argv}
# Launch:     {env}accelerate launch --config_file {yaml} your_script.py
# The script: an ordinary Accelerate script with one added line,
#             from blockshard.integrations.accelerate import Accelerator
# blockshard's settings are the "blockshard" section of {json_name} (DeepSpeed ignores unknown keys).
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {json}   # relative to the directory you launch from
  deepspeed_multinode_launcher: standard
num_machines: 1
num_processes: {num_processes}
use_cpu: false                  # accelerate turns DeepSpeed off with use_cpu: true{cpu_note}
main_process_port: 0            # a free port
"""


def _yaml_scalar(text: str) -> str:
    return json.dumps(text)  # a JSON string is a YAML scalar


def write_configs(
    out: str | Path,
    *,
    engine: str,
    num_processes: int,
    cpu: bool,
    semantics: str = "elementwise",
    policy: str = "auto",
    layers: str = "LlamaDecoderLayer",
    argv: str = "",
) -> list[Path]:
    """Write ``OUT/accelerate.yaml`` (and ``OUT/deepspeed.json`` for ``engine="deepspeed"``); return the paths."""

    if engine not in ENGINES:
        raise AccelerateConfigError(f"--engine={engine!r} is not one of {', '.join(ENGINES)}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise AccelerateConfigError(f"--num-processes={num_processes!r}: pass 1 or more")
    if num_processes > MAX_LOCAL_PROCESSES:
        raise AccelerateConfigError(
            f"--num-processes={num_processes} is more than {MAX_LOCAL_PROCESSES}, the most processes blockshard "
            "writes for one machine (one per accelerator, or per CPU core); pass the number this machine runs, e.g. 8"
        )
    names = layer_names(layers, "--layers")
    if not names:
        raise AccelerateConfigError(
            f"--layers={layers!r} names no layer class; pass the model's layer classes, comma-separated (one group "
            "each, e.g. --layers LlamaDecoderLayer)"
        )
    if engine == "deepspeed" and num_processes < 2:
        raise AccelerateConfigError(
            "--num-processes=1 with --engine deepspeed: ZeRO partitions nothing on one process, so blockshard's hook "
            "has nothing to align; pass 2 or more, or --engine ragged (one process resumes its checkpoints)"
        )
    check_policy(policy, "--policy")
    SemanticsRules.coerce(semantics)
    if engine != "ragged" and policy != "auto":
        raise AccelerateConfigError(
            f"--policy={policy!r} needs --engine ragged ({engine} places units as its partitions allow)"
        )
    out = Path(out)
    try:
        return _write(out, engine, num_processes, cpu, semantics, policy, ", ".join(names), argv)
    except OSError as exc:  # a path under a file, in /proc, read-only, a full disk
        where = exc.filename or out
        cause = "a file, not a folder" if out.exists() and not out.is_dir() else exc.strerror or str(exc)
        raise AccelerateConfigError(
            f"--out {str(out)!r}: cannot write {str(where)!r} ({cause}); pass a folder you can write "
            "(it is created if missing)"
        ) from exc


def _write(
    out: Path, engine: str, num_processes: int, cpu: bool, semantics: str, policy: str, layers: str, argv: str
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    yaml_path = out / "accelerate.yaml"
    if engine == "deepspeed":
        json_path = out / "deepspeed.json"
        section = {
            "train_micro_batch_size_per_gpu": 16,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
            "blockshard": {"semantics": semantics},
        }
        json_path.write_text(json.dumps(section, indent=2) + "\n")
        text = _DEEPSPEED.format(
            argv=argv,
            env="DS_ACCELERATOR=cpu " if cpu else "",
            yaml=yaml_path,
            json=json_path,
            json_name=json_path.name,
            num_processes=num_processes,
            cpu_note="; DS_ACCELERATOR=cpu runs it on CPU" if cpu else "",
        )
        paths = [yaml_path, json_path]
    else:
        text = _FSDP.format(
            argv=argv,
            yaml=yaml_path,
            layers=layers,
            engine=engine,
            semantics=_yaml_scalar(semantics),
            ragged_only=_RAGGED_ONLY.format(policy=policy) if engine == "ragged" else "",
            num_processes=num_processes,
            cpu="true" if cpu else "false",
        )
        paths = [yaml_path]
    yaml_path.write_text(text)
    return paths
