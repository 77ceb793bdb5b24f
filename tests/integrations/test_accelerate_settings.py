"""Accelerate settings checked by type and range (issue 29, item 6; [Note: strict config files] in
integrations/accelerate/_config_file.py): malformed config files that ended in a raw
``AttributeError`` / ``TypeError`` / YAML ``ParserError`` / ``UnicodeDecodeError``, bad values that
passed silently, and a ``num_processes: 2`` config run without a launcher. Each raises
``AccelerateConfigError`` naming the key (or the file), the value and the fix; each test has a
control that loads. Pure and in process: no launcher, no process group."""

from __future__ import annotations

import pytest

from blockshard.integrations.accelerate import CONFIG_ENV, AccelerateConfigError, AccelerateSettings, load_settings
from blockshard.integrations.accelerate._accelerator import check_launched, check_parallelism

BASE = """\
distributed_type: FSDP
num_processes: 2
mixed_precision: "no"
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Block, Head
  fsdp_reshard_after_forward: true
  blockshard:
    engine: ragged
    alignment_bytes: 16
"""


def _file(tmp_path, text: str | bytes) -> str:
    path = tmp_path / "acc.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def _with(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new, 1)


def test_the_base_config_loads(tmp_path):
    s = load_settings(_file(tmp_path, BASE))
    assert s is not None and (s.layers, s.num_processes, s.reshard_after_forward) == (("Block", "Head"), 2, True)


MALFORMED = {
    # YAML that does not parse (were the parser's multi-line ParserError / ScannerError)
    "syntax": (_with("num_processes: 2", "num_processes: [2"), r"is not valid YAML \(.* at line \d+, column \d+\)"),
    "tab-indent": (_with("  fsdp_version: 2", "\tfsdp_version: 2"), r"is not valid YAML \(.*line 5"),
    "python-tag": (
        "!!python/object/apply:os.system ['true']\n",
        r"is not valid YAML \(could not determine a constructor",
    ),
    # bytes that are not UTF-8 (was UnicodeDecodeError)
    "latin-1": (BASE.replace("Head", "H\xe9ad").encode("latin-1"), r"is not UTF-8 text \(byte 0xe9 at offset \d+\)"),
    # not a mapping where one is read (were AttributeError: 'list' object has no attribute 'get')
    "top-list": ("- distributed_type: FSDP\n", r"holds a list, not a mapping of keys"),
    "top-str": ("distributed_type FSDP\n", r"holds a str, not a mapping of keys"),
    "fsdp-config-list": (
        "distributed_type: FSDP\nfsdp_config: [blockshard]\n",
        r"fsdp_config=\['blockshard'\] in .* must be a mapping",
    ),
    "fsdp-config-str": ("distributed_type: FSDP\nfsdp_config: blockshard\n", r"fsdp_config='blockshard' in .* mapping"),
    "dynamo-config-list": (
        BASE + "dynamo_config: [INDUCTOR]\n",
        r"dynamo_config=\['INDUCTOR'\] in .* must be a mapping",
    ),
    # values of the wrong type (were TypeError / ValueError from int() and ",".join())
    "num-processes-word": (_with("num_processes: 2", "num_processes: two"), r"num_processes='two' .*whole number"),
    "num-processes-list": (_with("num_processes: 2", "num_processes: [2]"), r"num_processes=\[2\] .*whole number"),
    "layers-int": (
        _with("fsdp_transformer_layer_cls_to_wrap: Block, Head", "fsdp_transformer_layer_cls_to_wrap: 5"),
        r"fsdp_transformer_layer_cls_to_wrap=5 in .* must name layer classes",
    ),
    "layers-list-of-int": (
        _with("fsdp_transformer_layer_cls_to_wrap: Block, Head", "fsdp_transformer_layer_cls_to_wrap: [Block, 3]"),
        r"fsdp_transformer_layer_cls_to_wrap=\['Block', 3\] in .* must name layer classes",
    ),
    "section-int-key": (_with("    engine: ragged", "    engine: ragged\n    1: x"), r"has unknown keys \[1\]"),
    "semantics-list": (
        _with("    engine: ragged", "    engine: ragged\n    semantics: [bnb8bit]"),
        r"semantics=\['bnb8bit'\] in .* must be a semantics name",
    ),
}


