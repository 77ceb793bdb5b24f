"""The planner's quantized bytes ([Note: planned quantized bytes]): the engine's cuts without its unit
list, totals per rank and per step, JSON, and bad input naming the tensor and the fix.

Oracle: the engine's own pure layout (``runtime/quantized/_layout.plan_quantized``, which sums every
unit's bytes) on random quantized tensors, world sizes and alignments: the same bytes per rank and
the same segment, including exact ties between two boundaries.
"""

from __future__ import annotations

import pytest
from _tier import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from blockshard import SemanticsError
from blockshard.planner import model_tensors, plan_model
from blockshard.planner._quantized import plan_quantized_group
from blockshard.runtime.quantized._layout import SectionShape, plan_quantized
from blockshard.semantics import TensorSpec, get_semantics

FORMATS = ["nf4", "fp4", "nf4_nested", "fp4_nested", "ao_nf4", "mx", "mx:4", "fp8_block:128", "fp8_block:4"]


def _shape(fmt: str, a: int, b: int) -> tuple[int, ...]:
    if fmt == "ao_nf4":
        return (a * 64, 256 * b)  # a multiple of the 16384-value super-block
    if fmt.startswith("mx"):
        return (a, 32 * b)
    if fmt.startswith("fp8_block"):
        return (a, b)
    return (a, 64 * b)  # bitsandbytes: a multiple of 64 values


