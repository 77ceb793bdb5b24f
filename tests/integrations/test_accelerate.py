"""blockshard.integrations.accelerate and ``blockshard accelerate-config``.

Fast tests: the settings blockshard reads from an Accelerate YAML (and every setting it would
ignore or that conflicts: a one-line ``AccelerateConfigError``), the CLI's files and its errors.

Slow tests: real ``accelerate launch --config_file examples/accelerate/<engine>.yaml
examples/accelerate/train.py`` runs with 2 CPU processes over gloo, against the same script run as one
process (``python examples/accelerate/train.py``: stock Accelerate, ``DistributedType.NO``; run once,
beside the first launch). Every
rank trains on the whole batch, so (docs/design.md, "Sharding invariance"):

* ragged engine: **bitwise** equal to one process after 4 steps with ``clip_grad_norm_`` at 1.0
  (clipping active: the global norms agree across ranks and with one process within 1e-6, measured
  one ulp at one step); ``save_state`` after step 2 and ``load_state`` in a new launch continue
  **bitwise** like the uninterrupted run at W = 2; loaded at W = 4 (DCP reshards the checkpoint)
  within ``W4_RESUME_ATOL = 1e-6`` (measured 1.5e-8: the global norm sums four pieces in another
  order and clipping is active, so the clip factor differs by an ulp). The W = 2 resume launches
  with the config ``blockshard accelerate-config --cpu --layers Block`` writes (the settings of
  ragged.yaml): it shards and ends bitwise equal to one process too.
* fsdp2 engine (stock FSDP2 reduce-scatter), each batch as 2 micro-batches (``--accumulate 2``:
  ``accelerator.accumulate``) against one process accumulating the same way: within ``FSDP2_ATOL =
  1e-6`` (measured 7.5e-8 without accumulation); ``save_state`` / ``load_state`` (DCP of torch's
  ``get_state_dict``) continue bitwise at W = 2.
* deepspeed engine (ZeRO-2 hooked by blockshard, DeepSpeed clipping at 1.0 as the script does):
  within ``DEEPSPEED_ATOL = 1e-6`` (DESIGN: the hook matches a clipping process within 4.5e-8).
* deepspeed ZeRO-3 with ``zero3_init_flag: true`` (``zero3_init.py``, deepspeed_zero3.yaml: a tiny Llama
  through ``from_pretrained``, built inside ``deepspeed.zero.Init``, 0 elements per rank after construction),
  bnb AdamW8bit and torch Muon (built by ``bs_deepspeed.zero3_optimizer``): W = 2 **bitwise** equal to one
  rank under the same config; bnb against one process without DeepSpeed within ``ZERO3_INIT_VS_PLAIN_ATOL``
  (DeepSpeed ZeRO-3's forward / backward are not bitwise plain torch's).
* Control: the same script without the added line, under the same launch, reports
  ``DistributedType.NO`` and one process on each rank and holds every parameter whole (no sharding).
* The ragged and fsdp2 launches honour ``fsdp_sync_module_states`` and ``fsdp_activation_checkpointing``
  with each rank seeding its model with its rank (``--seed-per-rank``): equal to the reference seeded
  with 0, so rank 0's weights were trained and the recompute re-gathered.
* ``fsdp_cpu_ram_efficient_loading`` (``_acc_hf_load.py``: a tiny Llama through ``save_pretrained`` /
  ``from_pretrained``, rank 1 on meta): **bitwise** equal to one process that loaded it; its checkpoint
  resumes on one process (``num_processes: 1``, a world of 1) **bitwise** like the W = 2 run.

Fast, in process: rank 0's weights reach both ranks of 2 gloo threads under either setting (control:
without them the gathered model mixes both ranks' pieces); the fsdp2 engine at W = 1 trains bitwise
like the unsharded model.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml
from _background import Background

from blockshard.cli import main as cli_main
from blockshard.integrations.accelerate import AccelerateConfigError, AccelerateSettings, load_settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "accelerate"
BIN = pathlib.Path(sys.executable).parent
FSDP2_ATOL = 1e-6
DEEPSPEED_ATOL = 1e-6
W4_RESUME_ATOL = 1e-6
ZERO3_INIT_VS_PLAIN_ATOL = 1e-4  # bnb AdamW8bit, ZeRO-3 under zero.Init vs one process: measured 1.9e-5 after 3 steps


# -- settings -----------------------------------------------------------------------------------------
def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _config(**blockshard) -> dict:
    return {
        "distributed_type": "FSDP",
        "num_processes": 2,
        "use_cpu": True,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Block, Head",
            "fsdp_reshard_after_forward": False,
            "blockshard": {"engine": "ragged", **blockshard},
        },
    }


def test_settings_from_the_examples():
    ragged = load_settings(str(EXAMPLES / "ragged.yaml"))
    assert ragged is not None and (ragged.engine, ragged.layers, ragged.policy) == ("ragged", ("Block",), "auto")
    fsdp2 = load_settings(str(EXAMPLES / "fsdp2.yaml"))
    assert fsdp2 is not None and fsdp2.engine == "fsdp2"
    assert json.loads((EXAMPLES / "deepspeed.json").read_text())["blockshard"]


def test_settings_read_layers_reshard_and_mixed_precision(tmp_path):
    config = _config(semantics={"*weight": "bnb8bit"}, policy="whole", alignment_bytes=32)
    config["mixed_precision"] = "bf16"
    s = load_settings(_write(tmp_path, config))
    assert s is not None
    assert (s.layers, s.reshard_after_forward, s.mixed_precision, s.alignment_bytes) == (
        ("Block", "Head"),
        False,
        "bf16",
        32,
    )
    assert "mp_policy" in s.fully_shard_kwargs() and s.fully_shard_kwargs()["policy"] == "whole"


def test_no_blockshard_section_is_stock_accelerate(tmp_path):
    config = _config()
    del config["fsdp_config"]["blockshard"]
    assert load_settings(_write(tmp_path, config)) is None


def test_settings_from_the_environment(tmp_path, monkeypatch):
    path = _write(tmp_path, _config())
    monkeypatch.setenv("BLOCKSHARD_ACCELERATE_CONFIG", path)
    assert load_settings().source == path
    monkeypatch.setenv("BLOCKSHARD_ACCELERATE_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(AccelerateConfigError, match=r"BLOCKSHARD_ACCELERATE_CONFIG=.*is not a file"):
        load_settings()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda c: c["fsdp_config"]["blockshard"].update(engine="zero"),
            "engine='zero'.*not one of ragged, fsdp2, deepspeed",
        ),
        (lambda c: c["fsdp_config"]["blockshard"].update(engine="deepspeed"), "DeepSpeed JSON config"),
        (lambda c: c["fsdp_config"]["blockshard"].update(typo=1), r"unknown keys \['typo'\]"),
        (lambda c: c["fsdp_config"]["blockshard"].update(layers="Block"), "fsdp_transformer_layer_cls_to_wrap"),
        (lambda c: c["fsdp_config"]["blockshard"].update(semantics="bogus"), "unknown semantics 'bogus'"),
        (lambda c: c["fsdp_config"]["blockshard"].update(policy="best"), "blockshard policy='best'"),
        (lambda c: c["fsdp_config"]["blockshard"].update(alignment_bytes=0), "alignment_bytes=0"),
        (lambda c: c["fsdp_config"]["blockshard"].update(engine="fsdp2", policy="owner"), "needs the ragged engine"),
        (lambda c: c.update(mixed_precision="fp16"), "mixed_precision='fp16'"),
        (lambda c: c.update(distributed_type="MULTI_CPU"), "distributed_type='MULTI_CPU'.*set distributed_type: FSDP"),
        (lambda c: c.update(num_processes=0), "num_processes=0 .*at least one process"),
        (
            lambda c: (
                c["fsdp_config"]["blockshard"].update(engine="fsdp2")
                or c["fsdp_config"].update(fsdp_cpu_ram_efficient_loading=True)
            ),
            "fsdp_cpu_ram_efficient_loading=True .*needs the ragged engine",
        ),
        (
            lambda c: c["fsdp_config"].update(fsdp_auto_wrap_policy="NO_WRAP", fsdp_activation_checkpointing=True),
            "fsdp_activation_checkpointing=True .*no layer class is named",
        ),
        (
            lambda c: c["fsdp_config"].update(fsdp_sync_module_states="yes"),
            "fsdp_sync_module_states='yes' .*true or false",
        ),
        (lambda c: c["fsdp_config"].update(fsdp_auto_wrap_policy="SIZE_BASED_WRAP"), "SIZE_BASED_WRAP"),
        (lambda c: c["fsdp_config"].update(fsdp_offload_params=True), "fsdp_offload_params=True .*would be ignored"),
        (lambda c: c["fsdp_config"].update(fsdp_reshard_after_forward="HYBRID_SHARD"), "fsdp_reshard_after_forward"),
        (lambda c: c["fsdp_config"].update(fsdp_auto_wrap_policy="BY_SIZE"), "fsdp_auto_wrap_policy=BY_SIZE"),
        (lambda c: c["fsdp_config"].update(fsdp_version=1), "fsdp_version=1 .*set fsdp_version: 2"),
        (lambda c: c.update(dynamo_config={"dynamo_backend": "INDUCTOR"}), "dynamo_backend='INDUCTOR'.*torch.compile"),
        *[
            (lambda c, k=key, v=value: c["fsdp_config"].update({k: v}), f"{key}={value!r} .*would be ignored")
            for key, value in [
                ("fsdp_activation_checkpointing_offload", True),
                ("fsdp_ignored_modules", "head"),
                ("fsdp_sharding_strategy", "SHARD_GRAD_OP"),
                ("fsdp_state_dict_type", "FULL_STATE_DICT"),
                ("fsdp_float8_all_gather", True),
                ("fsdp_forward_prefetch", True),
                ("fsdp_backward_prefetch", "BACKWARD_PRE"),
                ("fsdp_use_orig_params", False),
                ("fsdp_min_num_params", 100000),
            ]
        ],
    ],
)
def test_ignored_or_conflicting_settings_are_refused(tmp_path, change, match):
    config = _config()
    change(config)
    with pytest.raises(AccelerateConfigError, match=match):
        load_settings(_write(tmp_path, config))


def test_neutral_values_of_ignored_keys_are_accepted(tmp_path):
    config = _config()
    config["fsdp_config"].update(
        fsdp_state_dict_type="SHARDED_STATE_DICT",
        fsdp_cpu_ram_efficient_loading=False,
        fsdp_sync_module_states=False,
        fsdp_use_orig_params=True,
        fsdp_offload_params=False,
        fsdp_sharding_strategy="FULL_SHARD",
    )
    config["dynamo_config"] = {"dynamo_backend": "NO"}
    assert load_settings(_write(tmp_path, config)) is not None


def test_settings_honour_accelerates_fsdp_defaults_and_one_process(tmp_path):
    """What ``accelerate config`` writes for FSDP users (cpu-RAM-efficient loading, which turns on
    sync_module_states; activation checkpointing when asked), accepted and read, at one process too."""
    config = _config()
    config["num_processes"] = 1
    config["fsdp_config"].update(
        fsdp_cpu_ram_efficient_loading=True, fsdp_sync_module_states="true", fsdp_activation_checkpointing=True
    )
    s = load_settings(_write(tmp_path, config))
    assert s is not None and (s.cpu_ram_efficient_loading, s.sync_module_states, s.activation_checkpointing) == (
        True,
        True,
        True,
    )
    s = load_settings(_write(tmp_path, _config()))
    assert s is not None and not (s.cpu_ram_efficient_loading or s.sync_module_states or s.activation_checkpointing)


def test_settings_are_a_value_error():
    with pytest.raises(ValueError, match="engine='x'"):
        AccelerateSettings(engine="x")


# -- what the Accelerator refuses at run time (checked before any collective: no processes needed) ----
def _accelerator(num_processes: int = 2, **attrs):
    """blockshard's Accelerator without accelerate's __init__ (no process group, no global state)."""
    import types

    from blockshard.integrations.accelerate import Accelerator

    acc = Accelerator.__new__(Accelerator)
    acc.state = types.SimpleNamespace(num_processes=num_processes, distributed_type="DistributedType.MULTI_CPU")
    vars(acc).update(blockshard_settings=AccelerateSettings(source="cfg.yaml"), _blockshard_models=[])
    vars(acc).update({"device_placement": False, "_deepspeed_clipping": None, **attrs})
    return acc


@pytest.mark.parametrize("plugin", ["fsdp_plugin", "deepspeed_plugin"])
def test_accelerator_plugin_arguments_conflict(plugin):
    from blockshard.integrations.accelerate import Accelerator

    with pytest.raises(
        AccelerateConfigError, match=f"Accelerator\\({plugin}=...\\) conflicts with blockshard's ragged"
    ):
        Accelerator(blockshard_settings=AccelerateSettings(), **{plugin: object()})


def test_accelerator_settings_beside_the_config_conflict():
    from blockshard.integrations.accelerate._accelerator import check_accelerator

    settings = AccelerateSettings(source="cfg.yaml")
    check_accelerator(settings, "no", "NO")
    with pytest.raises(AccelerateConfigError, match=r"mixed_precision='bf16' .* say 'no'.*TrainingArguments\(bf16"):
        check_accelerator(settings, "bf16", "NO")
    with pytest.raises(AccelerateConfigError, match=r"mixed_precision='no' .* say 'bf16'"):
        check_accelerator(AccelerateSettings(mixed_precision="bf16"), "no", "NO")
    with pytest.raises(AccelerateConfigError, match=r"dynamo_backend='INDUCTOR' would be ignored"):
        check_accelerator(settings, "no", "INDUCTOR")


def test_prepare_refuses_what_it_cannot_shard():
    import torch

    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with pytest.raises(AccelerateConfigError, match=r"prepare\(\) got 2 models"):
        _accelerator().prepare(model, other)
    # one process is a world of 1 (blockshard starts its process group); more need the launcher's
    with pytest.raises(AccelerateConfigError, match=r"found 2 processes but no torch.distributed process group"):
        _accelerator(num_processes=2)._shard(model, [])
    foreign = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(AccelerateConfigError, match="holds 1 tensors that are not parameters of the prepared model"):
        _accelerator()._shard(model, [foreign])
    stepped = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    stepped.step()
    with pytest.raises(AccelerateConfigError, match="has already stepped"):
        _accelerator()._shard(model, [stepped])


def test_missing_layer_class_and_missing_checkpoint(tmp_path):
    import torch

    from blockshard.integrations.accelerate._shard import load_model, shard_model

    settings = AccelerateSettings(layers=("LlamaDecoderLayer",), source="cfg.yaml")
    with pytest.raises(AccelerateConfigError, match=r"names \['LlamaDecoderLayer'\] in cfg.yaml.*Sequential"):
        shard_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), settings)
    with pytest.raises(AccelerateConfigError, match=r"found no blockshard checkpoint at .*save_state"):
        load_model(torch.nn.Linear(2, 2), str(tmp_path / "nothing"), [], settings)


def test_clip_grad_norm_other_than_deepspeeds_would_be_ignored():
    with pytest.raises(AccelerateConfigError, match=r"max_norm=0.5\) would be ignored.*\(1.0\)"):
        _accelerator(_deepspeed_clipping=1.0).clip_grad_norm_([], 0.5)


# -- blockshard accelerate-config ------------------------------------------------------------------------
def test_cli_writes_configs_blockshard_reads(tmp_path, capsys):
    assert cli_main(["accelerate-config", "--engine", "fsdp2", "--cpu", "--out", str(tmp_path / "f")]) == 0
    s = load_settings(str(tmp_path / "f" / "accelerate.yaml"))
    assert s is not None and (s.engine, s.layers) == ("fsdp2", ("LlamaDecoderLayer",))
    text = (tmp_path / "f" / "accelerate.yaml").read_text()
    assert "# Launch:     accelerate launch --config_file" in text and "use_cpu: true" in text
    args = [
        "accelerate-config",
        "--engine",
        "deepspeed",
        "--cpu",
        "--semantics",
        "bnb8bit",
        "--out",
        str(tmp_path / "d"),
    ]
    assert cli_main(args) == 0
    ds = json.loads((tmp_path / "d" / "deepspeed.json").read_text())
    assert ds["blockshard"] == {"semantics": "bnb8bit"}
    acc = yaml.safe_load((tmp_path / "d" / "accelerate.yaml").read_text())
    assert acc["distributed_type"] == "DEEPSPEED" and acc["use_cpu"] is False
    assert "DS_ACCELERATOR=cpu accelerate launch" in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["ragged", "fsdp2", "deepspeed"])
def test_example_configs_are_what_the_cli_writes(tmp_path, engine):
    """examples/accelerate/<engine>.yaml (launched by the slow tests) is ``blockshard accelerate-config
    --engine <engine> --cpu --layers Block``'s output, up to comments and the JSON's path."""
    assert (
        cli_main(["accelerate-config", "--engine", engine, "--cpu", "--layers", "Block", "--out", str(tmp_path)]) == 0
    )
    written = yaml.safe_load((tmp_path / "accelerate.yaml").read_text())
    example = yaml.safe_load((EXAMPLES / f"{engine}.yaml").read_text())
    if engine == "deepspeed":
        assert json.loads((tmp_path / "deepspeed.json").read_text()) == json.loads(
            (EXAMPLES / "deepspeed.json").read_text()
        )
        for config in (written, example):
            config["deepspeed_config"].pop("deepspeed_config_file")
    assert written == example


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--engine", "zero3"], "--engine='zero3' is not one of"),
        (["--num-processes", "0"], "--num-processes=0: pass 1 or more"),
        (["--engine", "deepspeed", "--num-processes", "1"], "--num-processes=1 with --engine deepspeed"),
        (["--semantics", "bogus"], "unknown semantics 'bogus'"),
        (["--policy", "x"], "--policy='x' is not a placement policy"),
        (["--engine", "fsdp2", "--policy", "owner"], "--policy='owner' needs --engine ragged"),
        # issue 29, item 7: these wrote configs
        (["--num-processes", "1000000000"], r"--num-processes=1000000000 is more than 1024, the most processes"),
        (["--num-processes", "1025"], r"--num-processes=1025 is more than 1024"),
        (["--layers", ""], r"--layers='' names no layer class; pass the model's layer classes"),
        (["--layers", " , "], r"--layers=' , ' names no layer class"),
        (["--layers", "Block Head"], r"--layers='Block Head': 'Block Head' is not a class name"),
        (["--layers", "Block\nnum_processes: 9"], r"is not a class name"),  # would have written a YAML key
    ],
)
def test_cli_bad_args_are_one_line_exit_2(tmp_path, capsys, args, match):
    assert cli_main(["accelerate-config", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockshard accelerate-config: error: ") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert not (tmp_path / "accelerate.yaml").exists()


def test_cli_bounds_controls_write_configs(tmp_path):
    args = ["accelerate-config", "--num-processes", "1024", "--layers", " Block,Head ,", "--out", str(tmp_path)]
    assert cli_main(args) == 0
    s = load_settings(str(tmp_path / "accelerate.yaml"))
    assert s is not None and (s.num_processes, s.layers) == (1024, ("Block", "Head"))


@pytest.mark.parametrize(
    ("out", "match"),
    [
        ("file/sub", r"--out '.*file/sub': cannot write '.*file/sub' \(Not a directory\); pass a folder you can write"),
        ("file", r"--out '.*file': cannot write '.*file' \(a file, not a folder\)"),
        ("/proc/blockshard-test", r"--out '/proc/blockshard-test': cannot write .*; pass a folder you can write"),
        ("/proc", r"--out '/proc': cannot write '/proc/accelerate.yaml' "),
    ],
)
def test_cli_out_that_cannot_be_written_is_one_line_exit_2(tmp_path, monkeypatch, capsys, out, match):
    """A path under a regular file or in /proc gave a raw NotADirectoryError / FileNotFoundError."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a regular file\n")
    assert cli_main(["accelerate-config", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockshard accelerate-config: error: ") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert (tmp_path / "file").read_text() == "a regular file\n"
    assert cli_main(["accelerate-config", "--out", "file.d"]) == 0  # control: a folder it creates
    assert (tmp_path / "file.d" / "accelerate.yaml").is_file()


# -- real launches ----------------------------------------------------------------------------------------
def _env() -> dict:
    # BLOCKSHARD_LOG=info: the engage line and the first steps' collectives ([Note: engage line])
    env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", BLOCKSHARD_LOG="info")
    env.pop("BLOCKSHARD_ACCELERATE_CONFIG", None)
    return env


def _engaged(out: pathlib.Path) -> list[str]:
    """The launch's engage lines (rank 0 logs one, then the report) and its step summaries."""
    log = pathlib.Path(f"{out}.log").read_text()
    said = ("blockshard engaged (", " of the model rooted at ", " of the DeepSpeed ZeRO-")
    return [line for line in log.splitlines() if any(s in line for s in said)]


def _results(out: pathlib.Path, ranks: int) -> tuple[list[dict], dict]:
    import torch

    infos = [json.loads(pathlib.Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]
    return infos, torch.load(f"{out}.pt")


def _start(
    config: pathlib.Path | str,
    out: pathlib.Path,
    *args: str,
    script: pathlib.Path = EXAMPLES / "train.py",
    ranks: int = 2,
) -> Background:
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--num_processes", str(ranks)]
    cmd = [*launch, str(script), "--out", str(out), *args]
    return Background(cmd, pathlib.Path(f"{out}.log"), env=_env(), cwd=ROOT, timeout=300)


def _launch(config: pathlib.Path | str, out: pathlib.Path, *args: str, ranks: int = 2, **kwargs):
    _start(config, out, *args, ranks=ranks, **kwargs).wait()
    return _results(out, ranks)


def _reference(tmp_path_factory, *args: str):
    """The script as one process (stock Accelerate). It starts with the first test that needs it and
    runs beside that test's first launch (it fills the core a 2-process launch leaves idle while it
    starts); calling the fixture's value waits for it."""
    out = tmp_path_factory.mktemp("ref") / "ref"
    cmd = [sys.executable, str(EXAMPLES / "train.py"), "--out", str(out), *args]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    done: list[tuple[dict, dict]] = []

    def result() -> tuple[dict, dict]:
        if not done:
            log = proc.communicate(timeout=300)[0]
            assert proc.returncode == 0, log[-3000:]
            infos, state = _results(out, 1)
            assert infos[0]["world_size"] == 1 and infos[0]["distributed_type"] == "DistributedType.NO"
            done.append((infos[0], state))
        return done[0]

    yield result
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    yield from _reference(tmp_path_factory)


@pytest.fixture(scope="module")
def reference_accumulating(tmp_path_factory):
    """One process, each batch as 2 micro-batches (``--accumulate 2``)."""
    yield from _reference(tmp_path_factory, "--accumulate", "2")


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _check_sharded(infos: list[dict], distributed_type: str = "DistributedType.MULTI_CPU") -> None:
    assert [i["world_size"] for i in infos] == [2, 2] and {i["distributed_type"] for i in infos} == {distributed_type}
    total = infos[0]["total_numel"]
    assert all(0 < i["local_numel"] < total for i in infos), infos  # each rank holds part of the parameters
    assert sum(i["local_numel"] for i in infos) >= total
    assert infos[0]["norms"] == infos[1]["norms"]  # the same global norm on every rank


def _honouring(example: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """``example`` with what ``accelerate config`` writes for FSDP users that blockshard honours:
    rank 0's weights broadcast before sharding, activation checkpointing of the layer modules.
    Launched with ``--seed-per-rank`` (rank r seeds its model with r), it still equals one process
    seeded with 0, so rank 0's weights were trained; the checkpoint recompute re-gathers."""
    config = yaml.safe_load(example.read_text())
    config["fsdp_config"].update(fsdp_sync_module_states=True, fsdp_activation_checkpointing=True)
    path = tmp_path / f"{example.stem}-honouring.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_ragged_engine_equals_one_process_and_resumes_bitwise(tmp_path, reference):
    """Launched with ragged.yaml plus ``fsdp_sync_module_states`` and ``fsdp_activation_checkpointing``
    (see :func:`_honouring`); each rank seeds its model with its rank. Also: the config ``blockshard
    accelerate-config --cpu --layers Block`` writes launches (the W = 2 resume runs with it, the
    W = 4 one with ragged.yaml: a checkpoint saved with activation checkpointing loads without it)."""
    config = _honouring(EXAMPLES / "ragged.yaml", tmp_path)
    infos, state = _launch(
        config, tmp_path / "run", "--seed-per-rank", "--save-at", "2", "--ckpt", str(tmp_path / "ck")
    )
    ref_info, ref_state = reference()
    _check_sharded(infos)
    lines = _engaged(tmp_path / "run")
    assert [x for x in lines if "blockshard engaged (accelerate): engine ragged," in x and "over 2 ranks" in x], lines
    steps = [x for x in lines if "of the model rooted at" in x]
    assert steps and all(x.endswith("as planned") for x in steps), steps  # bytes sent = the plan's ([Note: traffic])
    total = infos[0]["total_numel"]
    assert infos[0]["norms"] == pytest.approx(ref_info["norms"], rel=1e-6)
    assert _max_diff(state, ref_state) == 0.0
    assert (tmp_path / "ck" / "blockshard" / "blockshard.json").is_file()  # blockshard.save_checkpoint's record
    assert cli_main(["accelerate-config", "--cpu", "--layers", "Block", "--out", str(tmp_path / "cfg")]) == 0
    ckpt = ["--resume-at", "2", "--ckpt", str(tmp_path / "ck")]
    # both resumes at once (they only read the checkpoint); saved at W = 2, loaded at W = 4: DCP
    # reshards the pieces (and AdamW's state) onto the new layout
    jobs = [
        _start(tmp_path / "cfg" / "accelerate.yaml", tmp_path / "resumed", *ckpt),
        _start(EXAMPLES / "ragged.yaml", tmp_path / "w4", *ckpt, ranks=4),
    ]
    for job in jobs:
        job.wait()
    resumed_infos, resumed = _results(tmp_path / "resumed", 2)
    _check_sharded(resumed_infos)
    assert resumed_infos[0]["norms"] == infos[0]["norms"][2:]
    assert _max_diff(resumed, state) == 0.0 and _max_diff(resumed, ref_state) == 0.0
    w4_infos, w4 = _results(tmp_path / "w4", 4)
    assert [i["world_size"] for i in w4_infos] == [4] * 4 and all(i["local_numel"] < total for i in w4_infos)
    assert w4_infos[0]["norms"] == pytest.approx(infos[0]["norms"][2:], rel=1e-6)
    assert _max_diff(w4, state) <= W4_RESUME_ATOL


@pytest.mark.slow
def test_fsdp2_engine_accumulates_equals_one_process_and_resumes_bitwise(tmp_path, reference_accumulating):
    """With ``gradient_accumulation_steps=2`` (``accelerator.accumulate``: FSDP2 reduce-scatters each
    micro-batch, the optimizer steps on the second) against one process accumulating the same way;
    fsdp2.yaml plus ``fsdp_sync_module_states`` and ``fsdp_activation_checkpointing``, each rank
    seeding its model with its rank; the resume runs with fsdp2.yaml (no checkpointing)."""
    ckpt = ["--ckpt", str(tmp_path / "ck"), "--accumulate", "2"]
    config = _honouring(EXAMPLES / "fsdp2.yaml", tmp_path)
    infos, state = _launch(config, tmp_path / "run", "--seed-per-rank", "--save-at", "2", *ckpt)
    ref_info, ref_state = reference_accumulating()
    _check_sharded(infos)
    lines = _engaged(tmp_path / "run")
    assert [x for x in lines if "blockshard engaged (accelerate): engine fsdp2," in x], lines
    steps = [x for x in lines if "of the model rooted at" in x]  # FSDP2's collectives, counted by the adapter
    assert steps and all(x.endswith("as planned") for x in steps), steps
    assert len(infos[0]["norms"]) == 4 and infos[0]["norms"] == pytest.approx(ref_info["norms"], rel=1e-6)
    assert _max_diff(state, ref_state) <= FSDP2_ATOL
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")) == []  # no .partial left
    _, resumed = _launch(EXAMPLES / "fsdp2.yaml", tmp_path / "resumed", "--resume-at", "2", *ckpt)
    assert _max_diff(resumed, state) == 0.0


@pytest.mark.slow
def test_deepspeed_engine_is_hooked_and_equals_one_process(tmp_path, reference):
    infos, state = _launch(EXAMPLES / "deepspeed.yaml", tmp_path / "run")
    assert [i["world_size"] for i in infos] == [2, 2] and infos[0]["distributed_type"] == "DistributedType.DEEPSPEED"
    lines = _engaged(tmp_path / "run")
    assert len([x for x in lines if "blockshard engaged (the DeepSpeed hook): engine DeepSpeed ZeRO-" in x]) == 1, lines
    steps = [x for x in lines if " engine: all-gather " in x]  # DeepSpeed's collectives, counted by the hook
    assert steps and all(x.endswith("as planned") for x in steps), steps
    assert any(name.startswith("blockshard.integrations.deepspeed") for name in infos[0]["optimizers"]), infos[0]
    total = infos[0]["total_numel"]
    assert all(0 < i["state_numel"] < total for i in infos)  # ZeRO-2: each rank holds part of the optimizer state
    assert sum(i["state_numel"] for i in infos) == total
    assert _max_diff(state, reference()[1]) <= DEEPSPEED_ATOL


@pytest.fixture(scope="module")
def reference_bnb(tmp_path_factory):
    """One process with bitsandbytes' AdamW8bit (``--optimizer bnb8bit``)."""
    yield from _reference(tmp_path_factory, "--optimizer", "bnb8bit")


@pytest.mark.slow
def test_deepspeed_zero3_with_8bit_state_equals_one_process(tmp_path, reference_bnb):
    """``accelerate launch`` with a DeepSpeed ZeRO-3 config (every parameter partitioned) and
    bitsandbytes' AdamW8bit: the hook's owner-compute steps whole units (each tensor here is below
    4096 elements: fp32 state, as on one process), so the result equals one process within
    ``DEEPSPEED_ATOL`` (DeepSpeed's clipping norm; stock ZeRO-3 quantizes its flat partitions in
    8 bits: ``test_control_stock_zero3_differs_from_one_process`` in test_deepspeed.py)."""
    cfg = json.loads((EXAMPLES / "deepspeed.json").read_text())
    cfg["zero_optimization"] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_gather_16bit_weights_on_model_save": True,  # accelerator.get_state_dict gathers the weights
    }
    cfg["blockshard"] = {}
    (tmp_path / "z3.json").write_text(json.dumps(cfg))
    acc = yaml.safe_load((EXAMPLES / "deepspeed.yaml").read_text())
    acc["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "z3.json")
    infos, state = _launch(_write(tmp_path, acc), tmp_path / "run", "--optimizer", "bnb8bit")
    assert [i["world_size"] for i in infos] == [2, 2] and infos[0]["distributed_type"] == "DistributedType.DEEPSPEED"
    lines = _engaged(tmp_path / "run")
    engaged = [x for x in lines if "blockshard engaged (the DeepSpeed hook): engine DeepSpeed ZeRO-3" in x]
    assert len(engaged) == 1 and "policy owner" in engaged[0], lines
    assert all(i["local_numel"] == 0 for i in infos)  # every parameter partitioned away between steps
    total = infos[0]["total_numel"]
    assert all(0 < i["state_numel"] < total for i in infos) and sum(i["state_numel"] for i in infos) == total
    assert _max_diff(state, reference_bnb()[1]) <= DEEPSPEED_ATOL


@pytest.mark.slow
def test_deepspeed_zero3_init_flag_partitions_at_construction_and_equals_one_rank_bitwise(tmp_path):
    """``accelerate launch`` with deepspeed_zero3.yaml (``zero3_init_flag: true``, a ZeRO-3 config with
    ``"blockshard": {}``): the Accelerator registers the config with transformers, so ``from_pretrained``
    builds the tiny Llama inside ``deepspeed.zero.Init`` (every rank holds 0 elements of it after
    construction; the one-process reference holds all). bnb AdamW8bit and torch Muon (over the 1-D
    placeholders through ``zero3_optimizer``) step whole units on owner ranks: W = 2 equals one rank under
    the same config **bitwise**; bnb equals one process without DeepSpeed within ``ZERO3_INIT_VS_PLAIN_ATOL``
    (Muon's bf16 Newton-Schulz amplifies ZeRO-3's forward / backward differences: not compared to it).
    The five runs start at once; they read the model that this test saves first."""
    from blockshard._tiny import tiny_llama

    pretrained = tmp_path / "llama"
    tiny_llama().save_pretrained(pretrained)
    total = sum(p.numel() for p in tiny_llama().parameters())
    script, config = EXAMPLES / "zero3_init.py", EXAMPLES / "deepspeed_zero3.yaml"
    args = ["--pretrained", str(pretrained)]
    jobs = {}
    for opt in ("bnb8bit", "muon"):
        for ranks in (2, 1):
            out = tmp_path / f"{opt}-w{ranks}"
            jobs[out] = _start(config, out, *args, "--optimizer", opt, script=script, ranks=ranks)
    plain = tmp_path / "bnb8bit-plain"  # one process, stock Accelerate
    cmd = [sys.executable, str(script), *args, "--out", str(plain)]
    jobs[plain] = Background(cmd, tmp_path / "plain.log", env=_env(), cwd=ROOT, timeout=300)
    for job in jobs.values():
        job.wait()
    (ref,), ref_state = _results(plain, 1)
    assert ref["world_size"] == 1 and ref["distributed_type"] == "DistributedType.NO" and not ref["hooked"]
    assert ref["built"] == {"numel": total, "ds_numel": 0}  # control: one process builds it whole
    for opt, inner in (("bnb8bit", "AdamW8bit"), ("muon", "Muon")):
        infos, state = _results(tmp_path / f"{opt}-w2", 2)
        (one,), one_state = _results(tmp_path / f"{opt}-w1", 1)
        assert [i["world_size"] for i in infos] == [2, 2] and one["world_size"] == 1
        assert {i["distributed_type"] for i in [*infos, one]} == {"DistributedType.DEEPSPEED"}
        # partitioned at construction by zero.Init: nothing local, the full sizes in ds_numel
        assert [i["built"] for i in [*infos, one]] == [{"numel": 0, "ds_numel": total}] * 3
        assert all(i["hooked"] and i["optimizers"][1:] == ["BlockshardStage3", inner] for i in [*infos, one])
        engaged = [x for x in _engaged(tmp_path / f"{opt}-w2") if "engine DeepSpeed ZeRO-3" in x]
        assert len(engaged) == 1 and "policy owner" in engaged[0] and "over 2 ranks" in engaged[0], engaged
        assert _max_diff(state, one_state) == 0.0, opt
        assert infos[0]["losses"] == one["losses"]
        if opt == "bnb8bit":
            assert _max_diff(state, ref_state) <= ZERO3_INIT_VS_PLAIN_ATOL


@pytest.mark.slow
def test_control_stock_accelerate_does_not_shard(tmp_path):
    script = tmp_path / "stock_train.py"
    lines = (EXAMPLES / "train.py").read_text().splitlines(keepends=True)
    script.write_text("".join(line for line in lines if "blockshard.integrations.accelerate import" not in line))
    infos, _ = _launch(EXAMPLES / "ragged.yaml", tmp_path / "run", script=script)
    assert _engaged(tmp_path / "run") == []  # nothing engaged, nothing said
    # accelerate reports one process on each of the two, and each holds every parameter
    assert [i["world_size"] for i in infos] == [1, 1] and {i["distributed_type"] for i in infos} == {
        "DistributedType.NO"
    }
    assert all(i["local_numel"] == i["total_numel"] for i in infos)


# -- rank 0's weights and activation checkpointing, in process (2 gloo threads) -------------------------
def _inproc():
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    try:
        import _inproc
    finally:
        sys.path.remove(str(ROOT / "tests" / "runtime"))
    return _inproc


def _run_ranks(fn):
    return _inproc().run_ranks(fn, 2)


def _net(seed: int, meta: bool = False, hidden: int = 9):
    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        from train import Net
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(seed)
    if not meta:
        return Net(dim=7, hidden=hidden, layers=2)
    with torch.device("meta"):
        return Net(dim=7, hidden=hidden, layers=2)


def _full(model) -> dict:
    import blockshard

    return {k: v.clone() for k, v in blockshard.full_state_dict(model).items()}


def test_rank0s_weights_reach_every_rank():
    """Ranks that build other weights (another seed; on meta off rank 0 for cpu-RAM-efficient loading)
    shard rank 0's, bitwise; control: without either setting each rank shards its own, and the
    gathered model is a mix of both ranks' pieces (rank 0's on neither). One run of 2 gloo threads."""
    import torch

    from blockshard.integrations.accelerate._shard import shard_model

    cases = {"sync_module_states": True, "cpu_ram_efficient_loading": True, "none": False}
    # built here, not in the threads: they share torch's default generator
    models = {c: [_net(seed=r, meta=(r > 0 and c == "cpu_ram_efficient_loading")) for r in range(2)] for c in cases}

    # refused on every rank (no rank left waiting in a collective): rank 0 on meta; meta without a fill
    refused = {"cpu_ram_efficient_loading": 0, "sync_module_states": 1}
    meta_models = {c: [_net(seed=0, meta=r == on) for r in range(2)] for c, on in refused.items()}

    def rank(r: int, w: int):
        out, errors = {}, []
        for case in cases:
            settings = AccelerateSettings(layers=("Block",), **({case: True} if cases[case] else {}))
            shard_model(models[case][r], settings)
            out[case] = _full(models[case][r])
        for case in refused:
            with pytest.raises(AccelerateConfigError) as err:
                shard_model(meta_models[case][r], AccelerateSettings(layers=("Block",), **{case: True}))
            errors.append(str(err.value))
        with pytest.raises(AccelerateConfigError) as err:  # other shapes on rank 1: no mispaired broadcast
            shard_model(_net(seed=0, hidden=9 + r), AccelerateSettings(layers=("Block",), sync_module_states=True))
        errors.append(str(err.value))
        return out, errors

    results = _run_ranks(rank)
    rank0 = _net(seed=0).state_dict()
    for case, expected in cases.items():
        assert sorted(results[0][0][case]) == sorted(rank0)
        equal = [all(torch.equal(f[case][k], rank0[k]) for k in rank0) for f, _ in results]
        assert equal == [expected, expected], case
    for _, (ram, sync, differ) in results:
        assert re.search(r"fsdp_cpu_ram_efficient_loading=True: rank 0 .* on the meta device", ram), ram
        assert re.search(r"fsdp_sync_module_states=True: .*set fsdp_cpu_ram_efficient_loading: true", sync), sync
        assert re.search(r"fsdp_sync_module_states=True: the ranks' models differ .* Fix: build the same", differ)


@pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute
def test_cpu_ram_efficient_loading_fills_the_shards_from_rank0_and_resumes_on_one_process(tmp_path):
    """``fsdp_cpu_ram_efficient_loading: true`` (with ``fsdp_sync_module_states: true``, as
    ``accelerate config`` writes them) on a tiny Llama (``tests/integrations/_acc_hf_load.py``): rank 0
    loads it with ``from_pretrained``, rank 1 builds it on meta; 4 steps equal one process that
    loaded the same weights **bitwise**. The checkpoint saved after step 2 resumes on one process
    (``blockshard accelerate-config --num-processes 1``, a world of 1) **bitwise** like the W = 2 run."""
    script = ROOT / "tests" / "integrations" / "_acc_hf_load.py"
    assert cli_main(["accelerate-config", "--cpu", "--layers", "LlamaDecoderLayer", "--out", str(tmp_path / "w2")]) == 0
    config = yaml.safe_load((tmp_path / "w2" / "accelerate.yaml").read_text())
    config["fsdp_config"].update(fsdp_cpu_ram_efficient_loading=True, fsdp_sync_module_states=True)
    (tmp_path / "w2" / "accelerate.yaml").write_text(yaml.safe_dump(config))
    ckpt = ["--ckpt", str(tmp_path / "ck")]
    run = _start(
        tmp_path / "w2" / "accelerate.yaml",
        tmp_path / "run",
        "--pretrained",
        str(tmp_path / "llama"),
        "--save-at",
        "2",
        *ckpt,
        script=script,
    )
    ref_cmd = [sys.executable, str(script), "--out", str(tmp_path / "ref"), "--pretrained", str(tmp_path / "ref-llama")]
    ref = Background(ref_cmd, tmp_path / "ref.log", env=_env(), cwd=ROOT, timeout=300)  # beside the launch
    run.wait()
    ref.wait()
    infos, state = _results(tmp_path / "run", 2)
    (ref_info,), ref_state = _results(tmp_path / "ref", 1)
    assert [i["world_size"] for i in infos] == [2, 2] and all(i["sharded"] for i in infos)
    assert [i["params_on_meta_before_prepare"] for i in infos] == [0, infos[1]["params"]]  # rank 1: all on meta
    assert ref_info["world_size"] == 1 and not ref_info["sharded"]  # stock Accelerate, one process
    # the global norm sums per piece (an ulp from one process's, measured at step 1; clipping is inactive)
    assert infos[0]["norms"] == pytest.approx(ref_info["norms"], rel=1e-6)
    assert _max_diff(state, ref_state) == 0.0
    assert (
        cli_main(
            [
                "accelerate-config",
                "--cpu",
                "--num-processes",
                "1",
                "--layers",
                "LlamaDecoderLayer",
                "--out",
                str(tmp_path / "w1"),
            ]
        )
        == 0
    )
    resumed_infos, resumed = _launch(
        tmp_path / "w1" / "accelerate.yaml",
        tmp_path / "w1run",
        "--pretrained",
        str(tmp_path / "llama"),
        "--resume-at",
        "2",
        *ckpt,
        script=script,
        ranks=1,
    )
    assert resumed_infos[0]["world_size"] == 1 and resumed_infos[0]["sharded"]
    # one rank sums the squares of its one piece per tensor, two ranks sum two pieces' and add: the
    # norms can be an ulp apart (1.5768685 vs 1.5768687 on one machine), clipping is inactive
    assert resumed_infos[0]["norms"] == pytest.approx(infos[0]["norms"][2:], rel=1e-6)
    assert _max_diff(resumed, state) == 0.0


def test_fsdp2_engine_on_one_process_equals_unsharded():
    """``num_processes: 1`` with the fsdp2 engine: stock FSDP2 over a gloo world of 1 (what blockshard's
    Accelerator starts for one process), 2 AdamW steps, bitwise the unsharded model's."""
    import torch

    from blockshard.integrations.accelerate._shard import shard_model

    x, y = torch.randn(6, 13, generator=torch.Generator().manual_seed(1)), torch.randn(6, 5)

    def train(model) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}

    inproc = _inproc()
    with inproc.world1():
        model = _net(seed=0)
        shard_model(model, AccelerateSettings(engine="fsdp2", layers=("Block",)))
        assert all(hasattr(p, "full_tensor") for p in model.parameters())  # FSDP2's DTensors
        sharded = train(model)
    with inproc.single_thread():
        reference = train(_net(seed=0))
    assert sorted(sharded) == sorted(reference) and all(torch.equal(sharded[k], reference[k]) for k in reference)
