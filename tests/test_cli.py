"""The `blockshard` command line, run as a user runs it (a subprocess of the installed script)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from blockshard.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockshard", *args], capture_output=True, text=True, timeout=120)


def test_plan_json_has_the_promised_fields():
    out = run("plan", "--model", "llama3-8b", "--world-size", "1024", "--semantics", "bnb8bit", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("world_size", "total_numel", "padding_fraction", "max_segment_over_lower_bound", "plan_seconds"):
        assert key in data
    assert data["world_size"] == 1024 and data["total_numel"] == 8_030_261_248
    assert set(data["baselines"]) == {"fsdp2", "zero3", "zero12", "naive"}
    for b in data["baselines"].values():
        assert set(b) >= {"padding_fraction", "splits_units"}
    # bnb8bit blocks: ZeRO-1/2's flat partitions split some, blockshard none and pads < 1%
    assert data["baselines"]["zero12"]["splits_units"] > 0
    assert data["padding_fraction"] < 0.01 and data["max_segment_over_lower_bound"] < 1.02


@pytest.mark.slow  # in the slow tier to keep `make test-fast` under a minute
def test_plan_table_and_plot(tmp_path):
    png = tmp_path / "loads.png"
    out = run("plan", "--model", "mixtral-8x7b", "-W", "64", "--semantics", "muon", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    for word in ("group kind", "blockshard", "fsdp2", "zero12", "naive", "model.layers.*", "total"):
        assert word in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plan_reads_config_and_shapes_files(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 1000,
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    out = run("plan", "--config", str(cfg), "-W", "3", "--semantics", "nf4", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["num_groups"] == 3
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"tensors": [{"name": "a.0.w", "shape": [6, 64]}, {"name": "b", "shape": [64]}]}))
    out = run("plan", "--shapes", str(shapes), "-W", "2", "--json", "--layouts")
    data = json.loads(out.stdout)
    assert [g["name"] for g in data["layouts"]] == ["a.0", ""]


def test_inspect_shows_a_rank(capsys):
    assert main(["inspect", "--model", "llama3-8b", "-W", "4", "--semantics", "muon", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1:" in out and "model.layers.0" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "llama-9b", "-W", "8"], "llama3-8b"),  # unknown model lists the catalog
        (["plan", "--model", "llama3-8b", "-W", "0"], "--world-size=0 must be an integer >= 1"),
        (["plan", "--model", "llama3-8b", "--semantics", "nf5"], "unknown semantics 'nf5'"),
        (["plan", "--shapes", "/nonexistent.json"], "/nonexistent.json"),
        (["plan", "--model", "llama3-8b", "--semantics", "*embed*=nf4,*embed*=mx"], "two quantizer semantics"),
    ],
)
def test_bad_input_is_one_clear_error_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_demo_runs():
    """A short demo on 4 ranks with torch Muon on whole matrices (tests/test_demo.py runs the default)."""
    cmd = [sys.executable, "-m", "blockshard", "demo", "--world-size", "4", "--optimizer", "muon", "--steps", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)  # 4 spawned ranks: slow on 2 loaded cores
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 3" in out.stdout and "3/3" in out.stdout and "FSDP2 Shard(0)" in out.stdout
    assert "PASS" in out.stdout and "all 21 parameters bitwise equal" in out.stdout


# -- bad input (issue 9, point 6): one line on stderr, exit code 2, never a traceback ----------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: command"),
        (["plan"], "one of the arguments --model --config --shapes --list-models is required"),
        (["plan", "--model", "llama3-8b", "--bogus"], "unrecognized arguments: --bogus"),
        (["plan", "--model", "llama3-8b", "--tile-placement", "x"], "--tile-placement: invalid choice: 'x'"),
    ],
)
def test_argparse_refusals_are_one_line_too(args, message, capsys):
    """What argparse itself refuses (a missing or unknown argument, a bad choice) is one line with
    exit code 2, as the commands' own refusals; the usage is one ``--help`` away."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert message in err and "--help)" in err and "usage:" not in err


def _one_error_line(args: list[str], capsys) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one line on stderr and no traceback."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _llama_config(tmp_path, **overrides) -> str:
    cfg = {
        "model_type": "llama",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg | overrides))
    return str(path)


