"""``blockshard plan``'s quantized bytes are the engine's: the same shapes and semantics planned from
specs alone give, per group, exactly the ``blockshard.quantized_stats`` of the sharded model (segment,
gathered, total and replicated bytes, values) and exactly the payload and scales each rank holds
(threaded gloo ranks at W = 2 and 3; [Note: planned quantized bytes] in ``planner/_quantized.py``).

Models: the tiny Llama with its seven decoder linears in bitsandbytes 4-bit (nf4 / fp4, nested
statistics on / off: seven tensors of 2.75, 1, 0.5 ... nested blocks in one group), and stacks of
torchao ``NF4Tensor``, ``MXTensor`` and blockwise FP8 linears, one group per layer or every weight in
the root's group (one mixed group of all three formats too). Control: the planner's cuts are not
trivially equal — at W = 3 the ranks of one group hold different bytes, and a planner that ignored
the scales (payload only) would disagree with the engine.

Weights gathered quantized (``quantized_gather=True``, [Note: planned quantized gather] in
``planner/_qgather.py``): the stack of ``_qgather_runs`` (fp8_block:128, mx, mx:4 linears, fp8_block:64
experts in the root) at W = 1, 2, 3 — the float masters' layouts and the primary layouts equal the
engine's, and ``quantized_gather_stats``, each rank's held bytes and its master bytes equal
``blockshard plan --quantized-gather --json --layouts``. Control: the plan without quantized gather
keeps the weights in the primary layouts and (W > 1) cuts them by the byte planner into other segments.
"""

from __future__ import annotations

import json
from dataclasses import replace

import _ao_runs
import _fp8_runs
import _inproc
import _mx_runs
import _qgather_runs
import _qlora
import pytest
import torch
from torch import nn

import blockshard
from blockshard.cli import main
from blockshard.planner import plan_model
from blockshard.planner._qgather import gather_buffers_name
from blockshard.planner._quantized import plan_quantized_group
from blockshard.runtime import group_layouts, quantized_stats
from blockshard.runtime.core._state import state_of
from blockshard.runtime.quantized._frozen import frozen_buffers
from blockshard.runtime.quantized._gather import _gather_sets as gather_sets
from blockshard.semantics import TensorSpec

pytestmark = pytest.mark.timeout(300)


def _engine(rank: int, world: int, build, layers: str | None, **shard) -> dict:
    """Per quantized group: this rank's ``quantized_stats`` and the bytes it holds of its segment
    (``shard``: ``fully_shard``'s keyword arguments)."""
    with _qlora._serial():
        model = build()
    if layers is not None:
        for layer in model.get_submodule(layers):
            blockshard.fully_shard(layer, **shard)
    blockshard.fully_shard(model, **shard)
    held = {p: frozen_buffers(st).layout.rank_bytes(rank) for p, m in model.named_modules() if (st := state_of(m))
            and frozen_buffers(st) is not None}  # fmt: skip
    return {"stats": quantized_stats(model), "held": held, "report": blockshard.report(model)}


def _specs(model: nn.Module, layers: str | None, dtype: torch.dtype) -> list[TensorSpec]:
    """The planner's view of ``model``'s unquantized twin: one group per sharded layer, the rest the root's."""
    out = []
    for name, p in model.named_parameters():
        group = None
        if layers is not None and name.startswith(layers + "."):
            group = ".".join(name.split(".")[: layers.count(".") + 2])
        out.append(TensorSpec(name=name, shape=tuple(p.shape), dtype=dtype, group=group))
    return out


