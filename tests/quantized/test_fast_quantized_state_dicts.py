"""State dicts of sharded quantized weights (threaded gloo ranks): [Note: quantized state dicts].

``model.state_dict()`` holds every section of a quantized weight (payload, absmax, nested
statistics, torchao scalers and factors, MX and FP8 scales) as a PieceTensor of its global shape,
``blockshard.full_state_dict`` equals the unsharded quantized model's ``state_dict()`` bitwise
(keys in order, dtypes, bytes), and loading full entries or pieces restores overwritten segments
exactly, as do DCP and ``save_checkpoint`` across world sizes (W = 2 -> 1 and 1 -> 2).
Control: the sharded model's parameters are this rank's payload bytes of local shapes (what
``model.state_dict()`` held under the full names before), and overwritten segments differ.
"""

from __future__ import annotations

import _inproc
import _state_runs
import pytest
import torch

pytestmark = pytest.mark.timeout(300)

BNB = [
    {"quant_type": qt, "compress_statistics": nested, "quant_storage": storage}
    for qt in ("nf4", "fp4")
    for nested in (True, False)
    for storage in (torch.uint8, torch.bfloat16)
]


def _id(quant: dict) -> str:
    return "-".join(str(v).removeprefix("torch.") for v in quant.values())


def _check_entries(outs: list[dict], stream_names: tuple[str, ...]) -> None:
    for rank, out in enumerate(outs):
        assert out["full_differs"] == [], rank
        assert out["full_keys_in_order"], rank
        assert out["full_tensor_equal"], rank
        assert out["corrupted_differs"], rank  # the control: overwritten bytes are seen
        assert out["after_full_load"] == [] and out["after_piece_load"] == [], rank
        for name, shape in out["piece_shapes"].items():  # every piece has its tensor's global shape
            if name in out["want_shapes"]:
                assert shape == out["want_shapes"][name], name
        assert any(n.endswith(stream_names) for n in out["piece_shapes"]), out["piece_shapes"]
    # the control: a sharded weight's parameter is this rank's payload of a local shape
    weights = [n for n in outs[0]["want_shapes"] if n in outs[0]["local_shapes"] and n in outs[0]["piece_shapes"]]
    assert weights
    assert any(out["local_shapes"][n] != out["want_shapes"][n] for out in outs for n in weights)


@pytest.mark.parametrize("quant", BNB, ids=_id)
def test_bnb_state_dicts_at_w2_are_the_unsharded_models(quant):
    outs = _inproc.run_ranks(_state_runs.entries, 2, args=("bnb",), kwargs=quant)
    names = (".absmax", ".nested_absmax") if quant["compress_statistics"] else (".absmax",)
    _check_entries(outs, names)
    pieces = outs[0]["piece_shapes"]
    assert "model.layers.0.self_attn.q_proj.weight" in pieces
    assert ("model.layers.0.self_attn.q_proj.weight.nested_absmax" in pieces) == quant["compress_statistics"]
    assert "model.layers.0.self_attn.q_proj.weight.quant_map" not in pieces  # a constant: replicated


@pytest.mark.parametrize(
    ("kind", "sections"),
    [
        ("ao_nf4", (".quantized_scalers",)),
        ("mx", (".scale",)),
        ("fp8", ("weight_scale_inv",)),
        ("fp8_tiles", ("weight_scale_inv",)),
    ],
)
def test_torchao_mx_and_fp8_state_dicts_at_w2_are_the_unsharded_models(kind, sections):
    _check_entries(_inproc.run_ranks(_state_runs.entries, 2, args=(kind,)), sections)


@pytest.mark.parametrize("kind", ["fp8_experts", "fp8_experts_tiles"])
def test_stacked_fp8_expert_state_dicts_at_w3_are_the_unsharded_models(kind):
    _check_entries(_inproc.run_ranks(_state_runs.entries, 3, args=(kind,)), ("weight_scale_inv",))


