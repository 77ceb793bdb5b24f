"""Bad input to the planner's API (issue 9, point 6): PlanError / ShapesError / WorldSizeError (ValueError
subclasses) naming the thing, the value, the constraint and the fix."""

from __future__ import annotations

import pytest

from blockshard._errors import PlanError, ShapesError, WorldSizeError
from blockshard.planner import GroupLayout, PlanItem, pack, plan_group, plan_model, tensors_from_hf_config
from blockshard.planner._units import check_alignment_bytes
from blockshard.semantics import TensorSpec, UnitGrid

ITEM = PlanItem(TensorSpec(name="w", shape=(4, 4)), UnitGrid.units(16, 1), 16.0)


@pytest.mark.parametrize("alignment", [3, 12, 0, -4, 16.0, True, "16"])
def test_plan_group_and_plan_model_refuse_alignment_not_a_power_of_two(alignment):
    with pytest.raises(PlanError) as info:
        plan_group([ITEM], 2, alignment_bytes=alignment)
    msg = str(info.value)
    assert f"alignment_bytes={alignment!r} must be a positive integer power of two (a number of bytes" in msg
    assert "pass e.g. alignment_bytes=16" in msg
    with pytest.raises(PlanError, match="must be a positive integer power of two"):
        plan_model([ITEM.spec], 2, alignment_bytes=alignment)


def test_one_alignment_validator_with_the_callers_name_and_error():
    class MyError(ValueError):
        pass

    assert [check_alignment_bytes(a) for a in (1, 2, 16, 4096)] == [1, 2, 16, 4096]
    with pytest.raises(MyError, match=r"--alignment-bytes=3 must be .*pass e.g. --alignment-bytes=16"):
        check_alignment_bytes(3, "--alignment-bytes", MyError)  # type: ignore[arg-type]


@pytest.mark.parametrize("world_size", [10**9, 10**22])
def test_huge_world_size_names_the_bound(world_size):
    with pytest.raises(WorldSizeError) as info:
        plan_model([ITEM.spec], world_size)
    msg = str(info.value)
    assert f"world_size={world_size} is more than 1,048,576 (2**20)" in msg and "pass a world size <= 1048576" in msg


def test_a_layout_past_int64_safety_names_the_group():
    big = PlanItem(TensorSpec(name="w", shape=(2**47,)), UnitGrid.whole(2**47), 1.0)
    with pytest.raises(PlanError) as info:
        plan_group([big], 2**20, name="layers.0")
    msg = str(info.value)
    assert "group 'layers.0' needs 1,048,576 ranks x 140,737,488,355,328 elements per rank" in msg
    assert "more than 1,152,921,504,606,846,976 (2**60)" in msg and "lower the world size" in msg


def test_plan_model_bounds_the_number_of_tensors(monkeypatch):
    monkeypatch.setattr("blockshard.planner._units.MAX_MODEL_TENSORS", 3)
    specs = [TensorSpec(name=f"t{i}", shape=(4,)) for i in range(4)]
    with pytest.raises(PlanError, match=r"the model has 4 tensors, more than the 3 blockshard plans at once"):
        plan_model(specs, 2)


@pytest.mark.parametrize(("value", "kind"), [(["llama"], "array"), ({"type": "llama"}, "object"), (7, "number")])
def test_config_dict_model_type_not_a_string(value, kind):
    with pytest.raises(ShapesError) as info:
        tensors_from_hf_config({"model_type": value, "vocab_size": 10})
    msg = str(info.value)
    assert f"config dict: model_type={value!r} is a JSON {kind}, not a string" in msg
    assert 'e.g. "model_type": "llama"' in msg


def test_config_architectures_not_a_list():
    with pytest.raises(ShapesError, match=r"architectures=5 must be a list of class names"):
        tensors_from_hf_config({"architectures": 5})


def test_config_dict_with_a_million_layers_is_refused_before_building_them():
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_attention_heads": 2}
    with pytest.raises(ShapesError) as info:
        tensors_from_hf_config(cfg | {"num_hidden_layers": 10**6})
    msg = str(info.value)
    assert "num_hidden_layers=1,000,000 gives 9 tensors or more per layer" in msg
    assert "more than the 2,000,000 tensors" in msg and "fix the value of 'num_hidden_layers'" in msg