def _check(ranks: list[dict], plan) -> None:
    predicted = {q.group: q for q in plan.quantized_groups}
    for rank, got in enumerate(ranks):
        assert set(got["stats"]) == set(predicted), rank
        for group, stats in got["stats"].items():
            q = predicted[group]
            assert stats.local_bytes == q.segment_bytes, (rank, group)
            assert stats.gathered_bytes == q.gathered_bytes, (rank, group)
            assert stats.total_bytes == q.total_bytes, (rank, group)
            assert stats.constant_bytes == q.constant_bytes, (rank, group)
            assert stats.numel == q.numel, (rank, group)
            assert got["held"][group] == q.rank_bytes[rank], (rank, group)
        # blockshard.report's rows of the frozen quantized weights: the same bytes, per rank
        rows = {g.name: g for g in got["report"].groups if g.name.endswith("[quantized weights]")}
        assert set(rows) == {f"{g}[quantized weights]" for g in predicted}, rank
        for group, q in predicted.items():
            row = rows[f"{group}[quantized weights]"]
            assert row.held_bytes == (q.segment_bytes,) * len(ranks) and row.data_bytes == q.rank_bytes, group
            assert (
                row.total_bytes == q.total_bytes and row.padding_bytes == len(ranks) * q.segment_bytes - q.total_bytes
            )


# -- bitsandbytes 4-bit on the tiny Llama ----------------------------------------------------------
BNB = [(qt, nested) for qt in ("nf4", "fp4") for nested in (True, False)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("quant_type", "nested"), BNB, ids=lambda x: str(x))
def test_bnb4bit_llama_bytes_equal_the_plan(quant_type, nested, world):
    quant = {"quant_type": quant_type, "compress_statistics": nested}
    ranks = _inproc.run_ranks(_engine, world, args=(lambda: _qlora.qlora_llama(lora=False, **quant), "model.layers"))
    from blockshard._tiny import tiny_llama

    specs = _specs(tiny_llama(0, **_qlora.SHAPE), "model.layers", torch.float32)
    sem = f"*_proj.weight={quant_type}{'_nested' if nested else ''}"
    plan = plan_model(specs, world, semantics=sem)
    _check(ranks, plan)
    assert {q.group for q in plan.quantized_groups} == {"model.layers.0", "model.layers.1"}
    if world == 3 and nested:  # the control: a real cut of whole nested blocks, not W equal shares
        assert len(set(plan.quantized_groups[0].rank_bytes)) > 1
    # the control: the same cuts without the scales (payload only) predict another segment
    q = plan.quantized_groups[0]
    stored = [(it.name, it.storage) for it in plan.items if it.spec.group == q.group and it.storage is not None]
    payload_only = plan_quantized_group(
        q.group, [(n, replace(st, sections=st.sections[:1])) for n, st in stored], world, 16
    )
    assert payload_only.segment_bytes != ranks[0]["stats"][q.group].local_bytes


# -- torchao NF4, MX, blockwise FP8 stacks --------------------------------------------------------
def _mixed() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        i, o = _ao_runs.SHAPES[0]
        return nn.ModuleDict(
            {
                "nf4": _ao_runs.NF4LoRALinear(i, o),
                "mx": _mx_runs.MXLoRALinear(*_mx_runs.SHAPES[1], "float8_e4m3fn"),
                "fp8": _fp8_runs.FP8BlockLinear(*_fp8_runs.SHAPES[0]),
            }
        )


def _twin(shapes) -> nn.Module:
    """A stack's bf16 twin: ``layers.i.weight`` (out, in) and its adapters."""
    stack = nn.Module()
    stack.layers = nn.ModuleList()
    for i, o in shapes:
        layer = nn.Module()
        layer.weight = nn.Parameter(torch.empty(o, i))
        layer.lora_a, layer.lora_b = nn.Parameter(torch.empty(4, i)), nn.Parameter(torch.empty(o, 4))
        stack.layers.append(layer)
    return stack