@pytest.mark.parametrize(
    ("plot", "fragments"),
    [
        ("missing/loads.png", ["missing", "does not exist", "create the folder"]),
        ("loads.unknown", ["suffix 'unknown'", ".png", "e.g. loads.png"]),
        ("afile/loads.png", ["afile", "is a file, not a folder", "create the folder"]),
    ],
    ids=["missing-folder", "unknown-suffix", "under-a-file"],
)
def test_plan_plot_to_a_bad_path_is_one_error_line(tmp_path, capsys, plot, fragments):
    (tmp_path / "afile").write_text("")
    err = _one_error_line(["plan", "--model", "llama3-8b", "--plot", str(tmp_path / plot)], capsys)
    assert err.startswith(f"blockshard plan: error: --plot '{tmp_path / plot}'")
    for fragment in fragments:
        assert fragment in err


@pytest.mark.parametrize(("value", "kind"), [(["llama"], "array"), ({"llama": 1}, "object")])
def test_config_model_type_not_a_string_is_one_error_line(tmp_path, capsys, value, kind):
    err = _one_error_line(["plan", "--config", _llama_config(tmp_path, model_type=value)], capsys)
    assert f"model_type={value!r} is a JSON {kind}, not a string" in err
    assert '"model_type": "llama"' in err and "supported: llama" in err


@pytest.mark.parametrize("value", [10**30, 1e30], ids=["int", "float"])
def test_config_dims_of_1e30_are_one_error_line(tmp_path, capsys, value):
    err = _one_error_line(["plan", "--config", _llama_config(tmp_path, hidden_size=value)], capsys)
    assert "hidden_size=" in err and "fix the value of 'hidden_size' in the config" in err
    if isinstance(value, int):
        assert "more than 281,474,976,710,656 (2**48)" in err


def test_config_with_a_million_layers_is_refused_at_once(tmp_path, capsys):
    err = _one_error_line(["plan", "--config", _llama_config(tmp_path, num_hidden_layers=10**6)], capsys)
    assert "num_hidden_layers=1,000,000" in err and "more than the 2,000,000 tensors" in err
    assert "fix the value of 'num_hidden_layers'" in err