def test_tile_placed_fp8_state_dicts_at_w3_are_the_unsharded_models():
    """Tile-placed entries are boxes of whole tiles ([Note: tile placement in the engine]):
    ``full_tensor()`` and loading them back are exact at W = 3 too (three ranks' tile runs)."""
    _check_entries(_inproc.run_ranks(_state_runs.entries, 3, args=("fp8_tiles",)), ("weight_scale_inv",))


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_bnb_state_dicts_at_w3():
    _check_entries(_inproc.run_ranks(_state_runs.entries, 3, args=("bnb",)), (".absmax",))


KINDS = [
    ("bnb", {}),
    ("bnb", {"quant_type": "fp4", "compress_statistics": False, "quant_storage": torch.bfloat16}),
    ("ao_nf4", {}),
    ("mx", {}),
    ("fp8", {}),
    ("fp8_tiles", {}),
]


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["dcp", "save_checkpoint"])
@pytest.mark.parametrize(("kind", "quant"), KINDS, ids=lambda x: _id(x) if isinstance(x, dict) else x)
def test_checkpoints_of_quantized_weights_reshard(kind, quant, checkpoint, tmp_path):
    for i, (w_save, w_load) in enumerate(((2, 1), (1, 2))):
        path = str(tmp_path / f"ckpt{i}")
        _inproc.run_ranks(_state_runs.dcp_save, w_save, args=(kind, path, checkpoint), kwargs=quant)
        loads = _inproc.run_ranks(_state_runs.dcp_load, w_load, args=(kind, path, checkpoint), kwargs=quant)
        for rank, out in enumerate(loads):
            assert out["corrupted_differs"], (w_save, w_load, rank)
            assert out["after_load"] == [], (w_save, w_load, rank)


# save (placement, W) -> load (placement, W): DCP reads the boxes, so tiles and stripes interchange
MOVES = [
    (("fp8_tiles", 4), ("fp8_tiles", 2)),
    (("fp8", 4), ("fp8_tiles", 3)),
    (("fp8_tiles", 3), ("fp8", 2)),
    # stacked experts (4, 180, 360) and (4, 360, 180) in 32 x 32 tiles: whole experts <-> tiles with short edges
    (("fp8_experts_tiles", 4), ("fp8_experts", 3)),
    (("fp8_experts", 2), ("fp8_experts_tiles", 3)),
]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["dcp", "save_checkpoint"])
@pytest.mark.parametrize(("save", "load"), MOVES, ids=lambda x: f"{x[0]}-W{x[1]}")
def test_fp8_checkpoints_move_between_world_sizes_and_placements(save, load, checkpoint, tmp_path):
    path = str(tmp_path / "ckpt")
    _inproc.run_ranks(_state_runs.dcp_save, save[1], args=(save[0], path, checkpoint))
    for rank, out in enumerate(_inproc.run_ranks(_state_runs.dcp_load, load[1], args=(load[0], path, checkpoint))):
        assert out["corrupted_differs"], rank  # the control: the overwritten bytes are seen
        assert out["after_load"] == [], rank


def _load_bad(rank: int, world: int, what: str) -> str:
    import blockshard

    model = _state_runs.shard(_state_runs.build("bnb"), "bnb")
    full = blockshard.full_state_dict(model)
    key = "model.layers.0.self_attn.q_proj.weight"
    if what == "quant_map":
        full[key + ".quant_map"] = full[key + ".quant_map"] + 1
    elif what == "local":
        full[key] = full[key][:10]
    try:
        model.load_state_dict(full)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("what", "fragment"),
    [("quant_map", "differs from the model's quant state"), ("local", "the model's payload is a torch.uint8 tensor")],
)
def test_loading_another_quant_state_or_a_local_piece_raises(what, fragment):
    for msg in _inproc.run_ranks(_load_bad, 2, args=(what,)):
        assert "model.layers.0.self_attn.q_proj.weight" in msg and fragment in msg and "Fix:" in msg, msg