def test_layout_pieces_of_a_rank_outside_the_world():
    layout = plan_group([ITEM], 2, name="g")
    with pytest.raises(PlanError, match=r"rank=2 must be an integer in \[0, 2\) for group 'g' on world size 2"):
        layout.pieces(2)


def test_layout_from_json_of_another_format():
    data = plan_group([ITEM], 2).to_json() | {"format": 99}
    with pytest.raises(PlanError, match=r"layout JSON has format=99, not 1; pass what GroupLayout.to_json\(\) wrote"):
        GroupLayout.from_json(data)


def test_pack_refuses_bad_world_size_and_alignment():
    with pytest.raises(WorldSizeError, match="world_size=0 must be an integer >= 1"):
        pack([UnitGrid.units(4, 1)], 0, 1)
    with pytest.raises(PlanError, match="alignment_numel=0 must be an integer >= 1"):
        pack([UnitGrid.units(4, 1)], 2, 0)


# -- quantized gather (plan_model(..., quantized_gather=True), [Note: planned quantized gather]) ---------
W_FP8 = TensorSpec(name="l0.w", shape=(640, 256), dtype="float32", group="l0")
V_FP8 = TensorSpec(name="l0.v", shape=(64, 256), dtype="float32", group="l0")


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_quantized_gather_not_a_bool_is_refused(flag):
    with pytest.raises(PlanError, match=rf"quantized_gather={flag!r} must be True or False"):
        plan_model([W_FP8], 2, semantics="fp8_block:128", quantized_gather=flag)


def test_quantized_gather_without_tile_semantics_names_the_fix():
    with pytest.raises(PlanError) as info:
        plan_model([W_FP8, V_FP8], 2, semantics="shampoo:64", quantized_gather=True)
    msg = str(info.value)
    assert "semantics='shampoo:64' gives none of the model's 2 tensors one" in msg
    assert "Fix: add a rule such as '*_proj.weight=fp8_block:128'" in msg
    plan_model([W_FP8, V_FP8], 2, semantics="shampoo:64")  # the control: planned without quantized gather


def test_quantized_gather_of_plan_items_is_refused():
    with pytest.raises(PlanError, match="quantized_gather=True needs the tensors as TensorSpec"):
        plan_model([ITEM], 2, quantized_gather=True)


def test_quantized_gather_of_a_non_float_master_is_refused():
    from blockshard._errors import QuantizedWeightError

    w = TensorSpec(name="w", shape=(128, 128), dtype="uint8")
    with pytest.raises(QuantizedWeightError, match="quantized gather of 'w': its dtype is uint8"):
        plan_model([w], 2, semantics="fp8_block:128", quantized_gather=True)
    assert plan_model([w], 2, semantics="fp8_block:128").quantized_groups  # a frozen quantized weight: planned


def test_quantized_gather_of_two_dtypes_in_one_group_is_refused():
    v = TensorSpec(name="l0.v", shape=(64, 256), dtype="bfloat16", group="l0")
    with pytest.raises(PlanError, match=r"group 'l0\[quantized gather\]' mixes dtypes"):
        plan_model([W_FP8, v], 2, semantics="fp8_block:128", quantized_gather=True)


@pytest.mark.parametrize("policy", ["owner", "auto"])
def test_quantized_gather_of_owner_computed_tiles_is_refused(policy):
    with pytest.raises(PlanError) as info:
        plan_model([W_FP8, V_FP8], 3, semantics="matrix,fp8_block:128", policy=policy, quantized_gather=True)
    assert f"owner-computed tensors (['l0.w'], policy={policy!r}) among the weights gathered quantized" in str(
        info.value
    )
    assert "Fix: pass policy='whole'" in str(info.value)
    plan = plan_model([W_FP8, V_FP8], 3, semantics="matrix,fp8_block:128", policy="whole", quantized_gather=True)
    assert [g.name for g in plan.groups] == ["l0[quantized gather]"]