def test_shapes_file_with_dims_of_1e30_is_one_error_line(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text('{"tensors": [{"name": "w", "shape": [1000000000000000000000000000000, 2]}]}')
    err = _one_error_line(["plan", "--shapes", str(shapes)], capsys)
    assert "tensor 'w': shape=(1000000000000000000000000000000, 2) has about 2**100 elements" in err
    assert "more than the 281,474,976,710,656 (2**48)" in err and "check the dims" in err


@pytest.mark.parametrize("flag", ["--config", "--shapes"])
def test_deeply_nested_json_is_one_error_line(tmp_path, capsys, flag):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    err = _one_error_line(["plan", flag, str(path)], capsys)
    assert f"{path}' nests JSON arrays or objects too deeply" in err and "RecursionError" not in err


@pytest.mark.parametrize("world_size", ["1000000000", str(10**22)])
def test_huge_world_size_is_one_error_line(capsys, world_size):
    err = _one_error_line(["plan", "--model", "llama3-8b", "-W", world_size], capsys)
    assert f"--world-size={world_size} is more than 1,048,576 (2**20)" in err
    assert "pass a world size <= 1048576" in err


def test_world_size_written_as_a_float_is_argparse_error_exit_2():
    out = run("plan", "--model", "llama3-8b", "-W", "1e22")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "argument --world-size/-W: invalid int value: '1e22'" in out.stderr


@pytest.mark.parametrize("alignment", ["3", "12", "0", "-16"])
def test_alignment_not_a_power_of_two_is_one_error_line(capsys, alignment):
    err = _one_error_line(["plan", "--model", "llama3-8b", "--alignment-bytes", alignment], capsys)
    assert f"--alignment-bytes={alignment} must be a positive integer power of two" in err
    assert "pass e.g. --alignment-bytes=16" in err


@pytest.mark.parametrize("alignment", [str(2**13), str(2**30), str(2**40), str(2**62)])
def test_alignment_over_a_page_is_one_error_line(capsys, alignment):
    err = _one_error_line(["plan", "--model", "llama3-8b", "--alignment-bytes", alignment], capsys)
    assert "--alignment-bytes=" in err and "is more than 4096 bytes (a page)" in err
    assert "pass e.g. --alignment-bytes=16" in err
    assert main(["plan", "--model", "llama3-8b", "-W", "4", "--alignment-bytes", "4096", "--json"]) == 0  # control
    assert json.loads(capsys.readouterr().out)["world_size"] == 4


def test_shapes_file_over_the_size_bound_is_one_error_line(tmp_path, capsys, monkeypatch):
    """The bound on file size (512 MiB), tested with a small one (a 200 MB file takes ~45 s to plan)."""
    monkeypatch.setattr("blockshard.planner._json_file.MAX_JSON_BYTES", 2**20)
    shapes = tmp_path / "big.json"
    shapes.write_text(json.dumps({"tensors": [{"name": f"t{i}", "shape": [4, 4]} for i in range(40_000)]}))
    err = _one_error_line(["plan", "--shapes", str(shapes)], capsys)
    assert re.search(r"big.json' is 1\.\d MiB, more than the 1 MiB blockshard reads", err), err
    assert "plan a part of the model" in err


def test_shapes_file_over_the_tensor_bound_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("blockshard.planner._units.MAX_MODEL_TENSORS", 10)
    shapes = tmp_path / "many.json"
    shapes.write_text(json.dumps({"tensors": [{"name": f"t{i}", "shape": [4, 4]} for i in range(11)]}))
    err = _one_error_line(["plan", "--shapes", str(shapes)], capsys)
    assert f"shapes file '{shapes}' has 11 tensors, more than the 10 blockshard plans at once" in err
    assert "plan a part of the model" in err


def test_group_over_the_tensor_bound_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("blockshard.planner._lay_out.MAX_GROUP_TENSORS", 5)
    shapes = tmp_path / "onegroup.json"
    shapes.write_text(json.dumps({"tensors": [{"name": f"t{i}", "shape": [4, 4], "group": "g"} for i in range(6)]}))
    err = _one_error_line(["plan", "--shapes", str(shapes)], capsys)
    assert "group 'g' has 6 tensors, more than the 5 one group may hold" in err
    assert "split it into several groups" in err


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--rank", "-1"], ["--rank=-1 must be in [0, 4)", "pass a rank"]),
        (["--rank", "4"], ["--rank=4 must be in [0, 4)", "pass a rank"]),
        (["--group", "nope"], ["no group named 'nope'", "model.layers.0"]),
        (["-W", "0"], ["--world-size=0 must be an integer >= 1"]),
        (["-W", "2000000"], ["--world-size=2000000 is more than 1,048,576"]),
        (["--alignment-bytes", "12"], ["--alignment-bytes=12 must be a positive integer power of two"]),
    ],
    ids=["rank-negative", "rank-too-big", "group-unknown", "world-zero", "world-huge", "alignment-12"],
)
def test_inspect_bad_arguments_are_one_error_line(capsys, args, fragments):
    err = _one_error_line(["inspect", "--model", "llama3-8b", "-W", "4", *args], capsys)
    assert err.startswith("blockshard inspect: error:")
    for fragment in fragments:
        assert fragment in err