@pytest.mark.parametrize("quant", [BNB[0], BNB[-1]], ids=_id)
def test_save_pretrained_writes_the_unsharded_4bit_models_entries(quant, tmp_path):
    outs = _inproc.run_ranks(_state_runs.export, 2, args=("bnb", str(tmp_path)), kwargs=quant)
    got = outs[0]
    assert got["differs"] == []
    assert got["not_written"] in ([], ["lm_head.weight"])  # a tied name is written once, as Hugging Face does
    q = "model.layers.0.self_attn.q_proj.weight."
    packed = f"{q}quant_state.bitsandbytes__{quant['quant_type']}"
    assert {f"{q}absmax", f"{q}quant_map", packed} <= set(got["quantized_keys"])
    assert (f"{q}nested_absmax" in got["quantized_keys"]) == quant["compress_statistics"]


def test_save_pretrained_of_blockwise_fp8_writes_the_unsharded_models_entries(tmp_path, monkeypatch):
    """Streamed in chunks of an odd byte count that end inside a rank's payload piece (the 4-bit
    exports above section whole pieces)."""
    from blockshard.runtime.checkpoint import _export

    monkeypatch.setattr(_export, "_CHUNK_BYTES", 8191)
    # by stripes and by whole tiles ([Note: tile placement in the engine]); stacked experts both ways
    for kind in ("fp8", "fp8_tiles", "fp8_experts", "fp8_experts_tiles"):
        got = _inproc.run_ranks(_state_runs.export, 2, args=(kind, str(tmp_path / kind)))[0]
        assert got["differs"] == [] and got["not_written"] == [], kind


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_save_pretrained_of_torchao_nf4_raises_before_writing(tmp_path):
    for out in _inproc.run_ranks(_state_runs.export, 2, args=("ao_nf4", str(tmp_path / "out"))):
        assert "quantized weight 'layers.0.weight'" in out["error"] and "torchao NF4Tensor" in out["error"], out[
            "error"
        ]
        assert "Fix: save a checkpoint with blockshard.save_checkpoint" in out["error"]
        assert out["files"] == []


@pytest.mark.parametrize("kind", ["bnb", "ao_nf4", "fp8_tiles"])
def test_torch_get_and_set_model_state_dict(kind):
    for out in _inproc.run_ranks(_state_runs.torch_helpers, 2, args=(kind,)):
        assert out["sharded_keys"]  # torch resolves the quantized entries' names (weight.absmax, ...)
        assert out["full_differs"] == [] and out["after_set"] == []


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
def test_a_forward_that_keeps_layers_gathered_changes_no_entry():
    for out in _inproc.run_ranks(_state_runs.after_forward, 2):
        assert out["gathered"] == "Params4bit"  # the layer holds the format's parameter now
        assert out["keys_equal"] and out["changed"] == []
        assert out["full_differs"] == []


def test_save_pretrained_writes_what_hugging_face_writes_for_the_unsharded_model(tmp_path):
    import json
    import os

    from safetensors.torch import load_file

    def read(path) -> dict:
        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}

    with _inproc.single_thread():
        _state_runs.build("bnb").save_pretrained(tmp_path / "hf")  # transformers' own, unsharded
    _inproc.run_ranks(_state_runs.export, 2, args=("bnb", str(tmp_path / "ours")))
    hf, ours = read(tmp_path / "hf"), read(tmp_path / "ours")
    assert (
        json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())["weight_map"].keys() == ours.keys()
    )
    assert sorted(hf) == sorted(ours) and any(k.endswith(".weight.quant_state.bitsandbytes__nf4") for k in hf)
    assert [k for k in hf if not _state_runs.same(hf[k], ours[k])] == []


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("kind", ["bnb", "ao_nf4"])
def test_blockshard_sharded_and_full_state_dicts_carry_quantized_weights(kind, world):
    """``sharded_state_dict`` holds every quantized section (before: none of them, and both loads left
    the overwritten segments as they were)."""
    outs = _inproc.run_ranks(_state_runs.blockshard_state_dicts, world, args=(kind,))
    for out in outs:
        assert out["missing"] == [] and out["same_pieces"]
        assert out["corrupted_differs"]  # the control
        assert out["after_sharded_load"] == [] and out["after_full_load"] == []
        partial = out["errors"][1]
        assert f"'{out['payload']}" in partial and "has no such entry" in partial and "Fix:" in partial, partial
    wrong = [out["errors"][0] for out in outs if out["errors"][0]]  # a whole section where a rank holds less
    assert bool(wrong) == (world > 1), wrong  # at W = 1 the whole section is the rank's piece
    for msg in wrong:
        assert f"{outs[0]['payload']!r}" in msg and "this rank holds piece" in msg and "Fix:" in msg, msg