tensors = st.lists(st.tuples(st.sampled_from(FORMATS), st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=6)


@settings(max_examples=examples(300), deadline=None)
@given(tensors, st.integers(1, 17), st.sampled_from([1, 16, 256, 4096]))
def test_cuts_equal_the_engines_layout(specs, world, align):
    storages = [get_semantics(f).storage(_shape(f, a, b), "bfloat16") for f, a, b in specs]
    engine = plan_quantized(
        [(tuple(SectionShape(s.name, s.nbytes, s.unit_bytes) for s in st_.sections), st_.n_units) for st_ in storages],
        world,
        align,
    )
    got = plan_quantized_group("g", [(f"t{i}", s) for i, s in enumerate(storages)], world, align)
    assert got.rank_bytes == tuple(engine.rank_bytes(r) for r in range(world))
    assert got.segment_bytes == engine.segment_bytes and got.total_bytes == engine.total_bytes


def test_ties_go_to_the_lower_boundary_as_in_the_engine():
    # three units of 8452 B at W = 2: the ideal cut (1.5 units) is as far from either boundary
    st_ = get_semantics("nf4_nested").storage((3 * 128, 128), "bfloat16")
    assert st_.n_units == 3 and st_.unit_bytes == 8192 + 256 + 4
    got = plan_quantized_group("g", [("w", st_)], 2, 16)
    assert got.rank_bytes == (8452, 2 * 8452)  # 1.5 units from each side: the lower boundary wins


def test_llama_nf4_totals_per_rank_and_per_step():
    W = 64
    plan = plan_model(model_tensors("llama3-8b"), W, semantics="nf4")
    q = plan.quantized_totals()
    numel = sum(it.numel for it in plan.items if it.storage is not None)
    assert q["num_tensors"] == 32 * 7 and q["numel"] == numel  # every decoder linear, not embed / head / norms
    assert q["payload_bytes"] == numel // 2 and q["scale_bytes"] == numel // 64 * 4
    assert q["rank_bytes_mean"] == q["total_bytes"] / W and q["rank_bytes_max"] >= q["rank_bytes_mean"]
    layers = [g for g in plan.quantized_groups if g.group]
    assert all(g.gathers_per_step == 2 for g in layers)  # forward and backward, reshard_after_forward
    assert q["gathered_bytes_per_step_per_rank"] == sum(2 * W * g.segment_bytes for g in layers)
    assert q["gathered_bytes_per_step_total"] == W * q["gathered_bytes_per_step_per_rank"]
    assert q["bf16_gathered_bytes_per_step_per_rank"] == 2 * 2 * numel
    assert q["gathered_over_bf16"] == pytest.approx(0.5625 / 2, rel=1e-3)  # 4.5 bits per value against 16
    assert plan.quantized_by_kind()["model.layers.*"]["num_groups"] == 32


@pytest.mark.parametrize(
    ("sem", "ratio"),
    [("nf4_nested", (8192 + 256 + 4) / 16384 / 2), ("ao_nf4", (8192 + 256 + 2) / 16384 / 2), ("mx:4", 17 / 64)],
)
def test_gathered_over_bf16_is_the_formats_bytes_per_value(sem, ratio):
    q = plan_model(model_tensors("llama3-8b"), 8, semantics=sem).quantized_totals()
    assert q["gathered_over_bf16"] == pytest.approx(ratio, rel=1e-3)


def test_the_root_is_gathered_once_per_step():
    specs = [TensorSpec(name="w", shape=(128, 128), dtype="bfloat16")]
    (q,) = plan_model(specs, 2, semantics="nf4").quantized_groups
    assert q.group == "" and q.gathers_per_step == 1


def test_rules_quantize_the_frozen_base_and_leave_lora_elementwise():
    specs = [
        TensorSpec(name="l.q.base.weight", shape=(256, 256), dtype="bfloat16", group="l"),
        TensorSpec(name="l.q.lora_A.weight", shape=(8, 256), dtype="bfloat16", group="l"),
        TensorSpec(name="l.q.lora_B.weight", shape=(256, 8), dtype="bfloat16", group="l"),
    ]
    plan = plan_model(specs, 4, semantics="*.base.weight=nf4_nested,*lora*=elementwise")
    (q,) = plan.quantized_groups
    assert q.tensors == ("l.q.base.weight",) and q.numel == 65536


def test_json_reports_quantized_bytes_only_when_there_are_some():
    plan = plan_model(model_tensors("llama3-8b"), 8, semantics="fp8_block:128")
    data = plan.to_json(layouts=True)
    assert data["quantized"]["total_bytes"] == plan.quantized_totals()["total_bytes"]
    assert data["quantized"]["groups_by_kind"][0]["kind"] == "model.layers.*"
    assert len(data["quantized_groups"]) == 32 and len(data["quantized_groups"][0]["rank_bytes"]) == 8
    assert "quantized" not in plan_model(model_tensors("llama3-8b"), 8).to_json()


def test_plans_405b_on_16384_ranks_quickly():
    import time

    t0 = time.perf_counter()
    plan = plan_model(model_tensors("llama3-405b"), 16384, semantics="nf4_nested")
    seconds = time.perf_counter() - t0
    assert len(plan.quantized_groups) == 126 and seconds < 20  # a loaded 2-core machine; about 1 s idle


@pytest.mark.parametrize(
    ("sem", "shape", "pattern"),
    [
        ("nf4", (3, 5), r"tensor 'm\.w' of shape \(3, 5\).*numel 15 is not a multiple of the 64-value NF4"),
        ("fp4", (3, 5), r"numel 15 is not a multiple of the 64-value FP4"),
        ("nf4_nested", (3, 5), r"numel 15 is not a multiple of the 64-value NF4"),
        ("ao_nf4", (3, 64), r"numel 192 is not a multiple of the torchao NF4 super-block.*3 blocks do not fill"),
        ("ao_nf4", (3, 5), r"numel 15 is not a multiple of the torchao NF4 block of 64"),
        ("mx:4", (4, 33), r"last dim 33 is not a multiple of the MX block of 32"),
    ],
)
def test_bad_shapes_name_the_tensor_and_the_fix(sem, shape, pattern):
    with pytest.raises(SemanticsError, match=pattern) as info:
        plan_model([TensorSpec(name="m.w", shape=shape, dtype="bfloat16")], 2, semantics=f"m.w={sem}")
    assert "Fix:" in str(info.value)


def test_bad_mx_argument():
    with pytest.raises(SemanticsError, match=r"mx:6: the argument is the payload's bits per value, 8 .* or 4"):
        get_semantics("mx:6")


# -- weights gathered quantized ([Note: planned quantized gather]) ------------------------------------
TILE_FORMATS = ["mx", "mx:4", "fp8_block:128", "fp8_block:4", "fp8_block:8"]


def _tile_shape(fmt: str, e: int, a: int, b: int) -> tuple[int, ...]:
    if fmt.startswith("mx"):
        return (a, 32 * b)
    return (a, b) if e == 1 else (e, a, b)  # stacked experts: per expert stripes, or one expert a unit


tile_tensors = st.lists(
    st.tuples(st.sampled_from(TILE_FORMATS), st.integers(1, 3), st.integers(1, 40), st.integers(1, 24)),
    min_size=1,
    max_size=5,
)


@pytest.mark.heavy  # in process, seconds: out of `make test-fast` (its one-minute budget)
@settings(max_examples=examples(40), deadline=None)
@given(tile_tensors, st.integers(1, 9), st.sampled_from(["float32", "bfloat16"]))
def test_gather_segments_equal_the_engines_payload_plan(specs, world, dtype):
    """The planner's quantized segments against the engine's ``plan_payload`` and tile quantizers
    (``runtime/quantized/_gather.py``, ``runtime/quantized/_tile_quant.py``) on the same float layout."""
    from types import SimpleNamespace

    import torch

    from blockshard.runtime.quantized._gather import plan_payload
    from blockshard.runtime.quantized._tile_quant import tile_quantizer

    shapes = {f"t{i}": _tile_shape(f, e, a, b) for i, (f, e, a, b) in enumerate(specs)}
    sem = {f"t{i}": f for i, (f, *_) in enumerate(specs)}
    tensors = [TensorSpec(name=n, shape=s, dtype=dtype, group="g") for n, s in shapes.items()]
    plan = plan_model(tensors, world, semantics=sem, quantized_gather=True, policy="whole")
    (q,) = plan.quantized_gather_groups
    index = {t.name: i for i, t in enumerate(q.layout.tensors)}
    params = [
        SimpleNamespace(fqn=n, shape=s, numel=(k := q.layout.tensors[index[n]].numel), stored_numel=k, index=index[n])
        for n, s in shapes.items()
    ]
    tdtype = getattr(torch, dtype)
    quantizers = {p.fqn: tile_quantizer(p.fqn, p.shape, tdtype, [get_semantics(sem[p.fqn])]) for p in params}
    pieces, segment_bytes = plan_payload("g", q.layout, params, lambda sp: quantizers[sp.fqn])  # type: ignore[arg-type]
    assert q.segment_bytes == segment_bytes
    assert q.rank_bytes == tuple(sum(x.payload_bytes + x.scale_bytes for x in ps) for ps in pieces)
    whole = sum(quantizers[n].payload_bytes(0, p.numel) for n, p in zip(shapes, params, strict=True))
    assert q.payload_bytes == whole and q.total_bytes == sum(q.rank_bytes)