@pytest.mark.parametrize(("text", "match"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_config_files_raise_naming_the_file(tmp_path, monkeypatch, text, match):
    path = _file(tmp_path, text)
    with pytest.raises(AccelerateConfigError, match=match) as info:
        load_settings(path)
    assert "\n" not in str(info.value) and ("acc.yaml" in str(info.value))
    monkeypatch.setenv(CONFIG_ENV, path)  # the same through the environment variable
    with pytest.raises(AccelerateConfigError, match=match):
        load_settings()
    monkeypatch.setenv(CONFIG_ENV, _file(tmp_path, BASE))  # control
    assert load_settings() is not None


def test_a_missing_or_unreadable_file_raises_naming_it(tmp_path):
    with pytest.raises(AccelerateConfigError, match=r"'.*missing.yaml' cannot be read \(No such file or directory\)"):
        load_settings(str(tmp_path / "missing.yaml"))
    with pytest.raises(AccelerateConfigError, match=r"cannot be read \(Is a directory\)"):
        load_settings(str(tmp_path))
    assert load_settings(_file(tmp_path, BASE)) is not None  # control


SILENT = {
    # were taken as true (bool(2), bool([1]))
    "reshard-2": (
        _with("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: 2"),
        r"fsdp_reshard_after_forward=2 in .* \(a number or a list would read as true\); set true",
    ),
    "reshard-list": (
        _with("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: [1]"),
        r"fsdp_reshard_after_forward=\[1\] in .*set true",
    ),
    "reshard-null": (
        _with("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward:"),
        r"fsdp_reshard_after_forward=None in .*set true",
    ),
    # were int(2.7) == 2 processes; "1e9" is a string in YAML 1.1; 10**9 was planned for
    "num-processes-float": (_with("num_processes: 2", "num_processes: 2.7"), r"num_processes=2.7 .*whole number"),
    "num-processes-1e9": (_with("num_processes: 2", "num_processes: 1e9"), r"num_processes='1e9' .*whole number"),
    "num-processes-huge": (
        _with("num_processes: 2", "num_processes: 1000000000"),
        r"num_processes=1000000000 in .* is more than 1,048,576 \(2\*\*20\)",
    ),
    "num-processes-true": (_with("num_processes: 2", "num_processes: true"), r"num_processes=True .*whole number"),
    # were accepted by the settings (only > 0 was checked)
    "alignment-3": (
        _with("alignment_bytes: 16", "alignment_bytes: 3"),
        r"alignment_bytes=3 must be a positive integer power of two .* in .*acc.yaml",
    ),
    "alignment-2**40": (
        _with("alignment_bytes: 16", "alignment_bytes: 1099511627776"),
        r"alignment_bytes=1099511627776 is more than 4096 bytes \(a page\)",
    ),
    # YAML kept the last of two equal keys without a word
    "duplicate-top-level": (
        BASE + "num_processes: 4\n",
        r"has the key 'num_processes' twice \(lines 2 and 12\); YAML would keep the last one silently",
    ),
    "duplicate-in-section": (
        _with("    engine: ragged", "    engine: ragged\n    engine: fsdp2"),
        r"has the key 'engine' twice \(lines 10 and 11\)",
    ),
    # settings the fsdp2 engine would ignore
    "fsdp2-alignment": (
        _with("engine: ragged", "engine: fsdp2"),
        r"fsdp_config.blockshard.alignment_bytes in .* would be ignored by the fsdp2 engine",
    ),
    "fsdp2-policy-whole": (
        _with("engine: ragged\n    alignment_bytes: 16", "engine: fsdp2\n    policy: whole"),
        r"blockshard policy='whole' in .* needs the ragged engine",
    ),
    # 0 == False and 1 == True: a number was taken for the neutral value
    "offload-0": (
        _with("  fsdp_version: 2", "  fsdp_version: 2\n  fsdp_offload_params: 0"),
        r"fsdp_offload_params=0 in .* would be ignored",
    ),
    "layer-names-with-spaces": (
        _with("Block, Head", "Block Head"),
        r"fsdp_transformer_layer_cls_to_wrap='Block Head' in .*: 'Block Head' is not a class name",
    ),
}


@pytest.mark.parametrize(("text", "match"), SILENT.values(), ids=SILENT.keys())
def test_bad_values_that_passed_silently_raise_naming_the_key(tmp_path, text, match):
    with pytest.raises(AccelerateConfigError, match=match) as info:
        load_settings(_file(tmp_path, text))
    assert "\n" not in str(info.value)
    assert load_settings(_file(tmp_path, BASE)) is not None  # control


def test_what_accelerate_writes_and_yaml_merges_still_load(tmp_path):
    """Controls: YAML's unquoted ``no`` (false), true/false strings, FSDP1's strategy names, a merge
    key (``<<``, not a duplicate), a list of layer classes and the largest alignment."""
    text = _with('mixed_precision: "no"', "mixed_precision: no")
    text = text.replace("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: SHARD_GRAD_OP")
    text = text.replace("Block, Head", "[Block, Head]").replace("alignment_bytes: 16", "alignment_bytes: 4096")
    text += "base: &b {x: 1}\nother:\n  <<: *b\n  x: 2\n"
    s = load_settings(_file(tmp_path, text))
    assert s is not None and (s.mixed_precision, s.reshard_after_forward, s.layers, s.alignment_bytes) == (
        "no",
        False,
        ("Block", "Head"),
        4096,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": "Block"}, r"AccelerateSettings\(layers='Block'\) is a str, not a tuple .*pass layers=\('Block',\)"),
        ({"layers": ("Block", 3)}, r"AccelerateSettings layers=\('Block', 3\) must name layer classes"),
        ({"layers": ("Block Head",)}, r"'Block Head' is not a class name"),
        ({"reshard_after_forward": "no"}, r"reshard_after_forward='no' must be True or False .*pass a bool"),
        ({"sync_module_states": 1}, r"sync_module_states=1 must be True or False"),
        ({"activation_checkpointing": None, "layers": ("Block",)}, r"activation_checkpointing=None must be True"),
        ({"alignment_bytes": 2**40}, r"alignment_bytes=1099511627776 is more than 4096 bytes"),
        ({"alignment_bytes": 12}, r"alignment_bytes=12 must be a positive integer power of two"),
        ({"num_processes": 0}, r"num_processes=0 must be an integer from 1 to 1,048,576"),
        ({"num_processes": 2.0}, r"num_processes=2.0 must be an integer"),
        ({"engine": ["ragged"]}, r"engine=\['ragged'\] is not one of ragged, fsdp2, deepspeed"),
    ],
)
def test_settings_built_in_code_are_checked_by_type(kwargs, match):
    with pytest.raises(AccelerateConfigError, match=match):
        AccelerateSettings(**kwargs)
    ok = AccelerateSettings(layers=["Block"], reshard_after_forward=False, num_processes=2)  # control
    assert ok.layers == ("Block",) and ok.reshard_after_forward is False


def test_more_than_one_process_without_a_launcher_is_refused(monkeypatch):
    """``num_processes: 2`` under plain ``python`` (no launcher: WORLD_SIZE unset, no ``accelerate
    launch`` parent) prepared a world of one silently."""
    from blockshard.integrations.accelerate import Accelerator

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    settings = AccelerateSettings(num_processes=2, source="cfg.yaml")
    with pytest.raises(
        AccelerateConfigError,
        match=r"num_processes=2 in cfg.yaml, but this process was started without a launcher \(WORLD_SIZE is unset\)"
        r".*accelerate launch --config_file cfg.yaml your_script.py .*or set num_processes: 1",
    ):
        Accelerator(blockshard_settings=settings)  # raises before accelerate starts anything
    check_launched(AccelerateSettings(num_processes=1, source="cfg.yaml"))  # controls: one process,
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_launched(settings)  # and a launcher's process


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"tp_size": 2}, r"ParallelismConfig\(tp_size=2\)"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, r"ParallelismConfig\(dp_replicate_size=2\)"),
        ("env", r"ParallelismConfig\(tp_size=4\)"),
    ],
)
def test_parallelism_beyond_sharded_data_parallel_is_refused_before_accelerate_starts(monkeypatch, given, match):
    """accelerate's prepare() would turn blockshard's pieces into TP DTensors (its _prepare_tp)."""
    from accelerate.parallelism_config import ParallelismConfig

    from blockshard.integrations.accelerate import Accelerator

    settings = AccelerateSettings(source="cfg.yaml")
    if given == "env":  # the config file's parallelism_config section, as accelerate launch passes it
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
        kwargs = {}
    else:
        kwargs = {"parallelism_config": ParallelismConfig(**given)}
    with pytest.raises(AccelerateConfigError, match=match + r".*cfg.yaml.*one data-parallel group.*Fix: drop"):
        Accelerator(blockshard_settings=settings, **kwargs)
    monkeypatch.delenv("PARALLELISM_CONFIG_TP_SIZE", raising=False)  # sizes not given are read from these
    check_parallelism(settings, {"parallelism_config": ParallelismConfig(dp_shard_size=2)})  # control: dp only


def test_deepspeed_json_that_does_not_parse_raises_naming_it(tmp_path, monkeypatch):
    from blockshard.integrations.accelerate._accelerator import deepspeed_section

    path = tmp_path / "ds.json"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    for text, match in [
        ('{"blockshard": {}', r"the DeepSpeed config .*ds.json.* cannot be read as JSON"),
        (b'{"blockshard": "\xff"}', r"cannot be read as JSON"),
        ('{"blockshard": {}, "gradient_clipping": "1.0"}', r"gradient_clipping='1.0' in the DeepSpeed config .*number"),
    ]:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(AccelerateConfigError, match=match):
            deepspeed_section()
    path.write_text('{"train_micro_batch_size_per_gpu": 1}')  # control: no blockshard section, stock DeepSpeed
    assert deepspeed_section() is None