@pytest.mark.parametrize("policy", ["whole", "owner", "auto"])
def test_plan_policy_json(policy, capsys):
    assert main(["plan", "--model", "llama3-8b", "-W", "64", "--semantics", "muon", "--policy", policy, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy"] == policy
    for key in ("all_to_all_bytes_per_rank_max", "optimizer_state_bytes_per_rank_max", "optimizer_cost_lower_bound"):
        assert key in data and key in data["groups_by_kind"][0]
    kinds = data["policy_by_tensor_kind"]["model.layers.*.mlp.up_proj.weight"]
    if policy == "whole":
        assert data["padding_fraction"] > 0.9 and data["all_to_all_bytes_per_rank_max"] == 0 and kinds["owner"] == 0
    else:
        assert data["padding_fraction"] < 0.01 and data["all_to_all_bytes_per_rank_max"] > 0 and kinds["owner"] == 32


def test_plan_policy_table(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "-W", "64", "--semantics", "muon"]) == 0
    out = capsys.readouterr().out
    for word in ("policy auto", "optimizer step per rank", "a2a max", "cost LB", "max / LB", "policy per tensor kind"):
        assert word in out, word
    assert "mlp.experts.gate_up_proj" in out


@pytest.mark.parametrize("bad", ["bogus", "Whole", ""])
def test_bad_policy_is_one_error_line(bad, capsys):
    err = _one_error_line(["plan", "--model", "llama3-8b", "--policy", bad], capsys)
    assert f"--policy={bad!r} is not a placement policy; pass one of auto, whole, owner" in err


# -- quantized bytes (issue 14, item 5) ---------------------------------------------------------------
@pytest.mark.parametrize("sem", ["nf4", "fp4", "nf4_nested", "ao_nf4", "mx", "fp8_block:128"])
def test_plan_table_reports_quantized_bytes(sem, capsys):
    assert main(["plan", "--model", "llama3-8b", "-W", "64", "--semantics", sem]) == 0
    out = capsys.readouterr().out
    for word in ("quantized weights per rank", "held max", "held mean", "gather/step", "bf16/step", "g/bf16",
                 "g/phys"):  # fmt: skip
        assert word in out, word
    assert re.search(r"model\.layers\.\*\s+│\s+32\s+│\s+224\b", out), out  # 32 groups, 7 linears each


def test_plan_without_a_quantizer_prints_no_quantized_table(capsys):
    assert main(["plan", "--model", "llama3-8b", "-W", "8", "--semantics", "muon"]) == 0
    assert "quantized weights per rank" not in capsys.readouterr().out


def test_plan_json_quantized_bytes_under_rules(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    tensors = [{"name": f"l{i}.q.base.weight", "shape": [512, 512], "group": f"l{i}"} for i in range(2)]
    tensors += [{"name": f"l{i}.q.lora_A.weight", "shape": [8, 512], "group": f"l{i}"} for i in range(2)]
    shapes.write_text(json.dumps({"tensors": tensors}))
    sem = "*.base.weight=nf4_nested,*lora*=elementwise"
    assert main(["plan", "--shapes", str(shapes), "-W", "4", "--semantics", sem, "--json", "--layouts"]) == 0
    data = json.loads(capsys.readouterr().out)
    q = data["quantized"]
    assert q["num_tensors"] == 2 and q["numel"] == 2 * 512 * 512
    assert q["total_bytes"] == 2 * 16 * (8192 + 256 + 4)  # 16 nested blocks per weight
    assert q["rank_bytes_mean"] == q["total_bytes"] / 4 and q["gathered_over_bf16"] < 0.27
    assert [g["tensors"] for g in data["quantized_groups"]] == [["l0.q.base.weight"], ["l1.q.base.weight"]]


@pytest.mark.parametrize(
    ("sem", "fragments"),
    [
        ("w=nf4", ("tensor 'w' of shape (3, 5)", "numel 15 is not a multiple of the 64-value NF4", "Fix:")),
        ("w=ao_nf4", ("tensor 'w' of shape (3, 5)", "torchao NF4 block of 64", "Fix:")),
        ("w=mx:6", ("mx:6", "write 'mx' or 'mx:4'")),
    ],
)
def test_plan_bad_quantized_shape_is_one_error_line(tmp_path, capsys, sem, fragments):
    shapes = tmp_path / "shapes.json"
    shapes.write_text('{"tensors": [{"name": "w", "shape": [3, 5]}]}')
    err = _one_error_line(["plan", "--shapes", str(shapes), "--semantics", sem], capsys)
    for f in fragments:
        assert f in err, f


# -- quantized gather (plan --quantized-gather; the bytes equal the engine's: tests/quantized/test_fast_plan_bytes.py)
def _two_fp8_layers(tmp_path) -> str:
    shapes = tmp_path / "shapes.json"
    tensors = [
        {"name": f"layers.{i}.proj.weight", "shape": [320, 192], "dtype": "float32", "group": f"layers.{i}"}
        for i in range(2)
    ]
    tensors += [
        {"name": f"layers.{i}.proj.bias", "shape": [320], "dtype": "float32", "group": f"layers.{i}"} for i in range(2)
    ]
    shapes.write_text(json.dumps({"tensors": tensors}))
    return str(shapes)


def test_plan_quantized_gather_table_and_json(tmp_path, capsys):
    args = ["plan", "--shapes", _two_fp8_layers(tmp_path), "-W", "3", "--semantics", "*.weight=fp8_block:128"]
    assert main([*args, "--quantized-gather"]) == 0
    out = capsys.readouterr().out
    for word in ("weights gathered quantized", "masters", "S_q", "gather/step", "f+pad/step", "g/phys"):
        assert word in out, word
    assert re.search(r"layers\.\*\[quantized gather\]\s+│\s+2\s+│", out), out  # the layouts of the masters, by kind
    assert main([*args, "--quantized-gather", "--json", "--layouts"]) == 0
    data = json.loads(capsys.readouterr().out)
    q = data["quantized_gather"]
    assert q["num_tensors"] == 2 and q["payload_bytes"] == 2 * 320 * 192
    assert q["scale_bytes"] == 2 * 4 * 3 * 2  # 3 x 2 tiles of 128 x 128 per weight, 4 bytes each
    assert q["gathered_bytes_per_step_per_rank"] == 2 * 2 * 3 * data["quantized_gather_groups"][0]["segment_bytes"]
    assert q["gathered_over_padded_float"] < 0.26
    # the honest ratio: the bytes gathered over the weights' own payload and scales, the same 2 gathers
    assert q["physical_bytes_per_step_per_rank"] == 2 * (q["payload_bytes"] + q["scale_bytes"])
    assert q["gathered_over_physical"] == q["gathered_bytes_per_step_per_rank"] / q["physical_bytes_per_step_per_rank"]
    assert q["gathered_over_physical"] > 1  # W = 3 segments of whole 128-row stripes: padding moves too
    assert [g["layout"] for g in data["quantized_gather_groups"]] == [
        "layers.0[quantized gather]",
        "layers.1[quantized gather]",
    ]
    assert {g["name"] for g in data["layouts"]} == {
        "layers.0",
        "layers.1",
        "layers.0[quantized gather]",
        "layers.1[quantized gather]",
    }
    # the control: without the option the weights are frozen quantized weights of the byte planner
    assert main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "quantized_gather" not in plain and plain["quantized"]["num_tensors"] == 2


@pytest.mark.parametrize(
    ("sem", "fragments"),
    [
        ("muon", ("--quantized-gather", "semantics='muon' gives none of the model's 4 tensors one", "Fix:")),
        ("*.weight=matrix,*.weight=fp8_block:128", ("owner-computed tensors", "Fix: pass policy='whole'")),
    ],
)
def test_plan_quantized_gather_bad_input_is_one_error_line(tmp_path, capsys, sem, fragments):
    err = _one_error_line(
        ["plan", "--shapes", _two_fp8_layers(tmp_path), "-W", "3", "--semantics", sem, "--quantized-gather"], capsys
    )
    for f in fragments:
        assert f in err, f


@pytest.mark.slow  # spawns the CLI as processes, one per case
@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--model", "llama3-8b", "--json"],
        ["plan", "--model", "llama3-8b"],
        ["plan", "--list-models"],
        ["inspect", "--model", "llama3-8b", "-W", "4"],
    ],
    ids=["plan-json", "plan-table", "list-models", "inspect"],
)
def test_output_to_a_full_device_is_one_error_line(args):
    """stdout on /dev/full (ENOSPC at every write) gave a raw OSError traceback (and, at exit,
    Python's "Exception ignored ... OSError" on top)."""
    with open("/dev/full", "w") as full:
        cmd = [sys.executable, "-m", "blockshard", *args]
        out = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert re.match(
        rf"blockshard {args[0]}: error: writing the output failed \(No space left on device\); ", out.stderr
    )
    control = run(*args)  # control: the same command to a pipe
    assert control.returncode == 0 and control.stdout and not control.stderr


@pytest.mark.slow  # spawns the CLI as processes, one per case
def test_a_reader_that_closes_the_pipe_ends_quietly():
    """``blockshard plan --list-models | head -1``: no traceback and no message (the reader chose to
    stop), exit 1, as rich does for a table."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockshard", "plan", "--list-models"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # closed before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err