STACKS = {
    "ao_nf4": (_ao_runs.NF4Stack, _ao_runs.SHAPES, "*.weight=ao_nf4"),
    "mx": (lambda: _mx_runs.MXStack("float8_e4m3fn"), _mx_runs.SHAPES, "*.weight=mx"),
    "mx:4": (lambda: _mx_runs.MXStack("float4_e2m1fn_x2"), _mx_runs.SHAPES, "*.weight=mx:4"),
    "fp8_block:128": (_fp8_runs.FP8Stack, _fp8_runs.SHAPES, "*.weight=fp8_block:128"),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("layers", ["layers", None], ids=["per-layer", "one-group"])
@pytest.mark.parametrize("fmt", list(STACKS))
def test_torchao_and_fp8_stack_bytes_equal_the_plan(fmt, layers, world):
    build, shapes, sem = STACKS[fmt]
    ranks = _inproc.run_ranks(_engine, world, args=(build, layers))
    plan = plan_model(_specs(_twin(shapes), layers, torch.bfloat16), world, semantics=sem)
    _check(ranks, plan)
    assert len(plan.quantized_groups) == (len(shapes) if layers else 1)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tile_placed_fp8_bytes_equal_the_plan(world):
    """``fully_shard(..., tile_placement=True)`` of the FP8 stack holds what ``plan_model(...,
    tile_placement=True)`` predicts, per rank; the control: the stripes' plan pads more at W >= 3."""
    build, shapes, sem = STACKS["fp8_block:128"]
    ranks = _inproc.run_ranks(_engine, world, args=(build, "layers"), kwargs={"tile_placement": True})
    specs = _specs(_twin(shapes), "layers", torch.bfloat16)
    tiles = plan_model(specs, world, semantics=sem, tile_placement=True)
    _check(ranks, tiles)
    stripes = plan_model(specs, world, semantics=sem)
    if world >= 3:
        assert sum(q.segment_bytes for q in tiles.quantized_groups) < sum(
            q.segment_bytes for q in stripes.quantized_groups
        )


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("tiles", [False, True], ids=["stripes", "tiles"])
def test_stacked_fp8_expert_bytes_equal_the_plan(tiles, world):
    """Stacked frozen FP8 experts ((4, 180, 360) and (4, 360, 180) in 32 x 32 tiles, rows no
    multiple of 32) hold what the planner predicts by stripes (one expert per unit) and by tiles."""
    shard = {"tile_placement": True} if tiles else {}
    ranks = _inproc.run_ranks(_engine, world, args=(_fp8_runs.FP8ExpertStack, "layers"), kwargs=shard)
    specs = [
        TensorSpec(name=f"layers.{i}.experts.weight", shape=shape, dtype="bfloat16", group=f"layers.{i}")
        for i, shape in enumerate(_fp8_runs.EXPERT_SHAPES)
    ]
    plan = plan_model(specs, world, semantics="*.weight=fp8_block:32", tile_placement=tiles)
    _check(ranks, plan)
    assert len(plan.quantized_groups) == len(_fp8_runs.EXPERT_SHAPES)


@pytest.mark.parametrize("world", [2, 3])
def test_auto_tile_placement_takes_the_smaller_segment_per_group_as_planned(world):
    """``tile_placement="auto"``: per group, the FP8 weights by tiles where that gives a smaller segment
    than stripes (stripes on ties), in the engine as in ``plan_model(..., tile_placement="auto")``. At
    W = 2 the groups choose differently (the second's stripes pad less), so the model holds less than
    under either placement throughout; at W = 3 tiles win or tie in every group."""
    build, shapes, sem = STACKS["fp8_block:128"]
    ranks = _inproc.run_ranks(_engine, world, args=(build, "layers"), kwargs={"tile_placement": "auto"})
    specs = _specs(_twin(shapes), "layers", torch.bfloat16)
    auto = plan_model(specs, world, semantics=sem, tile_placement="auto")
    _check(ranks, auto)
    stripes, tiles = (plan_model(specs, world, semantics=sem, tile_placement=t) for t in (False, True))
    seg = [[q.segment_bytes for q in p.quantized_groups] for p in (auto, stripes, tiles)]
    assert seg[0] == [min(s, t) for s, t in zip(seg[1], seg[2], strict=True)]
    if world == 2:
        assert sum(seg[0]) < min(sum(seg[1]), sum(seg[2])), seg
    else:
        assert seg[0] == seg[2] != seg[1], seg
    # the report names each weight's placement: tiles exactly in the groups where they pad less
    hows = {r.name: r.how for r in ranks[0]["report"].params if "frozen quantized" in r.how}
    tiled = {".".join(n.split(".")[:2]) for n, how in hows.items() if "by whole tiles" in how}
    chosen = {
        q.group
        for q, s in zip(auto.quantized_groups, stripes.quantized_groups, strict=True)
        if q.segment_bytes < s.segment_bytes
    }
    assert len(hows) == len(shapes) and tiled == chosen and chosen, (hows, chosen)


@pytest.mark.parametrize("world", [2, 3])
def test_one_group_of_three_formats_equals_the_plan(world):
    ranks = _inproc.run_ranks(_engine, world, args=(_mixed, None))
    twin = nn.ModuleDict(
        {name: _twin([shape]).layers[0] for name, shape in
         (("nf4", _ao_runs.SHAPES[0]), ("mx", _mx_runs.SHAPES[1]), ("fp8", _fp8_runs.SHAPES[0]))}
    )  # fmt: skip
    sem = "nf4.weight=ao_nf4,mx.weight=mx,fp8.weight=fp8_block:128"
    plan = plan_model(_specs(twin, None, torch.bfloat16), world, semantics=sem)
    _check(ranks, plan)
    (q,) = plan.quantized_groups
    assert q.tensors == ("nf4.weight", "mx.weight", "fp8.weight")


# -- weights gathered quantized (quantized_gather=True) --------------------------------------------
GATHER_SEM = {f"layers.{k}.weight": spec for k, (*_, spec) in enumerate(_qgather_runs.LAYERS)} | {
    f"experts.{k}": spec for k, (*_, spec) in enumerate(_qgather_runs.EXPERTS)
}


def _where(layout, prefix: str = "") -> tuple:
    """Where a layout's tensors lie (names relative to the sharded module, as the engine's)."""
    tensors = tuple((t.name.removeprefix(prefix), t.offset, t.bucket, t.grid) for t in layout.tensors)
    return layout.buckets, layout.segment_numel, tensors


def _gather_engine(rank: int, world: int) -> dict:
    """Per quantized-gather buffer set: stats, the bytes this rank holds, its master bytes, its layout."""
    with _qgather_runs._serial():
        model = _qgather_runs.Stack()
    _qgather_runs._shard(model)  # each linear with semantics {"weight": spec}, the experts in the root
    sets = gather_sets(model)
    return {
        "stats": blockshard.quantized_gather_stats(model),
        "held": {p: sum(x.payload_bytes + x.scale_bytes for x in g.plan[rank]) for p, g in sets},
        "masters": {p: g.local.numel() * g.local.element_size() for p, g in sets},
        "layouts": {p: _where(g.layout) for p, g in sets},
        "primary": {p: _where(layout) for p, layout in group_layouts(model).items()},
    }


def _prefix(group: str) -> str:
    return f"{group}." if group else ""


def _gather_ranks(world: int) -> list[dict]:
    if world == 1:  # the fast tier's case: the test thread's own gloo group (threads cost 0.3 s to start)
        with _inproc.world1():
            return [_gather_engine(0, 1)]
    return _inproc.run_ranks(_gather_engine, world)


@pytest.mark.parametrize("world", [1, 2, 3])  # W = 2 and 3 run in the slow tier (conftest.py)
def test_quantized_gather_plan_equals_the_engine(world, tmp_path, capsys):
    ranks = _gather_ranks(world)
    specs = _specs(_qgather_runs.Stack(), "layers", torch.float32)
    plan = plan_model(specs, world, semantics=GATHER_SEM, quantized_gather=True)
    shapes = tmp_path / "stack.json"
    shapes.write_text(
        json.dumps(
            {
                "tensors": [
                    {"name": s.name, "shape": list(s.shape), "dtype": "float32", "group": s.group or ""} for s in specs
                ]
            }
        )
    )
    rules = ",".join(f"{k}={v}" for k, v in GATHER_SEM.items())
    argv = ["plan", "--shapes", str(shapes), "-W", str(world), "--semantics", rules, "--quantized-gather"]
    assert main([*argv, "--json", "--layouts"]) == 0
    data = json.loads(capsys.readouterr().out)
    cli = {q["group"]: q for q in data["quantized_gather_groups"]}
    groups = {q.group: q for q in plan.quantized_gather_groups}
    assert set(groups) == set(cli) == {"layers.0", "layers.1", "layers.2", "layers.3", ""}
    for rank, got in enumerate(ranks):
        assert set(got["stats"]) == set(groups), rank
        for group, stats in got["stats"].items():
            q, j = groups[group], cli[group]
            assert stats.constant_bytes == 0
            assert (stats.local_bytes, stats.gathered_bytes, stats.total_bytes, stats.numel) == (
                q.segment_bytes, q.gathered_bytes, q.total_bytes, q.numel
            ) == (j["segment_bytes"], j["gathered_bytes"], j["total_bytes"], j["numel"]), (rank, group)  # fmt: skip
            assert got["held"][group] == q.rank_bytes[rank] == j["rank_bytes"][rank], (rank, group)
            assert got["masters"][group] == q.master_bytes == j["master_bytes"], (rank, group)
            assert got["layouts"][group] == _where(q.layout, _prefix(group)), (rank, group)
        # every layout by name: each group's biases alone, and its "[quantized gather]" set (the root
        # has no primary layout: it keeps nothing but the experts)
        assert set(got["primary"]) == {g.name for g in plan.groups}, rank
        assert {gather_buffers_name(g) for g in groups} <= set(got["primary"]) and "" not in got["primary"]
        for name, where in got["primary"].items():
            assert where == _where(plan.group(name), _prefix(name.removesuffix("[quantized gather]"))), (rank, name)
    stats = ranks[0]["stats"]
    per_step = sum((1 if g == "" else 2) * s.gathered_bytes for g, s in stats.items())
    assert data["quantized_gather"]["gathered_bytes_per_step_per_rank"] == per_step
    assert data["quantized_gather"]["segment_bytes_per_rank"] == sum(s.local_bytes for s in stats.values())
    assert data["quantized_gather"]["total_bytes"] == sum(s.total_bytes for s in stats.values())
    # the control: without quantized gather the plan keeps each weight in its group's float layout and
    # cuts its bytes by the frozen quantized weights' byte planner, unlike the engine
    plain = plan_model(specs, world, semantics=GATHER_SEM)
    assert not plain.quantized_gather_groups and "quantized_gather" not in plain.to_json()
    assert _where(plain.group("layers.0"), "layers.0.") != ranks[0]["primary"]["layers.0"]
    if world > 1:  # at W = 2 the root's segment differs, at W = 3 what ranks hold of layers.3 and the root
        assert any(
            q.segment_bytes != stats[q.group].local_bytes or q.rank_bytes[r] != got["held"][q.group]
            for q in plain.quantized_groups
            for r, got in enumerate(ranks)
        )
    # one all-gather of every group: the primary layouts' floats, the quantized segments of the rest
    floats = sum((world - 1) * 4 * where[1] for name, where in ranks[0]["primary"].items() if "[" not in name)
    assert plan.allgather_bytes_per_rank == floats + sum((world - 1) * s.local_bytes for s in stats.values())
    assert plain.allgather_bytes_per_rank > plan.allgather_bytes_per_rank or world == 1