@pytest.mark.parametrize("world", [2, 1])
def test_sharded_state_dicts_of_tile_placed_fp8_name_their_order(world):
    """``sharded_state_dict`` gives a tile-placed weight's pieces in tile-major order and says so
    (``LocalShard.order``); both loads restore overwritten segments; a row-major piece of the same
    numbers (even the whole tensor at W = 1) raises, naming the order."""
    outs = _inproc.run_ranks(_state_runs.blockshard_state_dicts, world, args=("fp8_tiles",))
    for out in outs:
        assert out["missing"] == [] and out["orders"] == {"tile-major 128 x 128"}
        assert out["corrupted_differs"]  # the control
        assert out["after_sharded_load"] == [] and out["after_full_load"] == []
        msg = out["errors"][0]
        assert f"{out['payload']!r}" in msg and "in row-major order" in msg and "tile-major 128 x 128" in msg, msg


def test_the_checkpoint_record_holds_the_quantized_layouts(tmp_path, capsys):
    """``blockshard.json`` records each quantized group's layout (format, units, every rank's units and
    pieces of every entry) for ``blockshard inspect``; before, a group of quantized weights only was left
    out and a mixed one recorded its float parameters alone."""
    from blockshard.cli import main
    from blockshard.runtime import describe_checkpoint

    path = str(tmp_path / "ckpt")
    outs = _inproc.run_ranks(_state_runs.record, 2, args=("ao_nf4", path))
    groups = describe_checkpoint(path)["quantized_groups"]
    assert [g["module"] for g in groups] == ["layers.0", "layers.1", "layers.2"]
    assert [(g["layout_hash"], g["segment_bytes"]) for g in groups] == [(h, s) for h, s, _ in outs[0]["layouts"]]
    for g, (_, _, units) in zip(groups, outs[0]["layouts"], strict=True):
        (t,) = g["tensors"]
        assert t["format"] == "torchao NF4Tensor" and g["world_size"] == 2 and g["class"] == "NF4LoRALinear"
        assert t["pieces"] == [[r, a, b - a] for r, held in enumerate(units) for a, b in held]
        assert sum(n for _, _, n in t["pieces"]) == t["units"]
        for name, pieces in t["entries"].items():  # every rank's piece of every section, as DCP saved it
            assert {r: (a, n) for r, a, n in pieces} == {
                r: out["pieces"][name] for r, out in enumerate(outs) if out["pieces"][name][1]
            }, name
    assert {"layers.0.weight", "layers.0.weight.quantized_scalers"} <= set(groups[0]["tensors"][0]["entries"])
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "quantized group layers.0 (NF4LoRALinear): world size 2" in out and "torchao NF4Tensor x1" in out


def test_the_checkpoint_record_names_a_tile_placed_order(tmp_path, capsys):
    """A tile-placed weight's record says its units are tiles in tile-major order (``tile_major``,
    the payload's runs of full and edge tiles), its entries' pieces in that order."""
    from blockshard.cli import main
    from blockshard.runtime import describe_checkpoint

    path = str(tmp_path / "ckpt")
    outs = _inproc.run_ranks(_state_runs.record, 2, args=("fp8_tiles", path))
    groups = describe_checkpoint(path)["quantized_groups"]
    for g, (_, _, units) in zip(groups, outs[0]["layouts"], strict=True):
        (t,) = g["tensors"]
        assert t["tile_major"] == [128, 128] and t["pieces"] == [
            [r, a, b - a] for r, held in enumerate(units) for a, b in held
        ]
        payload, scales = t["streams"]
        assert sum(n * size for n, size in payload["runs"]) == payload["bytes"] and "runs" not in scales
        assert sum(n for n, _ in payload["runs"]) == t["units"] == scales["bytes"] // 4
    assert main(["inspect", path]) == 0
    assert "quantized group layers.0 (FP8BlockLinear): world size 2" in capsys.readouterr().out
