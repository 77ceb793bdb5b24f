"""``plan_model(..., tile_placement=True)`` ([Note: planned tile placement]): fp8_block weights
planned in their tile-major parts, one tile as the placement unit -- a what-if of the design.

Measured (printed by ``blockshard plan``): Llama-3-8B ``fp8_block:128`` pads 89.75% at W = 1024 with
stripes and under 1% tile-placed; gathered quantized, stripes gather 5x the physical bytes, tiles
1.00x. The controls are the stripe plans of the same models."""

from __future__ import annotations

import json

import pytest
import torch
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard._errors import PlanError
from blockshard.cli import main as cli_main
from blockshard.planner import compare, model_tensors, plan_model
from blockshard.runtime.quantized._fp8_block import fp8_block_sections, tile_sections
from blockshard.runtime.quantized._frozen import Found, _tiles_pad_less
from blockshard.runtime.quantized._layout import plan_quantized
from blockshard.semantics import TensorSpec


@pytest.fixture(scope="module")
def llama8b():
    return model_tensors("llama3-8b")


def test_tiles_remove_the_stripes_padding_at_large_w(llama8b):
    stripe = plan_model(llama8b, 1024, semantics="fp8_block:128")
    tile = plan_model(llama8b, 1024, semantics="fp8_block:128", tile_placement=True)
    assert stripe.padding_fraction > 0.8  # the control: ranks hold one 128-row stripe or none
    assert tile.padding_fraction < 0.01, tile.padding_fraction
    assert tile.total_numel == stripe.total_numel
    names = {t.name for g in tile.groups for t in g.tensors}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert {f"{q}[tiles]"} <= names and q not in names  # 4096 x 4096: full tiles only
    part = next(t for g in tile.groups for t in g.tensors if t.name == f"{q}[tiles]")
    assert part.grid.unit_numel == 128 * 128 and part.numel == 4096 * 4096
    assert tile.to_json()["tile_placed_weights"] == 7 * 32 and stripe.to_json()["tile_placed_weights"] == 0


def test_baselines_are_computed_on_the_weights_not_the_parts(llama8b):
    stripe = compare(plan_model(llama8b, 64, semantics="fp8_block:128"))
    tile = compare(plan_model(llama8b, 64, semantics="fp8_block:128", tile_placement=True))
    assert stripe.baselines == tile.baselines
    for a, b in zip(stripe.kinds, tile.kinds, strict=True):
        assert a.kind == b.kind and a.baselines == b.baselines


def test_quantized_gather_moves_the_physical_bytes_under_tiles(llama8b):
    stripe = plan_model(llama8b, 1024, semantics="fp8_block:128", quantized_gather=True).quantized_gather_totals()
    tile = plan_model(
        llama8b, 1024, semantics="fp8_block:128", quantized_gather=True, tile_placement=True
    ).quantized_gather_totals()
    assert stripe["gathered_over_physical"] > 2  # the control
    assert tile["gathered_over_physical"] <= 1.02, tile
    assert tile["payload_bytes"] == stripe["payload_bytes"] and tile["scale_bytes"] == stripe["scale_bytes"]


def test_edge_tiles_and_stacked_experts_become_their_parts():
    """A GPT-OSS-shaped expert stack scaled down ((4, 180, 360), B = 32: a 20-row bottom edge, an
    8-column right edge, a corner) and a 2-D weight with both edges; a weight combined with another
    semantics and a 1-D tensor keep their grids."""
    specs = [
        TensorSpec(name="layers.0.mlp.experts.gate_up_proj", shape=(4, 180, 360), dtype="float32", group="layers.0"),
        TensorSpec(name="layers.0.proj.weight", shape=(70, 50), dtype="float32", group="layers.0"),
        TensorSpec(name="layers.0.other.weight", shape=(64, 64), dtype="float32", group="layers.0"),
        TensorSpec(name="layers.0.norm.weight", shape=(50,), dtype="float32", group="layers.0"),
    ]
    rules = {
        "*experts*": "fp8_block:32",
        "*proj.weight": "fp8_block:32",
        "*other.weight": "fp8_block:32",
        "*other*": "bnb8bit",
    }
    plan = plan_model(specs, 6, semantics=rules, tile_placement=True)
    parts = {t.name: (t.numel, t.grid.unit_numel) for g in plan.groups for t in g.tensors}
    e = "layers.0.mlp.experts.gate_up_proj"
    assert parts[f"{e}[tiles]"] == (4 * 5 * 11 * 32 * 32, 32 * 32) and parts[f"{e}[corner]"] == (4 * 20 * 8, 20 * 8)
    assert parts[f"{e}[right]"] == (4 * 5 * 32 * 8, 32 * 8) and parts[f"{e}[bottom]"] == (4 * 11 * 20 * 32, 20 * 32)
    p = "layers.0.proj.weight"
    assert {k: v for k, v in parts.items() if k.startswith(p)} == {
        f"{p}[tiles]": (2 * 1 * 32 * 32, 32 * 32),
        f"{p}[right]": (2 * 32 * 18, 32 * 18),
        f"{p}[bottom]": (1 * 6 * 32, 6 * 32),
        f"{p}[corner]": (6 * 18, 6 * 18),
    }
    assert "layers.0.other.weight" in parts and "layers.0.norm.weight" in parts
    assert sum(n for n, _ in parts.values()) == sum(s.numel for s in specs)


def test_tile_placement_takes_a_bool_or_auto():
    with pytest.raises(PlanError, match=r"tile_placement='yes' must be True, False or 'auto'"):
        plan_model([TensorSpec(name="w", shape=(4, 4))], 2, semantics="fp8_block:2", tile_placement="yes")


def test_the_cli_plans_the_what_if(capsys):
    assert (
        cli_main(
            ["plan", "--model", "llama3-8b", "-W", "1024", "--semantics", "fp8_block:128", "--tile-placement", "--json"]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["tile_placed_weights"] == 7 * 32 and data["padding_fraction"] < 0.01


@settings(max_examples=examples(80), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=4),
    st.sampled_from([4, 16, 32, 128]),
    st.integers(1, 17),
)
def test_the_planned_bytes_are_the_engines_under_tile_placement(shapes, tile, world):
    """The planner's frozen FP8 bytes per rank under ``tile_placement=True`` equal the engine's own
    pure layout of the same weights placed by tiles (``fully_shard(..., tile_placement=True)``:
    ``_fp8_block.tile_sections`` cut by ``plan_quantized``), on random shapes with edge tiles."""
    specs = [TensorSpec(name=f"w{i}", shape=s, dtype="bfloat16") for i, s in enumerate(shapes)]
    plan = plan_model(specs, world, semantics=f"fp8_block:{tile}", tile_placement=True)
    (q,) = plan.quantized_groups
    laid = [tile_sections(s, (tile, tile)) for s in shapes]
    engine = plan_quantized([(sections, order.n_tiles) for order, sections in laid], world, 16)
    assert q.rank_bytes == tuple(engine.rank_bytes(r) for r in range(world))
    assert q.segment_bytes == engine.segment_bytes and q.total_bytes == engine.total_bytes


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=3),
    st.sampled_from([16, 32, 128]),
    st.integers(1, 9),
)
def test_auto_chooses_as_the_engine_and_never_pads_more(shapes, tile, world):
    """``tile_placement="auto"``: the planner takes tiles for a group exactly where the engine's
    ``fully_shard(..., tile_placement="auto")`` does (``_frozen._tiles_pad_less`` on the modules'
    weights), and the group's segment is the smaller of the two placements' (stripes on ties)."""
    specs = [TensorSpec(name=f"w{i}", shape=s, dtype="bfloat16") for i, s in enumerate(shapes)]
    sem = f"fp8_block:{tile}"
    (auto,), (stripes,), (tiles,) = (
        plan_model(specs, world, semantics=sem, tile_placement=t).quantized_groups for t in ("auto", False, True)
    )
    assert auto.segment_bytes == min(stripes.segment_bytes, tiles.segment_bytes)
    found = [
        Found(
            f"w{i}",
            [],
            torch.nn.Parameter(torch.zeros(r, c, dtype=torch.float8_e4m3fn), requires_grad=False),
            (f"w{i}_scale_inv", None, torch.nn.Parameter(torch.ones(-(-r // tile), -(-c // tile)))),  # type: ignore[arg-type]
            (tile, tile),
        )
        for i, (r, c) in enumerate(shapes)
    ]
    engine_tiles = _tiles_pad_less(found, {}, world, 16)
    assert engine_tiles == (tiles.segment_bytes < stripes.segment_bytes)
    assert (auto.segment_bytes, auto.rank_bytes) == (
        (tiles if engine_tiles else stripes).segment_bytes,
        (tiles if engine_tiles else stripes).rank_bytes,
    )


def test_the_cli_plans_auto_placement(capsys):
    """``--tile-placement auto`` at W = 1024 takes the tiles (stripes pad most); at W = 1 the stripes (no padding to win)."""
    args = ["plan", "--model", "llama3-8b", "--semantics", "fp8_block:128", "--tile-placement", "auto", "--json"]
    assert cli_main([*args, "-W", "1024"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tile_placed_weights"] == 7 * 32 and data["padding_fraction"] < 0.01
    assert cli_main([*args, "-W", "1"]) == 0
    assert json.loads(capsys.readouterr().out).get("tile_placed_weights", 0) == 0
    bad = ["plan", "--model", "llama3-8b", "--semantics", "fp8_block:128", "--tile-placement", "bogus"]
    with pytest.raises(SystemExit) as exc:  # argparse's own refusal, exit 2
        cli_main(bad)
    assert exc.value.code == 2 and "--tile-placement: invalid choice: 'bogus'" in capsys.readouterr().err


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(1, 120), st.integers(1, 120)), min_size=1, max_size=3),
    st.sampled_from([8, 16, 32]),
    st.integers(1, 9),
    st.booleans(),
)
def test_stacked_expert_bytes_are_the_engines_by_stripes_and_tiles(shapes, tile, world, tiles):
    """Stacked ``(E, rows, cols)`` FP8 experts: the planner's bytes per rank equal the engine's pure
    layout (``_fp8_block.fp8_block_sections`` cut by ``plan_quantized``) by stripes (one expert per
    unit where rows are no multiple of the tile) and by tiles (each expert's edge tiles)."""
    specs = [TensorSpec(name=f"l{i}.experts.weight", shape=s, dtype="bfloat16") for i, s in enumerate(shapes)]
    plan = plan_model(specs, world, semantics=f"fp8_block:{tile}", tile_placement=tiles)
    (q,) = plan.quantized_groups
    laid = []
    for i, (e, r, c) in enumerate(shapes):
        w = torch.zeros(e, r, c, dtype=torch.float8_e4m3fn)
        scale = torch.ones(e, -(-r // tile), -(-c // tile))
        _, sections, n_units = fp8_block_sections(f"l{i}", w, scale, (tile, tile), tile_placement=tiles)
        laid.append((sections, n_units))
    engine = plan_quantized(laid, world, 16)
    assert q.rank_bytes == tuple(engine.rank_bytes(r) for r in range(world))
    assert q.segment_bytes == engine.segment_bytes and q.total_bytes == engine.total_bytes
